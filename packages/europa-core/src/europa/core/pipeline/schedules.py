"""torch's pipeline schedules by name, built over a rank's stages
(``europa.core.pipeline.stages`` says which stages a rank holds)."""

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

from europa.core.pipeline.kinds import SINGLE_STAGE

SCHEDULES = {
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


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
