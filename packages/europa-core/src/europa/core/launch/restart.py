"""A worker group that torch's elastic agent restarted (``--max-restarts``) continues
from the run's last complete checkpoint by itself, as ``--resume`` would."""

from __future__ import annotations

from pathlib import Path

from europa.core.checkpoint.store import latest_checkpoint
from europa.core.launch.distributed import restart_attempt


def is_restart(environ: dict[str, str] | None = None) -> bool:
    """True in a worker the elastic agent started again after its group failed."""
    return restart_attempt(environ) > 0


def has_checkpoint(run_dir: Path) -> bool:
    return latest_checkpoint(run_dir) is not None


def resumes(run_dir: Path, requested: bool) -> bool:
    """Resume when asked to, or when restarted with a checkpoint to continue from
    (restarted before the first checkpoint, the run starts over)."""
    return requested or (is_restart() and has_checkpoint(run_dir))
