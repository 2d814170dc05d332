"""Checkpoints written while training goes on (``checkpoint.mode = "async"``).

A save copies this rank's state into host buffers (``stage``: pinned where CUDA is
present; allocated at the first save and reused by every later one, DCP's
``DefaultStager`` keyed by the source storages) and hands the copy to one writer
thread, which runs the same ``write_checkpoint`` as a synchronous save: the partial
folder, DCP's save, the marker and the rename once every rank is done, pruning. This is
what ``dcp.async_save`` does (stage, then save from a thread); doing it here keeps the
completion protocol in the writer thread, right after DCP's save.

At most one save is in flight: the next one first waits for it, and so do the end of
training and a stop on a signal. The writer thread's collectives go over a gloo group
of their own, so they never interleave with training's. A failed background save is
raised where the next save (or the end) waits for it; a rank that dies mid-write
leaves a ``.partial`` folder, which is never loaded and is cleared on resume.
"""

from __future__ import annotations

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

from europa.core.checkpoint.store import checkpoint_content, write_checkpoint
from europa.core.launch.faults import is_lost_contact


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
    """Every rank makes one (its gloo group is created collectively) before the first
    save, and calls ``save`` for the same steps."""

    def __init__(
        self,
        device: torch.device,
        *,
        max_bytes_per_s: float = 0,
        on_lost_contact: Callable[[], None] = lambda: None,
    ) -> None:
        cuda = device.type == "cuda"
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
        self.group = dist.new_group(backend="gloo") if _distributed() else None
        self.max_bytes_per_s = max_bytes_per_s
        # A rank that dies mid-write fails the writer's collectives first: say so at once
        # (the launcher names the rank that died, not the ranks that lost it).
        self.on_lost_contact = on_lost_contact
        self.staged: dict[str, Any] | None = None  # the last save's host copy (reused)
        self.staging_bytes = 0
        self._writer: threading.Thread | None = None
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
        self._writer = threading.Thread(
            target=self._write,
            args=(run_dir, step, staged, keep, record),
            name=f"europa-checkpoint-{step}",
            daemon=True,  # a failing run exits without it; its .partial is never loaded
        )
        self._writer.start()
        return SaveTimes(waited, staged_s)

    def _write(
        self, run_dir: Path, step: int, staged: dict, keep: int, record: dict | None
    ) -> None:
        try:
            write_checkpoint(
                run_dir,
                step,
                staged,
                keep=keep,
                record=record,
                group=self.group,
                max_bytes_per_s=self.max_bytes_per_s,
            )
        except BaseException as err:  # raised where training next waits for it
            if is_lost_contact(err):
                self.on_lost_contact()
            self._failure = err

    @property
    def in_flight(self) -> bool:
        return self._writer is not None and self._writer.is_alive()

    def wait(self) -> float:
        """Wait for the save in flight (if any); seconds waited. Raises its failure."""
        if self._writer is None:
            return 0.0
        started = time.perf_counter()
        self._writer.join()
        self._writer = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        return time.perf_counter() - started

    def close(self) -> None:
        self.stager.close()


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1
