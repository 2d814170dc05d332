"""A worker group that torch's elastic agent restarted (``--max-restarts``) continues
from the run's last complete checkpoint by itself, as ``--resume`` would."""

from __future__ import annotations

import os
from pathlib import Path

from europa.core.train.checkpoint import latest_checkpoint


def is_restart(environ: dict[str, str] | None = None) -> bool:
    """True in a worker the elastic agent started again after its group failed."""
    env = os.environ if environ is None else environ
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0") > 0


def has_checkpoint(run_dir: Path) -> bool:
    return latest_checkpoint(run_dir) is not None


def resumes(run_dir: Path, requested: bool) -> bool:
    """Resume when asked to, or when restarted with a checkpoint to continue from
    (restarted before the first checkpoint, the run starts over)."""
    return requested or (is_restart() and has_checkpoint(run_dir))
