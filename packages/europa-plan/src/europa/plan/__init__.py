"""europa-plan: plan a training run from a TOML file, with the standard library only.

A runs file (``[[gpu]]``, ``[[model]]``, ``[[run]]`` tables) is read into immutable
records (``europa.plan.record``) and checked (``europa.plan.reader``); each run is then
counted: its FLOPs per token in its source's convention and as the GPUs execute them
(``europa.plan.flops``) and its memory per GPU (``europa.plan.memory``).
"""

from __future__ import annotations

import functools
from pathlib import Path

from europa.plan.builtin import builtin_tables
from europa.plan.errors import PlanInputError
from europa.plan.reader import RunsFile, read_runs, read_tables


def load_runs(path: str | Path) -> RunsFile:
    """A runs file, read and checked, knowing europa-plan's built-in generations, GPUs and
    models."""
    return read_runs(path, builtin_tables())


@functools.cache
def builtins() -> RunsFile:
    """The built-in generations, GPUs and models alone, as an empty runs file knows them
    (read once a process: europa-core's planner asks for them in every layout it plans)."""
    return read_tables({}, builtin_tables(), Path("builtin.toml"))


__all__ = ["PlanInputError", "RunsFile", "builtins", "load_runs"]
