"""One checkpoint writer process per rank, for background saves.

A writer thread in the training process competes with training for the GIL; a process
of its own does not. Each rank starts one when training starts (``spawn``: a forked
copy of a process holding gloo's threads is not safe), and the writers form a gloo
world of their own, rank for rank with training's, over a store that training's rank 0
chose a port for. A save sends the staged state (host tensors in shared memory, passed
as file descriptors, not copied) and runs the same ``write_checkpoint`` as a
synchronous save there: the partial folder, DCP's save with checksums, the marker and
the rename once every rank is done, pruning. The result comes back through the pipe.

The writer lives and dies with its rank:
- it ignores SIGINT and SIGTERM, which a terminal or a batch system sends to every
  process of the job, so that the rank's own stop can wait for the write in flight;
- the kernel kills it with SIGKILL when the training process dies (``PR_SET_PDEATHSIG``,
  tied to the thread that started it: the trainer's main thread), so a killed rank's
  save in flight never completes, and nothing outlives the job;
- it exits when the pipe closes or it is asked to.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing.connection
import os
import pickle
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WriterWorld:
    """Where the writer of ``rank`` finds its peers (``size`` 1: it has none)."""

    rank: int
    size: int
    host: str
    port: int
    timeout_s: float


@dataclass(frozen=True)
class WriteRequest:
    run_dir: Path
    step: int
    state_dict: dict[str, Any]  # staged: tensors in shared memory
    keep: int
    record: dict[str, Any] | None
    max_bytes_per_s: float


@dataclass(frozen=True)
class WriteFailure:
    error: BaseException
    lost_contact: bool  # a peer writer died or hung: its rank did


class WriterProcess:
    """The training side of one rank's writer. Create it on the thread that lives as
    long as training (see the module note); ``write`` and ``result`` alternate."""

    def __init__(self, world: WriterWorld) -> None:
        context = mp.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(child_end, world, os.getpid()),
            name=f"europa-checkpoint-writer-{world.rank}",
            daemon=True,
        )
        self._process.start()
        child_end.close()
        self.rank = world.rank
        # Before multiprocessing's own exit handler (atexit runs the last registered
        # first), which would wait for a writer that ignores SIGTERM.
        atexit.register(self._kill)

    def write(self, request: WriteRequest) -> None:
        self._conn.send(request)

    def result(self, step: int) -> Path | WriteFailure:
        """The written checkpoint's folder, or what went wrong (the writer's own death
        included)."""
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._process.join(timeout=5)
            return WriteFailure(
                RuntimeError(
                    f"the checkpoint writer process of rank {self.rank} exited with code "
                    f"{self._process.exitcode} while saving step {step}; expected it to "
                    "finish the write (was it killed, or out of memory?)"
                ),
                lost_contact=False,
            )

    def close(self) -> None:
        """Ask the writer to exit (between saves), then make sure it has."""
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._process.join(timeout=30)
        self._kill()

    def _kill(self) -> None:
        """At exit, a write in flight is abandoned: its ``.partial`` is never loaded."""
        atexit.unregister(self._kill)
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        self._conn.close()


def _serve(conn: multiprocessing.connection.Connection, world: WriterWorld, parent: int) -> None:
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # It checksums and writes: training keeps the cores. The nice value is inherited by
    # the threads it starts (gloo's, DCP's), which is where the work happens.
    os.nice(19)
    import torch

    torch.set_num_threads(1)
    # Imported here, not at the top: this module is imported by the training process.
    from torch.distributed.checkpoint.api import CheckpointException

    from europa.core.checkpoint.store import write_checkpoint

    failed_to_join = None
    try:
        if world.size > 1:
            _join(world)  # at once: the peers meet while training runs its first steps
    except Exception as err:
        failed_to_join = _failure(err)
    try:
        while (request := conn.recv()) is not None:
            if failed_to_join is not None:
                conn.send(failed_to_join)
                continue
            try:
                path = write_checkpoint(
                    request.run_dir,
                    request.step,
                    request.state_dict,
                    keep=request.keep,
                    record=request.record,
                    max_bytes_per_s=request.max_bytes_per_s,
                )
                conn.send(path)
            except (Exception, CheckpointException) as err:  # CheckpointException: Base
                conn.send(_failure(err))
            del request  # unmaps the staged tensors until the next save
    except (EOFError, OSError):
        pass  # training ended: nothing more to write
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(world: WriterWorld) -> None:
    timeout = timedelta(seconds=world.timeout_s)
    from europa.core.launch.stores import rank_store

    store = rank_store(world.host, world.port, world.rank, world.size, timeout=timeout)
    dist.init_process_group(
        "gloo", store=store, rank=world.rank, world_size=world.size, timeout=timeout
    )


def _failure(err: BaseException) -> WriteFailure:
    """``err`` as it can cross the pipe: DCP's CheckpointException carries tracebacks,
    which do not pickle, so its first rank's own error stands for it."""
    from europa.core.launch.faults import is_lost_contact, root_exception

    lost = is_lost_contact(err)
    for candidate in (err, root_exception(err)):
        try:
            pickle.loads(pickle.dumps(candidate))
        except Exception:
            continue
        return WriteFailure(candidate, lost)
    return WriteFailure(RuntimeError(f"{type(err).__name__}: {err}"), lost)


def _die_with(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the line above took effect
        os._exit(1)
