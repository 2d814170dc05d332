"""torchtitan 0.3.0's own ``Trainer`` on the CPU gloo ranks of ``run_ranks(...,
fresh=True)``: the benchmarks' launcher (``benchmarks/_torchtitan_cpu.py``) patches
torchtitan for CPU before its first import, so call ``titan()`` first thing in a rank,
and import nothing of torchtitan (nor europa-core's model) at a test module's top.

``debug_job`` is the benchmarks' torchtitan job: the ``deepseek_v3`` debugmodel with SDPA
attention, FSDP2 over the ranks, europa's batches for a tiny ``debug`` preset, a fixed
seed so that two Trainers built one after the other start from the same weights.
``seed_checkpoint`` gives two differently laid-out jobs the same initial weights;
``CountedTraffic`` counts what a stretch of code sends."""

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


# torch.distributed's point-to-point and collective calls, each counted by CountedTraffic
TRAFFIC = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
    "broadcast", "broadcast_object_list", "gather", "irecv", "isend", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "send",
)  # fmt: skip


class CountedTraffic:
    """While active, every call this process makes to one of ``TRAFFIC`` (looked up on
    ``torch.distributed`` at call time, as europa's layouts do) is counted with the bytes of
    its tensors, and with ``functional`` DTensor's functional collectives too, through
    torch's ``CommDebugMode`` (which sees every operator: slow around a whole step)."""

    def __init__(self, functional: bool = True) -> None:
        self.calls = 0
        self.bytes = 0
        self.functional = functional

    def __enter__(self) -> CountedTraffic:
        import torch.distributed as dist
        from torch.distributed.tensor.debug import CommDebugMode

        self._originals = {n: getattr(dist, n) for n in TRAFFIC if hasattr(dist, n)}
        for name, original in self._originals.items():
            setattr(dist, name, self._counted(original))
        self._functional = CommDebugMode() if self.functional else None
        if self._functional is not None:
            self._functional.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        if self._functional is not None:
            self._functional.__exit__(*exc)
            self.calls += self._functional.get_total_counts()
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _counted(self, original: Callable) -> Callable:
        import torch

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            for value in (*args, *kwargs.values()):
                items = value if isinstance(value, list | tuple) else [value]
                for item in items:
                    if isinstance(item, torch.Tensor):
                        self.bytes += item.numel() * item.element_size()
            return original(*args, **kwargs)

        return counted
