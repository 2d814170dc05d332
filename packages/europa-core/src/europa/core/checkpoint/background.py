"""Checkpoints written while training goes on (``checkpoint.mode = "async"``).

A save copies this rank's state into host buffers (``stage``: in shared memory, pinned
where CUDA is present; allocated at the first save and reused by every later one, DCP's
``DefaultStager`` keyed by the source storages) and hands the copy to this rank's writer
process (``writer_process``), which runs the same ``write_checkpoint`` as a synchronous
save: the partial folder, DCP's save, the marker and the rename once every rank is done,
pruning. This is what DCP's process-based ``async_save`` does (stage, then save in a
process); a writer of our own keeps the completion protocol and its checksums in it.

At most one save is in flight: the next one first waits for it, and so do the end of
training and a stop on a signal. The writers' collectives go over a gloo world of their
own, so they never interleave with training's. A failed background save is raised where
the next save (or the end) waits for it; a rank that dies mid-write takes its writer with
it and leaves a ``.partial`` folder, which is never loaded and is cleared on resume.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from europa.core.checkpoint.store import checkpoint_content
from europa.core.checkpoint.writer_process import (
    WriteFailure,
    WriteRequest,
    WriterProcess,
    WriterWorld,
)
from europa.core.launch.distributed import free_port
from europa.spec.dcp import OwnedChunk


@dataclass(frozen=True)
class SaveTimes:
    waited_s: float  # for the save before it to finish
    staged_s: float  # copying the state into the staging buffers


def staged_bytes(state_dict: Any) -> int:
    """Bytes of the distinct tensor storages in ``state_dict`` (nested)."""
    seen: dict[int, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            local = local.local if isinstance(local, OwnedChunk) else local
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)

    visit(state_dict)
    return sum(seen.values())


class BackgroundSaves:
    """Every rank makes one (training's rank 0 chooses the writers' port for all)
    before the first save, on the thread that lives as long as training, and calls
    ``save`` for the same steps."""

    def __init__(
        self,
        device: torch.device,
        *,
        max_bytes_per_s: float = 0,
        timeout_s: float = 600,
        on_lost_contact: Callable[[], None] = lambda: None,
    ) -> None:
        cuda = device.type == "cuda"
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=True,  # the writer process maps it, nothing is copied
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
        self.writer = WriterProcess(_writer_world(timeout_s))
        self.max_bytes_per_s = max_bytes_per_s
        # A rank that dies mid-write fails the writers' collectives first: say so at once
        # (the launcher names the rank that died, not the ranks that lost it).
        self.on_lost_contact = on_lost_contact
        self.staged: dict[str, Any] | None = None  # the last save's host copy (reused)
        self.staging_bytes = 0
        self._waiter: threading.Thread | None = None
        self._failure: BaseException | None = None

    def save(
        self,
        run_dir: Path,
        step: int,
        state: Stateful,
        trainer_state: dict[str, Any],
        *,
        keep: int = 0,
        record: dict[str, Any] | None = None,
    ) -> SaveTimes:
        waited = self.wait()
        started = time.perf_counter()
        staged = self.stager.stage(checkpoint_content(state, trainer_state))
        self.staged, self.staging_bytes = staged, staged_bytes(staged)
        staged_s = time.perf_counter() - started
        request = WriteRequest(run_dir, step, staged, keep, record, self.max_bytes_per_s)
        # A thread sends it and waits for the outcome: both mostly outside the GIL.
        self._waiter = threading.Thread(
            target=self._write, args=(request,), name=f"europa-checkpoint-{step}", daemon=True
        )
        self._waiter.start()
        return SaveTimes(waited, staged_s)

    def _write(self, request: WriteRequest) -> None:
        try:
            self.writer.write(request)
            outcome = self.writer.result(request.step)
        except BaseException as err:  # raised where training next waits for it
            self._failure = err
            return
        if isinstance(outcome, WriteFailure):
            if outcome.lost_contact:
                self.on_lost_contact()
            self._failure = outcome.error

    @property
    def in_flight(self) -> bool:
        return self._waiter is not None and self._waiter.is_alive()

    def wait(self) -> float:
        """Wait for the save in flight (if any); seconds waited. Raises its failure."""
        if self._waiter is None:
            return 0.0
        started = time.perf_counter()
        self._waiter.join()
        self._waiter = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        return time.perf_counter() - started

    def close(self) -> None:
        """Stop the writer (after ``wait``) and free the staging buffers."""
        self.writer.close()
        self.stager.close()


def _writer_world(timeout_s: float) -> WriterWorld:
    """This rank's place among the writers: training's rank and world, and a port that
    training's rank 0 found free, on the address its peers reach it at."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return WriterWorld(0, 1, "", 0, timeout_s)
    rank, size = dist.get_rank(), dist.get_world_size()
    chosen = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    return WriterWorld(rank, size, host, chosen[0], timeout_s)
