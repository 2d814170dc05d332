"""The run directory: what it holds, where it goes, and how it is created.

Layout: ``config.toml`` (the resolved config), ``metrics.jsonl`` (one record per
step), ``job.json`` (world size, mesh, device and parameter counts, written when
training starts), ``checkpoints/step-NNNNNNNN/`` (complete checkpoints;
``.partial`` folders are never loaded), ``summary.json``, ``tensorboard/``
(event files, when ``[metrics] tensorboard = true``), ``worker-errors/rank-N.txt``
(a worker's one-line error, read by the launcher), ``training.lock`` (held by the live
training, naming its host and pid), ``progress/rank-N.json`` (where
each rank is: the step it computes or saves, its pid; see ``europa.core.launch.progress``) and
``cache/`` (text prepared for training, written before the run starts). Names and
paths only: it imports nothing of europa but its errors and the contract's file names
(``europa.spec.run_files``, which europa-report reads too), so the CLI can use it without
torch; creating and checking a run directory is the launcher's
(``europa.core.launch.prepare``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from europa.spec.run_files import CONFIG_FILE as CONFIG_FILE  # the names a reader shares
from europa.spec.run_files import JOB_FILE as JOB_FILE
from europa.spec.run_files import METRICS_FILE as METRICS_FILE
from europa.spec.run_files import SUMMARY_FILE as SUMMARY_FILE

if TYPE_CHECKING:
    from europa.core.config import EuropaConfig

TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS = "checkpoints"
WORKER_ERRORS = "worker-errors"
PROGRESS = "progress"
CACHE = "cache"  # derived data, e.g. text prepared for training (europa.core.data.corpora)
LOCK_FILE = "training.lock"  # held by the one live training (europa.core.launch.lock)
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
