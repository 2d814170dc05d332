"""What the config rules read of a pipeline schedule (its names and stage placement are
europa-plan's, ``europa.plan.schedules``) before any rank starts: nothing here imports torch."""

from __future__ import annotations

from europa.plan.schedules import V_SHAPED  # the planner's: one placement of the stages

SPLIT_BACKWARD = ("zbv", "dualpipev")  # input gradients, then weight gradients apart
SINGLE_STAGE = ("1f1b",)
STAGE_SEND_KIND = "pipeline_send"  # the planner's traffic kind: hidden states and gradients


def fixed_stages_per_rank(schedule: str) -> int | None:
    """The stages a rank must hold under ``schedule``; None: any number from 2."""
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED:
        return 2
    return None


def stages_per_rank(schedule: str, stated: int) -> int:
    """The stages a pipeline rank holds: as stated, else the schedule's own (2 where it
    takes any number from 2)."""
    return stated or fixed_stages_per_rank(schedule) or 2
