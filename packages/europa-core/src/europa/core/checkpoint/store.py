"""Distributed checkpoints (torch.distributed.checkpoint) that are never half-written.

Every rank writes its shards into ``checkpoints/.step-NNNNNNNN.partial``; only
after all ranks have finished does rank 0 write the marker and rename it to
``step-NNNNNNNN``. A crash mid-save leaves a ``.partial`` folder that is never loaded
and is cleared on resume and by the next save.

The marker records every file's size and crc32c, and every piece's crc32c, computed
as the bytes were written (``checksums``, ``marker``). A checkpoint whose files are
missing, of another size, or whose ``.metadata`` fails its checksum is damaged, found
before loading at the cost of one ``stat`` per file; a flipped bit in a shard file is
found as the piece holding it is read. Either is refused in one line naming the
file, or skipped for an older intact checkpoint with ``--resume-from-older``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from europa.core.checkpoint.checksums import ChecksummingWriter, file_problem
from europa.core.checkpoint.marker import (
    MARKER,
    FileRecord,
    UnreadableMarker,
    read_marker,
    write_marker,
)
from europa.core.checkpoint.reader import (
    METADATA_FILE,
    load_restricted,
    read_metadata,
    saved_checks,
)
from europa.core.errors import CheckpointError, ConfigError, is_user_error
from europa.core.launch.faults import root_exception
from europa.core.run_dir import CHECKPOINTS

_STEP_DIR = re.compile(r"^step-(\d{8})$")
T = TypeVar("T")
__all__ = ["MARKER"]


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:08d}"


def checkpoint_step(path: Path) -> int:
    """The step of the checkpoint at ``path`` (``.../checkpoints/step-N``)."""
    match = _STEP_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{str(path)!r}: expected a checkpoint folder named step-NNNNNNNN")
    return int(match.group(1))


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Finished checkpoints, oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def damage(path: Path) -> str | None:
    """What is wrong with the files of a complete checkpoint, or None when intact as far
    as sizes and the metadata's checksum tell (shard files are checked as read)."""
    try:
        marker = read_marker(path)
    except UnreadableMarker:
        return f"its marker file {MARKER} is unreadable"
    for name, record in sorted(marker.files.items()):
        problem = file_problem(path / name, record, read=False)
        if problem is not None:
            return problem
    metadata = marker.files.get(METADATA_FILE)
    return None if metadata is None else file_problem(path / METADATA_FILE, metadata)


def find_checkpoint(run_dir: Path, step: int | None) -> tuple[int, Path]:
    """Complete checkpoint ``step`` of ``run_dir`` (None: the newest)."""
    done = complete_checkpoints(run_dir)
    if not done:
        raise CheckpointError(
            f"{str(run_dir)!r} holds no complete checkpoint: expected a run directory with "
            "checkpoints/step-*"
        )
    if step is None:
        return done[-1]
    for found in done:
        if found[0] == step:
            return found
    steps = ", ".join(str(s) for s, _ in done)
    raise CheckpointError(f"--step = {step}: expected one of the saved steps ({steps})")


def checkpoint_to_resume(
    run_dir: Path,
    total_steps: int,
    *,
    from_older: bool = False,
    damaged: dict[Path, str] | None = None,
) -> tuple[int, Path]:
    """The newest complete checkpoint, if a run of ``total_steps`` can continue from it;
    with ``from_older``, the newest intact one when newer ones are damaged. ``damaged``:
    what loading found wrong with checkpoints that looked intact."""
    complete = complete_checkpoints(run_dir)
    if not complete:
        raise CheckpointError(
            f"--resume: {str(run_dir)!r} holds no complete checkpoint; expected "
            "checkpoints/step-* from an earlier run"
        )
    found = _newest_intact(complete, from_older, damaged or {})
    done, path = found
    if done > total_steps:
        raise ConfigError(
            f"training.steps = {total_steps}: expected at least the {done} steps the "
            f"checkpoint {str(path)!r} has already done"
        )
    return found


def _newest_intact(
    complete: list[tuple[int, Path]], from_older: bool, damaged: dict[Path, str]
) -> tuple[int, Path]:
    def problem_of(path: Path) -> str | None:
        return damaged.get(path) or damage(path)

    newest = complete[-1][1]
    problem = problem_of(newest)
    if problem is None:
        return complete[-1]
    older = next(((s, p) for s, p in reversed(complete[:-1]) if problem_of(p) is None), None)
    if from_older and older is not None:
        return older
    if older is None:
        hint = "no older checkpoint is intact either"
    else:
        hint = f"add --resume-from-older to continue from {older[1].name}, the newest intact one"
    raise CheckpointError(
        f"--resume: checkpoint {str(newest)!r} is damaged ({problem}); expected an intact "
        f"checkpoint: {hint}"
    )


