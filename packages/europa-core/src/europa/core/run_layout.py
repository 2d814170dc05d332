"""What a run directory holds (names only, so light modules can refer to them)."""

from pathlib import Path

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINTS = "checkpoints"
WORKER_ERRORS = "worker-errors"  # rank-N.txt: a worker's one-line error, for the launcher


def worker_error_file(run_dir: Path, rank: int) -> Path:
    return run_dir / WORKER_ERRORS / f"rank-{rank}.txt"
