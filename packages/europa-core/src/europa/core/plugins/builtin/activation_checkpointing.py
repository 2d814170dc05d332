"""Default activation checkpointing: recompute each transformer block in backward.

Applied ``tryfirst`` in the wrap phase, so later wrappers (offload, overlap)
see the checkpointed blocks. It wraps each block's ``forward`` in a
non-reentrant ``torch.utils.checkpoint``, which composes with FSDP2: the block
is re-gathered for the recompute like any other backward use.
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


def checkpoint_blocks(model) -> int:
    """Make every transformer block recompute its activations in backward."""
    from torch.utils.checkpoint import checkpoint

    for block in model.layers.values():
        block.forward = functools.partial(
            checkpoint, block.forward, use_reentrant=False, preserve_rng_state=True
        )
    return len(model.layers)


@hookimpl(tryfirst=True)
def europa_wrap_model(job: RunningJob, model: torch.nn.Module) -> None:
    if job.config.section("activation_checkpointing").mode == "full":
        checkpoint_blocks(model)
