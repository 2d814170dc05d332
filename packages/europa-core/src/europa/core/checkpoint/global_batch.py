"""The global batch a checkpoint was trained with, kept across world sizes.

``training.batch_size`` is per rank, so resuming on another number of ranks would
silently change the sequences per optimizer step, and the loss curve would jump.
Each checkpoint's marker records its global batch; a resume whose
``batch_size × grad_accum_steps × ranks`` differs is refused in one line that
says what to set. The same global batch reads the same sequences at every step
(see ``RankBatches``), so the run continues as if the world size had not changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from europa.core.checkpoint.marker import MARKER, UnreadableMarker, read_marker
from europa.core.config.schema import TrainingConfig
from europa.core.errors import CheckpointError, ConfigError

KEY = "global_batch"


def global_batch(training: TrainingConfig, world_size: int) -> dict[str, int]:
    """What a checkpoint's marker records: sequences per step and how they were split."""
    return {
        "sequences": training.batch_size * training.grad_accum_steps * world_size,
        "batch_size": training.batch_size,
        "grad_accum_steps": training.grad_accum_steps,
        "ranks": world_size,
    }


def check_global_batch(checkpoint: Path, training: TrainingConfig, world: int) -> None:
    """Refuse a resume on ``world`` ranks that would change the checkpoint's global batch."""
    saved = _recorded(checkpoint)
    if saved is None:  # written before global batches were recorded
        return
    want, here = saved["sequences"], global_batch(training, world)["sequences"]
    if here == want:
        return
    raise ConfigError(
        f"training.batch_size = {training.batch_size}: gives {here} sequences per step "
        f"(× training.grad_accum_steps = {training.grad_accum_steps} × {world} ranks), but "
        f"checkpoint {str(checkpoint)!r} was trained with {want} ({saved['batch_size']} × "
        f"{saved['grad_accum_steps']} × {saved['ranks']} ranks); expected the same global "
        f"batch: {_suggestion(want, training, world)}"
    )


def _recorded(checkpoint: Path) -> dict[str, Any] | None:
    try:
        return read_marker(checkpoint).fields.get(KEY)
    except UnreadableMarker as err:
        raise CheckpointError(
            f"checkpoint marker {str(checkpoint / MARKER)!r} is unreadable ({err}); expected "
            "the JSON europa wrote"
        ) from None


def suggested_settings(want: int, training: TrainingConfig, world: int) -> dict[str, int] | None:
    """``training`` keys that give ``want`` sequences per step on ``world`` ranks, changing
    as little as possible; None when no per-rank batch does."""
    if want % world:
        return None
    per_rank = want // world
    if per_rank % training.batch_size == 0:
        return {"grad_accum_steps": per_rank // training.batch_size}
    if per_rank % training.grad_accum_steps == 0:
        return {"batch_size": per_rank // training.grad_accum_steps}
    return {"batch_size": per_rank, "grad_accum_steps": 1}


def _suggestion(want: int, training: TrainingConfig, world: int) -> str:
    settings = suggested_settings(want, training, world)
    if settings is None:
        return f"a number of ranks that divides {want}"
    return " ".join(f"--set training.{key}={value}" for key, value in settings.items())
