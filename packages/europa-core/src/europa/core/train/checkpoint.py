"""Distributed checkpoints (torch.distributed.checkpoint) that are never half-written.

Every rank writes its shards into ``checkpoints/.step-NNNNNNNN.partial``; only
after all ranks have finished does rank 0 rename it to ``step-NNNNNNNN``. A
crash mid-save leaves a ``.partial`` folder that is never loaded and is
cleared by the next save.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from europa.core.errors import CheckpointError, ConfigError, is_user_error
from europa.core.run_dir import CHECKPOINTS
from europa.core.train.checkpoint_reader import (
    RestrictedFileSystemReader,
    WeightsOnlyLoadPlanner,
    read_metadata,
)

_STEP_DIR = re.compile(r"^step-(\d{8})$")
MARKER = "europa-checkpoint.json"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:08d}"


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


def checkpoint_to_resume(run_dir: Path, total_steps: int) -> tuple[int, Path]:
    """The newest complete checkpoint, if a run of ``total_steps`` can continue from it."""
    found = latest_checkpoint(run_dir)
    if found is None:
        raise CheckpointError(
            f"--resume: {str(run_dir)!r} holds no complete checkpoint; expected "
            "checkpoints/step-* from an earlier run"
        )
    done, path = found
    if done > total_steps:
        raise ConfigError(
            f"training.steps = {total_steps}: expected at least the {done} steps the "
            f"checkpoint {str(path)!r} has already done"
        )
    return found


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class TorchDistributedState:
    """Core's checkpoint state: torch's ``get_state_dict``/``set_state_dict``,
    which understand plain modules and FSDP2's DTensors."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


def save_checkpoint(
    run_dir: Path,
    step: int,
    state: Stateful,
    trainer_state: dict[str, Any],
    keep: int = 0,
    record: dict[str, Any] | None = None,
) -> Path:
    """Write ``state`` (model and optimizer, see ``europa_checkpoint_state``)
    and the trainer's own state as checkpoint ``step``; every rank calls it.
    ``record`` goes into the marker, beside the step, for checks before loading."""
    final = step_dir(run_dir, step)
    partial = final.with_name(f".{final.name}.partial")
    if _is_main():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    dcp.save({**state.state_dict(), "trainer": trainer_state}, checkpoint_id=str(partial))
    _barrier()
    if _is_main():
        (partial / MARKER).write_text(json.dumps({"step": step, **(record or {})}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        _prune(run_dir, keep)
    _barrier()
    return final


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


def _first_failure(err: BaseException) -> BaseException:
    """The first rank's underlying error."""
    failures = getattr(err, "failures", None)
    if failures:
        wrapped = next(iter(failures.values()))  # (exception, traceback frames)
        err = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return err


def _root_cause(err: BaseException) -> str:
    """The first rank's underlying error, on one line."""
    lines = str(_first_failure(err)).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def load_checkpoint(path: Path, state: Stateful, trainer_state: dict[str, Any]) -> dict[str, Any]:
    """Load into the live (sharded) model and optimizer; returns the trainer state."""
    template = state.state_dict()
    loaded = {**template, "trainer": dict(trainer_state)}
    read_metadata(path)  # refused here, in one line, before DCP sees it
    try:
        dcp.load(
            loaded,
            storage_reader=RestrictedFileSystemReader(str(path)),
            planner=WeightsOnlyLoadPlanner(),
        )
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        if is_user_error(_first_failure(err)):  # e.g. a stored value refused as unsafe
            raise _first_failure(err) from None
        raise _mismatch(path, _root_cause(err)) from None
    state.load_state_dict({key: loaded[key] for key in template})
    return loaded["trainer"]
