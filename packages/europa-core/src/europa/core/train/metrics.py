"""Per-step records: appended to ``metrics.jsonl`` and shown on a progress bar (rank 0)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from europa.core.run_dir import METRICS_FILE
from europa.core.train.tensorboard import TensorBoardWriter


def truncate_after(run_dir: Path, step: int) -> None:
    """On resume, drop records of steps past the checkpoint: they will be redone."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    path.write_text("".join(line + "\n" for line in kept))


class MetricsSink:
    """Writes one JSON line per record; shows a progress bar and writes TensorBoard
    events when asked."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        start_step: int,
        progress: bool,
        tensorboard: bool = False,
    ):
        self._file = (run_dir / METRICS_FILE).open("a", buffering=1)
        self._tensorboard = (
            TensorBoardWriter(run_dir, start_step=start_step) if tensorboard else None
        )
        self._val_loss = ""  # the latest, shown until the next evaluation
        self._bar = (
            tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            if progress
            else None
        )

    def __call__(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            self._tensorboard.write(record)
        if self._bar is not None and "loss" in record:
            if "val_loss" in record:
                self._val_loss = f"{record['val_loss']:.4f}"
            shown = {"val_loss": self._val_loss} if self._val_loss else {}
            self._bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                **shown,
                lr=f"{record['lr']:.2e}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                imbalance=f"{record['expert_imbalance_max']:.2f}",
                refresh=False,
            )
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        self._file.close()
