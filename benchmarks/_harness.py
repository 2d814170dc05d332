"""What the benchmarks share: gloo ranks in spawned processes, a trainer on each,
and a dispatch mode that counts the payload of every collective."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


class CollectiveBytes(TorchDispatchMode):
    """Adds up the payload a rank hands to each collective while active: the
    local shard of an all-gather, the full input of a reduce-scatter or an
    all-to-all, the buffer of an all-reduce, the buffer of a send (europa-flexshard's
    direct transfers on gloo; a receive hands nothing in). ``only(name)`` narrows the ops."""

    def __init__(self, only: Callable[[str], bool] | None = None) -> None:
        super().__init__()
        self.only = only
        self.bytes = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        counted = func.namespace in COLLECTIVE_NAMESPACES and not name.startswith(("wait", "recv"))
        if counted and (self.only is None or self.only(name)):
            self.calls += 1
            self.bytes += _payload(func.namespace, name, args)
        return func(*args, **(kwargs or {}))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _payload(namespace: str, name: str, args: tuple) -> int:
    if namespace.startswith("_c10d_functional"):
        return _nbytes(args[0])  # the input comes first
    if name in ("_allgather_base_", "_reduce_scatter_base_", "alltoall_base_", "allgather_",
                "reduce_scatter_", "alltoall_"):  # fmt: skip
        return _nbytes(args[1])  # (output, input, ...)
    return _nbytes(args[0])  # allreduce_, broadcast_, reduce_: the buffer


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def timed(fn: Callable, samples: list[float]) -> Callable:
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            samples.append(time.perf_counter() - started)

    return wrapper


def inside(mode: TorchDispatchMode, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        with mode:
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def trainer_on_rank(
    rank: int, world: int, preset: str, overrides: list[str], plugins: list[str]
) -> Iterator[Any]:
    """core's Trainer on this rank, as ``europa train`` builds it (CPU, gloo)."""
    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed, shutdown
    from europa.core.session import open_session
    from europa.core.train.loop import Trainer

    warnings.filterwarnings("ignore")
    overrides = [*overrides, "metrics.progress=false", 'parallel.device="cpu"']
    if "flexshard" in plugins:
        overrides.append("flexshard.log_plan=false")
    config, manager = open_session(preset, overrides, plugins)
    device, mesh = init_distributed(config.parallel, ProcessPlace(rank, world, rank, "torchrun"))
    # One run directory for this group's ranks (its progress files, its data cache), never
    # the folder the benchmark is started from.
    run_dir = Path(tempfile.gettempdir()) / f"europa-benchmark-{os.environ['MASTER_PORT']}"
    try:
        job = Job(config=config, run_dir=run_dir, rank=rank, world_size=world,
                  local_rank=rank, device=device, mesh=mesh)  # fmt: skip
        yield Trainer(job, manager)
    finally:
        shutdown()


def _rank_main(fn: Callable, rank: int, world: int, port: int, args: dict, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        results.put((rank, fn(rank, world, args)))
    except BaseException as err:  # reported by the parent
        results.put((rank, {"error": "".join(traceback.format_exception(err))}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable, world: int, args: dict) -> list[dict]:
    """``fn(rank, world, args)`` on ``world`` spawned gloo processes; results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world, port, args, results))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    collected = dict(results.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    for rank, result in collected.items():
        if "error" in result:
            raise RuntimeError(f"rank {rank} failed:\n{result['error']}")
    return [collected[rank] for rank in range(world)]


def print_result(benchmark: str, args: Any, configs: list, comparisons: Any, **extra: Any) -> None:
    """The JSON a benchmark prints: what ran, on what, and the measured ratios."""
    result = {
        "benchmark": benchmark,
        "preset": args.preset,
        "batch_size_per_rank": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        **extra,
        "configs": configs,
        "comparisons": comparisons,
    }
    print(json.dumps(result, indent=2))


# -- ranks launched as processes of their own (on emulated nodes: _netns) ---------------------


def write_gathered(path: Path, mine: dict) -> None:
    """Every rank's ``mine``, gathered and written by rank 0 to ``path`` as JSON (a list by
    rank); then the process group ends. A collective: every rank calls it last."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        path.write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def first_failure(procs: list, logs: list[Path]) -> str | None:
    """Wait for every rank's process; None, or the first failed rank's exit code and the
    last line of its log."""
    codes = [p.wait() for p in procs]
    for rank, (log, code) in enumerate(zip(logs, codes, strict=True)):
        if code:
            lines = [line for line in log.read_text().splitlines() if line.strip()]
            return f"rank {rank} exited {code}: {lines[-1] if lines else ''}"
    return None
