"""Shared test fixtures. ``run_ranks`` runs a function on N real gloo processes."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "europa", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60
)
settings.load_profile("europa")

# One OpenMP thread for torch in the test process and the processes it starts, as the
# launcher gives its workers and run_ranks its ranks: on a 2-core machine that runs
# anything else beside (a second rank, another job), a 2-thread team waits at every
# parallel region for a thread that is not running, and a step of the tiny model in this
# process took 3 to 9 s instead of 0.15. A value set before pytest starts is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config) -> None:
    import torch

    threads = os.environ["OMP_NUM_THREADS"]
    if threads.isdigit():  # torch read it at import; this process may have imported it first
        torch.set_num_threads(int(threads))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks start from a fork server that has imported these once: a fresh interpreter spends
# seconds importing torch and torchtitan's model code, which every spawned rank would repeat.
# The server itself never runs a torch op or starts a thread, so forking it is safe.
PRELOAD = [
    "torch",
    "tests.torchtitan_preload",  # before anything imports torchtitan
    "torch.distributed",
    "torch.distributed.checkpoint",
    "europa.core.session",
    "europa.core.train.loop",
    "europa.flexshard.plugin",
    "europa.offload.plugin",
    "europa.overlap.plugin",
]
# and then, after every europa module, the test modules every rank imports
PRELOAD_TESTS = [
    "tests.trainer_runs",
    "tests.conftest",  # where every rank starts (_rank_main), with pytest and hypothesis
]


@functools.cache
def _europa_modules() -> list[str]:
    """Every module of the installed europa packages but their ``__main__``: the plugins
    import most of theirs only when a hook first runs, which every rank would repeat. Only
    those that import here: the fork server stops at an import that fails otherwise."""
    import importlib
    import pkgutil

    import europa

    names = []
    for module in pkgutil.walk_packages(europa.__path__, "europa.", onerror=lambda name: None):
        if module.name.endswith(".__main__"):
            continue
        try:
            importlib.import_module(module.name)
        except Exception:
            continue
        names.append(module.name)
    return names


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *_europa_modules(), *PRELOAD_TESTS])
    return ctx


def _rank_main(fn, rank: int, world: int, port: int, args: tuple, results, parent) -> None:
    # What a spawned process would have inherited from the test at this moment.
    environ, cwd = parent
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # Pickle here, not in the queue's feeder thread, so a failure is reported.
        results.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return results by rank.

    ``fn`` must be importable (a module-level function of a test module)."""
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    parent = (dict(os.environ), os.getcwd())
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world, port, args, results, parent))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                silent = [
                    (r, p.exitcode)
                    for r, p in enumerate(procs)
                    if r not in collected and p.exitcode is not None and results.empty()
                ]
                if silent:
                    rank, code = silent[0]
                    raise AssertionError(f"rank {rank} exited ({code}) without reporting") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks did not finish within {timeout} s") from None
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = pickle.loads(value) if status == "ok" else value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [collected[rank] for rank in range(world)]


def _europa_main(argv: list[str], environ: dict, cwd: str, stdout: str, stderr: str) -> None:
    """In a child of the fork server: ``europa *argv`` as the console script runs it
    (``europa.cli.app.main``), in a session of its own as a shell starts a job."""
    os.setsid()
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    # what a new interpreter puts on sys.path from PYTHONPATH (a plugin's folder, say)
    sys.path[:0] = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.argv = ["europa", *argv]
    from europa.cli.app import main

    main()


class EuropaProcess:
    """``python -m europa.cli *argv`` in a process of its own, a session leader as a shell
    starts a job, forked from the fork server that has imported torch, torchtitan and
    europa once: a new interpreter spends seconds of a core importing them again before
    the command does anything. Popen's interface as the tests use it; the process's
    stderr and stdout go to files (``stderr``, and ``stderr`` + ``.out``)."""

    def __init__(
        self, argv: list[str], env: dict[str, str] | None = None, *, stderr: os.PathLike
    ) -> None:
        self.args, self.stderr_path = list(argv), Path(stderr)
        environ = dict(os.environ if env is None else env)
        args = (list(argv), environ, os.getcwd(), f"{stderr}.out", str(stderr))
        # daemon: one a test leaves running is stopped when the session ends
        self._process = _context().Process(target=_europa_main, args=args, daemon=True)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["europa", *self.args], timeout)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        self.wait(timeout)
        return None, self.stderr_path.read_text() if self.stderr_path.is_file() else ""

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def pytest_collection_modifyitems(config, items) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ranks() -> Callable[..., list[Any]]:
    return run_ranks
