"""The run directory: resolved config, metrics, checkpoints, summary."""

from __future__ import annotations

import os
import time
from pathlib import Path

from europa.core.config import EuropaConfig, config_to_toml
from europa.core.errors import ConfigError
from europa.core.run_layout import CONFIG_FILE
from europa.core.train.checkpoint import checkpoint_to_resume

RUNS_ROOT = Path("runs")


def default_run_dir(config: EuropaConfig, environ: dict[str, str] | None = None) -> Path:
    """``runs/<name>-<id>``; the id is shared by every rank of a launcher job."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID")
    if not job_id or job_id == "none":
        job_id = time.strftime("%Y%m%d-%H%M%S")
    return RUNS_ROOT / f"{config.run.name}-{job_id}"


def prepare_run_dir(config: EuropaConfig, run_dir: Path, *, resume: bool) -> None:
    """Create (or, on resume, check) the run directory and write the resolved config."""
    if resume:
        checkpoint_to_resume(run_dir, config.training.steps)
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            f"--run-dir = {str(run_dir)!r}: already holds a run; expected a new or empty "
            "directory, or --resume to continue it"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    staged = run_dir / f".{CONFIG_FILE}.partial"
    staged.write_text(config_to_toml(config))
    staged.replace(run_dir / CONFIG_FILE)
