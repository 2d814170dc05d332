"""The run directory: what it holds, where it goes, and how it is created.

Layout: ``config.toml`` (the resolved config), ``metrics.jsonl`` (one record per
step), ``job.json`` (world size, mesh, device and parameter counts, written when
training starts), ``checkpoints/step-NNNNNNNN/`` (complete checkpoints;
``.partial`` folders are never loaded), ``summary.json``, ``tensorboard/``
(event files, when ``[metrics] tensorboard = true``), ``worker-errors/rank-N.txt``
(a worker's one-line error, read by the launcher), ``progress/rank-N.json`` (where
each rank is: the step it computes or saves, its pid; see ``train.progress``) and
``cache/`` (text prepared for training, written before the run starts). The names
import nothing heavy, so the CLI can use them without torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from europa.core.errors import ConfigError

if TYPE_CHECKING:
    from europa.core.config import EuropaConfig

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
JOB_FILE = "job.json"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS = "checkpoints"
WORKER_ERRORS = "worker-errors"
PROGRESS = "progress"
CACHE = "cache"  # derived data, e.g. text prepared for training (europa.core.data.corpora)
RUNS_ROOT = Path("runs")


def write_replacing(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: staged beside it, then renamed over it, so a
    reader (another rank, another node's launcher, a report) never sees half of it."""
    staged = path.with_name(f".{path.name}.partial")
    staged.write_text(text)
    staged.replace(path)


def worker_error_file(run_dir: Path, rank: int) -> Path:
    return run_dir / WORKER_ERRORS / f"rank-{rank}.txt"


def progress_file(run_dir: Path, rank: int) -> Path:
    return run_dir / PROGRESS / f"rank-{rank}.json"


def default_run_dir(config: EuropaConfig, environ: dict[str, str] | None = None) -> Path:
    """``runs/<name>-<id>``; the id is shared by every rank of a launcher job."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID")
    if not job_id or job_id == "none":
        job_id = time.strftime("%Y%m%d-%H%M%S")
    return RUNS_ROOT / f"{config.run.name}-{job_id}"


def check_run_dir(
    config: EuropaConfig, run_dir: Path, *, resume: bool, from_older: bool = False
) -> None:
    """A new or empty directory (its data cache aside), or on resume one with a checkpoint
    to continue from (with ``from_older``, an older one when newer ones are damaged)."""
    from europa.core.train.checkpoint import checkpoint_to_resume  # torch: only when training

    _check_usable(run_dir)
    if resume:
        checkpoint_to_resume(run_dir, config.training.steps, from_older=from_older)
    elif run_dir.exists() and any(path.name != CACHE for path in run_dir.iterdir()):
        raise ConfigError(
            f"--run-dir = {str(run_dir)!r}: already holds a run; expected a new or empty "
            "directory, or --resume to continue it"
        )


def _check_usable(run_dir: Path) -> None:
    """A directory, or a path whose nearest existing ancestor is a writable directory."""
    shown = repr(str(run_dir))
    try:
        nearest = next(path for path in (run_dir, *run_dir.parents) if path.exists())
        if not nearest.is_dir():
            where = "is a file" if nearest == run_dir else f"is under the file {str(nearest)!r}"
            raise ConfigError(f"--run-dir = {shown}: {where}; expected a directory")
        if not os.access(nearest, os.W_OK | os.X_OK):
            raise ConfigError(
                f"--run-dir = {shown}: {str(nearest)!r} is not writable; expected a directory "
                "this user may write"
            )
    except OSError as err:  # a name too long, a loop of links, ...
        raise ConfigError(f"--run-dir = {shown}: {err.strerror}; expected a usable path") from None


def prepare_run_dir(
    config: EuropaConfig, run_dir: Path, *, resume: bool, from_older: bool = False
) -> None:
    """Create (or, on resume, check) the run directory and write the resolved config."""
    from europa.core.config import config_to_toml

    check_run_dir(config, run_dir, resume=resume, from_older=from_older)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_replacing(run_dir / CONFIG_FILE, config_to_toml(config))
