"""What each spawned rank of ``benchmarks/e2e.py`` runs: europa's Trainer for each
layout (the code ``europa train`` runs on a rank), torchtitan's Trainer through
``_torchtitan_cpu``, and fp32 matrix multiplies at the model's own shapes.

Nothing here imports torchtitan at module level: the torchtitan launcher must patch it
before its first import in the process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def europa_runs(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Every layout in ``args["layouts"]`` in turn, in this one process group, each
    through ``Trainer.run()`` as in ``europa train`` (run directory, metrics, final
    checkpoint), timed by a StepClock."""
    import warnings

    import torch.distributed as dist
    from _steps import StepClock, summarise

    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed, shutdown
    from europa.core.launch.prepare import prepare_run_dir
    from europa.core.session import open_session
    from europa.core.train.loop import Trainer, use_deterministic_algorithms

    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
    results = {}
    try:
        for layout in args["layouts"]:
            overrides = [*args["overrides"], *layout["overrides"], 'parallel.device="cpu"']
            config, plugins = open_session(args["preset"], overrides, layout["plugins"])
            use_deterministic_algorithms(config.training.deterministic)  # as run_training
            place = ProcessPlace(rank, world, rank, "torchrun")
            device, mesh = init_distributed(config.parallel, place)
            run_dir = Path(args["root"]) / f"{layout['name']}-{world}"
            if rank == 0:
                prepare_run_dir(config, run_dir, resume=False)
            dist.barrier()
            job = Job(config=config, run_dir=run_dir, rank=rank, world_size=world,
                      local_rank=rank, device=device, mesh=mesh)  # fmt: skip
            trainer = Trainer(job, plugins, resume=False)
            clock = StepClock(args["warmup"], args["timed"], args["profiled"])
            trainer._forward_backward, trainer.optimizer.step = clock.watch(
                trainer.model, trainer._forward_backward, trainer.optimizer.step
            )
            trainer.step = _after(clock.boundary, trainer.step)
            trainer.save = _after(clock.boundary, trainer.save)  # only the final save
            trainer.run()
            result = summarise(clock, trainer.batches.tokens_per_step)
            result.update(
                parameters=trainer.counts.total, deterministic=config.training.deterministic
            )
            if rank == 0:
                result["operator_table"] = clock.operator_table()
            results[layout["name"]] = result
            torch.use_deterministic_algorithms(False)
    finally:
        shutdown()
    return results


def _after(first, fn):
    def wrapper(*args, **kwargs):
        first()
        return fn(*args, **kwargs)

    return wrapper


def torchtitan_runs(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Each of ``args["variants"]`` (``e2e.TORCHTITAN_VARIANTS``) in turn, in this group."""
    from _torchtitan_cpu import run_trainer  # patches torchtitan on import

    return {
        v["name"]: run_trainer(
            rank, world, {**args, "fp32_experts": v["fp32_experts"], "replicate": v["replicate"]}
        )
        for v in args["variants"]
    }


def matmul_rates(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """fp32 ``torch.mm`` FLOP/s on this rank for each (m, k, n) in ``args["shapes"]``, all
    ranks multiplying at once (a gloo barrier lines them up), at the thread count the
    benchmark's ranks run with; the best of a few trials, since a peak is what it is for."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rates = {}
        for m, k, n in args["shapes"]:
            a, b = torch.randn(m, k), torch.randn(k, n)
            torch.mm(a, b)  # warm-up
            best = 0.0
            for _ in range(args["trials"]):
                dist.barrier()
                calls, started = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - started) < args["seconds_per_trial"]:
                    torch.mm(a, b)
                    calls += 1
                best = max(best, 2 * m * k * n * calls / elapsed)
            rates[f"{m}x{k}x{n}"] = best
        return {"threads": torch.get_num_threads(), "flops_per_s": rates}
    finally:
        dist.destroy_process_group()
