"""What each spawned rank of ``benchmarks/e2e.py`` runs: europa's Trainer for each
layout (the code ``europa train`` runs on a rank), torchtitan's Trainer (through
``_torchtitan_cpu`` on CPU ranks), and matrix multiplies at the model's own shapes in the
run's compute dtype.

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
    checkpoint, which ``args["final_save"] = False`` leaves out), timed by a StepClock on
    ``args["device"]``."""
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
    device_kind = args.get("device", "cpu")
    on_device = f'parallel.device="{device_kind}"'
    try:
        for layout in args["layouts"]:
            overrides = [*args["overrides"], *layout["overrides"], on_device]
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
            trainer = Trainer(job, plugins)
            clock = StepClock(args["warmup"], args["timed"], args["profiled"], device_kind)
            trainer._forward_backward, trainer.optimizer.step = clock.watch(
                trainer.model, trainer._forward_backward, trainer.optimizer.step
            )
            trainer.step = _after(clock.boundary, trainer.step)
            save = trainer.save if args.get("final_save", True) else _no_save
            trainer.save = _after(clock.boundary, save)  # the only save is the final one
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


def _no_save(step: int) -> dict[str, float]:
    return {}


def _after(first, fn):
    def wrapper(*args, **kwargs):
        first()
        return fn(*args, **kwargs)

    return wrapper


def torchtitan_runs(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Each of ``args["variants"]`` (``e2e.TORCHTITAN_VARIANTS``) in turn, in this group."""
    if args.get("device", "cpu") == "cpu":
        from _torchtitan_cpu import run_trainer  # patches torchtitan on import
    else:
        from _torchtitan_trainer import run_trainer

    settings = ("fp32_experts", "replicate", "cuda_graphs")
    return {
        v["name"]: run_trainer(rank, world, {**args, **{k: v.get(k, False) for k in settings}})
        for v in args["variants"]
    }


def matmul_rates(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """``torch.mm`` FLOP/s on this rank for each (m, k, n) in ``args["shapes"]``, in
    ``args["dtype"]`` on ``args["device"]``, all ranks multiplying at once (a gloo barrier
    lines them up), at the thread count the benchmark's ranks run with; the best of a few
    trials, since a peak is what it is for. On a GPU each trial waits for its kernels."""
    import torch.distributed as dist

    device = torch.device(args.get("device", "cpu"))
    dtype = getattr(torch, args.get("dtype", "float32"))
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    calls_per_check = 20 if device.type == "cuda" else 1
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rates = {}
        for m, k, n in args["shapes"]:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            torch.mm(a, b)  # warm-up
            wait()
            best = 0.0
            for _ in range(args["trials"]):
                dist.barrier()
                calls, started = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - started) < args["seconds_per_trial"]:
                    for _ in range(calls_per_check):
                        torch.mm(a, b)
                    wait()
                    calls += calls_per_check
                best = max(best, 2 * m * k * n * calls / elapsed)
            rates[f"{m}x{k}x{n}"] = best
        return {"threads": torch.get_num_threads(), "flops_per_s": rates}
    finally:
        dist.destroy_process_group()
