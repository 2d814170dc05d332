"""Each rank's pipeline order as torch 2.13's schedules compute it, for the tests that hold
europa-plan's torch-free orders to torch's: a schedule computes its order when built, over
stand-in stages, before any tensor moves; 1F1B runs one stage a rank without a list, and
its order is written out as ``Schedule1F1B`` runs it."""

from __future__ import annotations

from torch import nn

from europa.core.pipeline.schedules import SCHEDULES
from europa.plan.schedules import SHARE, Action, one_f_one_b, stages_of_rank


class _StandInStage:
    """What a multi-stage schedule reads of its stages when it computes its order."""

    def __init__(self, index: int, stages: int, pp: int, rank: int) -> None:
        self.stage_index, self.num_stages = index, stages
        self.group_size, self.group_rank = pp, rank
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = nn.Module()  # a check for torch.compile reads its type


def _no_loss(output, target):  # pragma: no cover - never called: nothing runs
    raise AssertionError("a stand-in schedule computes no loss")


def torch_rank_orders(schedule: str, pp: int, per_rank: int, micro: int) -> dict[int, list[Action]]:
    """torch's orders, flattened as europa-plan lists them: idle slots dropped, paired
    forward-backward actions (DualPipeV's ``OVERLAP_F_B``) as their two parts in turn."""
    if schedule == "1f1b":
        return {r: one_f_one_b(r, pp, micro) for r in range(pp)}
    stages = pp * per_rank
    held = [_StandInStage(i, stages, pp, 0) for i in stages_of_rank(schedule, 0, pp, per_rank)]
    built = SCHEDULES[schedule](held, micro, loss_fn=_no_loss, scale_grads=False)
    return {rank: _flatten(order) for rank, order in built.pipeline_order.items()}


def _flatten(order) -> list[Action]:
    out = []
    for action in order:
        if action is None:
            continue
        paired = bool(action.sub_actions)
        for part in action.sub_actions or (action,):
            kind = part.computation_type.value
            if kind not in SHARE:
                raise ValueError(f"pipeline action {part} of kind {kind!r}: not a computation")
            out.append(Action(part.stage_index, kind, part.microbatch_index, paired))
    return out
