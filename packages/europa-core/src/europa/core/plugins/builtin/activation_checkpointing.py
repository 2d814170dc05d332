"""Default activation checkpointing: recompute each transformer block in backward.

Applied ``tryfirst`` in the wrap phase, so later wrappers (offload, overlap)
see the checkpointed blocks. It wraps each block's ``forward`` in a
non-reentrant ``torch.utils.checkpoint``, which composes with FSDP2: the block
is re-gathered for the recompute like any other backward use. Under a split backward
(ZBV, DualPipeV) it wraps it in ``recompute_once`` instead, whose one recomputation
serves both halves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from europa.spec.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch

    from europa.spec.job import RunningJob


@dataclass(kw_only=True)
class ActivationCheckpointingConfig:
    # Declared as any plugin would: a plain dataclass, bounds in field metadata.
    mode: str = field(
        default="none", metadata={"choices": ("none", "full"), "doc": "full: recompute every block"}
    )


@hookimpl
def europa_config_sections() -> dict[str, type]:
    return {"activation_checkpointing": ActivationCheckpointingConfig}


def checkpoint_blocks(model, split_backward: bool = False) -> int:
    """Make every transformer block recompute its activations in backward;
    ``split_backward``: once for both halves of a split backward (``recompute_once``)."""
    from torch.utils.checkpoint import checkpoint

    from europa.core.plugins.builtin.recompute_once import checkpoint_once

    for block in model.layers.values():
        if split_backward:
            block.forward = functools.partial(checkpoint_once, block.forward)
        else:
            block.forward = functools.partial(
                checkpoint, block.forward, use_reentrant=False, preserve_rng_state=True
            )
    return len(model.layers)


@hookimpl(tryfirst=True)
def europa_wrap_model(job: RunningJob, model: torch.nn.Module) -> None:
    from europa.core.pipeline.kinds import SPLIT_BACKWARD

    if job.config.section("activation_checkpointing").mode == "full":
        p = job.config.parallel
        checkpoint_blocks(model, split_backward=p.pp > 1 and p.pp_schedule in SPLIT_BACKWARD)
