"""``--search`` with pipeline stages: layouts around the best one without stages.

Planning every lever's product once more for each number of stages and each schedule
would multiply the search by twenty and each layout by its pipeline ranks. So the stages
are searched around the best layout without them: its plugins and technique settings
kept, and explored: ``parallel.pp`` (2, 4, 8, 16 where the ranks and layers allow), the
schedule, ``parallel.ep`` over the ranks of one stage and recomputation. The global batch
stays: a pipeline's ranks read the same sequences, so its data ranks each read ``pp``
times as many, one sequence a micro-batch (the most micro-batches: the least bubble and
the fewest activations held; the plan's compute grows with the tokens, not their
grouping).
"""

from __future__ import annotations

from typing import Any

from europa.plan.schedules import SCHEDULE_NAMES

STAGE_COUNTS = (2, 4, 8, 16)
# What the stage levers choose themselves; the rest of the best layout's settings stay.
CHOSEN_HERE = (
    "parallel.pp",
    "parallel.pp_schedule",
    "parallel.ep",
    "training.batch_size",
    "training.grad_accum_steps",
    "activation_checkpointing.mode",
)


def stage_levers(
    base, world_size: int, ranks_per_node: int, best_plugins, best_sets: dict[str, Any]
) -> list[list[dict[str, Any]]]:
    """The levers of layouts with stages around the best one without (its ``-p`` and
    ``--set``); empty where no number of stages fits the ranks and layers."""
    replicas = base.parallel.dp_replicate
    kept = {k: v for k, v in best_sets.items() if k not in CHOSEN_HERE}
    around = [{"plugins": list(best_plugins), "set": kept}]
    training = base.training
    # a context-parallel group of the best layout reads cp times a rank's sequences
    cut = best_sets.get("parallel.cp", base.parallel.cp) // base.parallel.cp
    sequences = training.batch_size * training.grad_accum_steps * cut
    stages = []
    for pp in STAGE_COUNTS:
        per_replica, rest = divmod(world_size, pp * replicas)
        if rest or pp > base.model.n_layers or not per_replica:
            continue
        for schedule in SCHEDULE_NAMES:
            for ep in _expert_groups(per_replica, ranks_per_node, base.model.num_experts):
                settings = {
                    "parallel.pp": pp,
                    "parallel.pp_schedule": schedule,
                    "parallel.ep": ep,
                    "training.batch_size": 1,
                    "training.grad_accum_steps": sequences * pp,
                }
                stages.append({"plugins": [], "set": settings})
    if not stages:
        return []
    recompute = [
        {"plugins": [], "set": {"activation_checkpointing.mode": m}} for m in ("none", "full")
    ]
    return [around, stages, recompute]


def _expert_groups(per_replica: int, per_node: int, experts: int) -> list[int]:
    """``ep`` over one stage's ranks of a replica: 1, within a node, or whole nodes."""
    if not experts:
        return [1]
    out = []
    for ep in range(1, min(per_replica, experts) + 1):
        if per_replica % ep or experts % ep:
            continue
        if per_node % ep == 0 or ep % per_node == 0:
            out.append(ep)
    return out
