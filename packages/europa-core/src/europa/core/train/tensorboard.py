"""TensorBoard event files beside ``metrics.jsonl`` (``[metrics] tensorboard = true``).

Each numeric key of a record becomes a scalar of the same name; per-layer mappings
become ``key/layer`` scalars; each MoE layer's expert load becomes a histogram whose
x axis is the expert index and whose height is that expert's share of routed tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from europa.core.run_dir import TENSORBOARD_DIR

# Per-layer lists of expert shares: histograms, not scalars.
EXPERT_LOAD_KEY = "expert_load"


class TensorBoardWriter:
    def __init__(self, run_dir: Path, *, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked

        # On resume, TensorBoard drops the events a previous attempt wrote past the
        # checkpoint, as truncate_after does for metrics.jsonl.
        self._writer = SummaryWriter(
            str(run_dir / TENSORBOARD_DIR),
            purge_step=start_step + 1 if start_step else None,
            flush_secs=30,
        )

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key == "step":
                continue
            if key == EXPERT_LOAD_KEY and isinstance(value, dict):
                for layer, shares in value.items():
                    self._expert_histogram(f"{key}/{layer}", shares, step)
            elif isinstance(value, dict):
                for name, item in value.items():
                    if _is_number(item):
                        self._writer.add_scalar(f"{key}/{name}", item, step)
            elif _is_number(value):
                self._writer.add_scalar(key, value, step)

    def _expert_histogram(self, tag: str, shares: list[float], step: int) -> None:
        experts = range(len(shares))
        self._writer.add_histogram_raw(
            tag,
            min=0,
            max=len(shares) - 1,
            num=sum(shares),
            sum=sum(i * s for i, s in zip(experts, shares, strict=True)),
            sum_squares=sum(i * i * s for i, s in zip(experts, shares, strict=True)),
            bucket_limits=[i + 0.5 for i in experts],  # bucket i holds expert i
            bucket_counts=list(shares),
            global_step=step,
        )

    def close(self) -> None:
        self._writer.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