def decided_on_rank_0(decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0, shared: every rank gets the same answer or raises the same
    error (a checkpoint or config error; anything else is raised on rank 0 alone)."""
    outcome: T | Exception | None = None
    if _is_main():
        try:
            outcome = decide()
        except (CheckpointError, ConfigError) as err:
            outcome = err
    outcome = _from_main(outcome)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def rank_0s_choice(chosen: Path | None) -> Path | None:
    """Rank 0's ``chosen`` checkpoint (None: a fresh start) on every rank: the launcher's
    choice reaches rank 0 under every launcher (under torchrun, rank 0 alone decides)."""
    return _from_main(chosen)


def clear_partials(run_dir: Path) -> None:
    """Remove what saves that never finished left behind."""
    for partial in (run_dir / CHECKPOINTS).glob(".step-*.partial"):
        shutil.rmtree(partial, ignore_errors=True)


def _barrier() -> None:
    if not _alone():
        dist.barrier()


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _alone() -> bool:
    """One process in all: DCP runs without collectives (``no_dist``).

    DCP's coordination gathers its plans through the process group even for one rank;
    gloo copies a large plan on its own thread with an OpenMP team, and libgomp, then
    managing more threads than there are CPUs, stops spinning between parallel regions
    for the rest of the process: every later step took about 20 % longer on 2 cores."""
    return not dist.is_initialized() or dist.get_world_size() == 1


@contextlib.contextmanager
def _quiet_when_alone():
    """DCP warns on every ``no_dist`` call that it assumes a single process: it is one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


# The optimizer's parameter groups keyed by parameter name, each rank's under its own
# keys: nested, they are one object every rank saves under the same key, and DCP keeps
# only one rank's, so a rank of another pipeline cut found no group for its parameters.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class TorchDistributedState:
    """Core's checkpoint state: torch's ``get_state_dict``/``set_state_dict``,
    which understand plain modules and FSDP2's DTensors."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=FLAT)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=FLAT,
        )


TRAINER = "trainer"  # the trainer's own state, beside the model and optimizer's


def checkpoint_content(state: Stateful, trainer_state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds: ``state``'s (model and optimizer) and the trainer's."""
    return {**state.state_dict(), TRAINER: trainer_state}


def save_checkpoint(
    run_dir: Path,
    step: int,
    state: Stateful,
    trainer_state: dict[str, Any],
    keep: int = 0,
    record: dict[str, Any] | None = None,
    *,
    max_bytes_per_s: float = 0,
) -> Path:
    """Write ``state`` (model and optimizer, see ``europa_checkpoint_state``)
    and the trainer's own state as checkpoint ``step``; every rank calls it, and
    training waits for it (``background.BackgroundSaves`` writes while it goes on)."""
    content = checkpoint_content(state, trainer_state)
    return write_checkpoint(
        run_dir, step, content, keep=keep, record=record, max_bytes_per_s=max_bytes_per_s
    )


def write_checkpoint(
    run_dir: Path,
    step: int,
    state_dict: dict[str, Any],
    *,
    keep: int = 0,
    record: dict[str, Any] | None = None,
    max_bytes_per_s: float = 0,
) -> Path:
    """Write ``state_dict`` as checkpoint ``step``, on every rank of the default group
    (a background save's writers have a world of their own), each rank writing at most
    ``max_bytes_per_s`` (0: no limit).

    A full disk (on any rank) removes the partial checkpoint and raises a
    CheckpointError on every rank; earlier checkpoints are untouched. ``record`` goes
    into the marker, beside the step, for checks before loading."""
    final = step_dir(run_dir, step)
    partial = final.with_name(f".{final.name}.partial")
    if _is_main():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    writer = ChecksummingWriter(str(partial), max_bytes_per_s=max_bytes_per_s)
    try:
        with _quiet_when_alone():
            dcp.save(state_dict, storage_writer=writer, no_dist=_alone())
    except CheckpointException as err:  # the same on every rank: DCP gathers the failures
        # Rank 0 judges (free space is what it sees before it frees any) for every rank.
        full = _is_main() and _is_disk_full(root_exception(err), partial)
        failure = _from_main(DISK_FULL if full else None)
        if failure is None:
            raise
    else:
        failure = None
        if _is_main():
            failure = _finish(run_dir, partial, final, step, keep, writer, record)
        failure = _from_main(failure)
    if failure is not None:
        if _is_main():
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()  # the space is free again before any rank writes its error report
        raise CheckpointError(
            f"checkpoint of step {step}: {failure}; the earlier checkpoints are intact: "
            f"free space under {str(partial.parent)!r}, then continue with: "
            f"europa train --resume --run-dir {run_dir}"
        )
    return final


# torch.save's zip writer reports a short write as "RuntimeError: [enforce fail at
# inline_container.cc] unexpected pos", without the errno; a disk that a failed write
# left with (almost) nothing free is taken as full.
_NEARLY_FULL_BYTES = 1 << 20
DISK_FULL = f"the disk is full ({os.strerror(errno.ENOSPC)})"


def _is_disk_full(err: BaseException, where: Path) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(err, OSError | RuntimeError):
        return False
    try:
        stats = os.statvfs(where)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < _NEARLY_FULL_BYTES


def _finish(
    run_dir: Path,
    partial: Path,
    final: Path,
    step: int,
    keep: int,
    writer: ChecksummingWriter,
    record: dict | None,
) -> str | None:
    """Rank 0, once every rank has written: the marker, the rename, pruning. Returns
    what went wrong when the disk is full, else None."""
    try:
        write_marker(partial, step, _file_records(partial, writer), writer.pieces, record)
    except OSError as err:
        if not _is_disk_full(err, partial):
            raise
        return DISK_FULL
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    _prune(run_dir, keep)
    return None


def _file_records(partial: Path, writer: ChecksummingWriter) -> dict[str, FileRecord]:
    """Every file of the checkpoint as the writer checksummed it. A rank with nothing to
    write leaves an empty file that no write result names."""
    records = {}
    for file in sorted(partial.iterdir()):
        size = file.stat().st_size
        record = writer.files.get(file.name) or (FileRecord(0, 0) if size == 0 else None)
        if record is None or record.bytes != size:
            raise RuntimeError(
                f"checkpoint writer: {file} holds {size} bytes, but the write results "
                f"record {record}; expected every file's bytes to pass through the writer"
            )
        records[file.name] = record
    return records


def _from_main(outcome: T) -> T:
    """Rank 0's outcome on every rank (a collective: also the barrier that ends a save)."""
    if _alone():
        return outcome
    shared = [outcome]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _prune(run_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for _, path in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _mismatch(path: Path, detail: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {str(path)!r} does not match this model or optimizer ({detail}); "
        "expected a checkpoint written by the same config"
    )


def check_compatible(path: Path, model: torch.nn.Module) -> None:
    """Compare the checkpoint's recorded parameter shapes with ``model`` (which
    may still be on the meta device) without reading any tensor data."""
    saved = read_metadata(path).state_dict_metadata
    saved_params = {
        key.removeprefix("model."): entry.size
        for key, entry in saved.items()
        if key.startswith("model.") and hasattr(entry, "size")
    }
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name not in saved_params:
            raise _mismatch(path, f"it has no model.{name}")
        if tuple(saved_params[name]) != tuple(param.shape):
            raise _mismatch(
                path,
                f"model.{name} is {tuple(saved_params[name])} there, {tuple(param.shape)} here",
            )
    known = params.keys() | {name for name, _ in model.named_buffers()}
    extra = sorted(saved_params.keys() - known)
    if extra:
        raise _mismatch(path, f"it has model.{extra[0]}, which this model lacks")


def _root_cause(err: BaseException) -> str:
    """The first rank's underlying error, on one line."""
    err = root_exception(err)
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def load_checkpoint(path: Path, state: Stateful, trainer_state: dict[str, Any]) -> dict[str, Any]:
    """Load into the live (sharded) model and optimizer; returns the trainer state."""
    template = state.state_dict()
    loaded = {**template, TRAINER: dict(trainer_state)}
    record, pieces = saved_checks(path)
    metadata = read_metadata(path, record)  # refused here, in one line, before DCP sees it
    try:
        with _quiet_when_alone():
            load_restricted(
                loaded, path, metadata=record, pieces=pieces, checked=metadata, no_dist=_alone()
            )
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        if is_user_error(root_exception(err)):  # e.g. a stored value refused as unsafe
            raise root_exception(err) from None
        raise _mismatch(path, _root_cause(err)) from None
    state.load_state_dict({key: loaded[key] for key in template})
    return loaded[TRAINER]
