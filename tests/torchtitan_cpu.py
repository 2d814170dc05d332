"""torchtitan 0.3.0's own ``Trainer`` on the CPU gloo ranks of ``run_ranks(...,
fresh=True)``: the benchmarks' launcher (``benchmarks/_torchtitan_cpu.py``) patches
torchtitan for CPU before its first import, so call ``titan()`` first thing in a rank,
and import nothing of torchtitan (nor europa-core's model) at a test module's top.

``debug_job`` is the benchmarks' torchtitan job: the ``deepseek_v3`` debugmodel with SDPA
attention, FSDP2 over the ranks, europa's batches for a tiny ``debug`` preset, a fixed
seed so that two Trainers built one after the other start from the same weights."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["training.seq_len=32", "training.batch_size=2"]


def titan() -> Any:
    """The CPU-patched torchtitan helpers (``benchmarks/_torchtitan_cpu``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import _torchtitan_cpu

    return _torchtitan_cpu


def debug_job(rank: int, world: int, steps: int, dump_folder: str, **args: Any) -> Any:
    """torchtitan's ``Trainer.Config`` for ``steps`` steps of the debugmodel on ``world``
    ranks (``args``: the benchmarks' keys, e.g. ``full_ac``, ``ep``); ``dump_folder`` is
    the same on every rank (the data are prepared there once)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    job = {"preset": "debug", "overrides": TINY, "fp32_experts": False, "log_every": 1,
           "data_dir": str(Path(dump_folder) / "data"), "steps": steps, **args}  # fmt: skip
    config = titan().trainer_config(job, world, dump_folder)
    config.debug.seed = 0
    return config


def train(config: Any) -> tuple[list[float], list[Any]]:
    """Build and run ``config``'s Trainer; each step's loss on this rank (as its
    ``forward_backward_step`` returned it) and the trained model parts."""
    import warnings

    warnings.filterwarnings("ignore")
    trainer = config.build()
    losses: list[float] = []
    forward_backward = trainer.forward_backward_step

    def recorded(**kwargs: Any):
        loss = forward_backward(**kwargs)
        losses.append(loss.detach().item())
        return loss

    trainer.forward_backward_step = recorded
    try:
        trainer.train()
    finally:
        trainer.close()
    return losses, trainer.model_parts
