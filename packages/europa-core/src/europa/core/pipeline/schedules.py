"""torch's pipeline schedules by name, and which stages each pipeline rank holds.

Looped schedules (1F1B, interleaved 1F1B) put stage ``s`` on rank ``s mod P``; the V
schedules (ZBV zero-bubble, DualPipeV) hold two stages a rank, ``r`` and ``2P - 1 - r``, so
the first and the last stage share rank 0 (as torchtitan places them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from europa.core.pipeline.kinds import SINGLE_STAGE, V_SHAPED

SCHEDULES = {
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def stages_of_rank(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds, in the order it runs them."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def build_schedule(
    schedule: str,
    stage_modules: Sequence[tuple[int, nn.Module]],
    num_stages: int,
    device: torch.device,
    group,
    micro_batches: int,
    loss_fn: Callable,
    shapes: Callable[[int], dict[str, torch.Tensor | None]] | None = None,
):
    """The schedule over this rank's ``(stage index, module)`` pairs. Gradients are
    summed over the micro-batches as they come (``scale_grads=False``): ``loss_fn`` scales.
    ``shapes(index)``: a stage's input and output for one micro-batch and their gradients
    (meta tensors; ``PipelineStage``'s keywords), so that torch does not run the stage's
    forward once more to learn them (a model that counts its tokens, as the MoE router
    does, would count that micro-batch twice)."""
    stages = []
    for index, module in stage_modules:
        given = {} if shapes is None else shapes(index)
        stages.append(PipelineStage(module, index, num_stages, device, group=group, **given))
    cls = SCHEDULES[schedule]
    if schedule in SINGLE_STAGE:
        return cls(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False), stages
    return cls(stages, micro_batches, loss_fn=loss_fn, scale_grads=False), stages
