"""torchtitan 0.3.0's own ``Trainer`` on the CPU gloo ranks of ``run_ranks``: the
benchmarks' launcher (``benchmarks/_torchtitan_cpu.py``) patches torchtitan for CPU
before its first import, which the fork server does first (``tests.torchtitan_preload``);
``titan()`` returns the patched helpers.

``debug_job`` is the benchmarks' torchtitan job: the ``deepseek_v3`` debugmodel with SDPA
attention, FSDP2 over the ranks, europa's batches for a tiny ``debug`` preset, a fixed
seed so that two Trainers built one after the other start from the same weights.
``seed_checkpoint`` gives two differently laid-out jobs the same initial weights;
``counted_traffic()`` counts what a stretch of code sends."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
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


def train(config: Any, watch: Callable[[Any], None] | None = None) -> tuple[list[float], list[Any]]:
    """Build and run ``config``'s Trainer; each step's loss on this rank (as its
    ``forward_backward_step`` returned it) and the trained model parts. ``watch(trainer)``
    runs once the Trainer is built, before it trains."""
    import warnings

    import torchtitan.trainer

    warnings.filterwarnings("ignore")
    # Rank 0 sleeps 2 s after its last step "for other ranks to complete" (log order only).
    torchtitan.trainer.time = _NoSleep
    trainer = config.build()
    if watch is not None:
        watch(trainer)
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


class _NoSleep:
    """The ``time`` torchtitan's trainer module sees: as the standard one, without sleeps."""

    perf_counter = staticmethod(time.perf_counter)

    @staticmethod
    def sleep(seconds: float) -> None:
        return None


def seed_checkpoint(config: Any, folder: str) -> str:
    """``config``'s model built whole and initialised once (seed 0), saved by rank 0 with
    DCP under ``folder``; its path, for ``checkpoint.initial_load_path``. Two layouts
    compared from the same weights load it: on CPU, torchtitan's FSDP2 draws each shard of
    a DTensor from the local generator, so its own initial weights depend on the layout."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = str(Path(folder) / "seed")
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model = config.model_spec.model.build()
        model.init_states()
        dcp.save(model.state_dict(), checkpoint_id=path, no_dist=True)
    dist.barrier()
    return path


def counted_traffic(functional: bool = True) -> Any:
    """The benchmarks' ``CountedTraffic`` (``_torchtitan_trainer``): a context counting
    what a stretch of code sends."""
    titan()
    from _torchtitan_trainer import CountedTraffic

    return CountedTraffic(functional)
