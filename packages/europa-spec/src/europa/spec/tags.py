"""Tags one package puts on a tensor for another to read, as plain attributes (so neither
imports the other), and the observers that hear of each tag as it is put on.

An observer (``observe``) is how a tool that watches a whole rank (the memory ledger of
``europa plan --execute``) learns what a buffer is at the moment it is made, whoever
makes it; with none registered a tag costs one attribute write."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# A parameter gathered whole for forward and backward (europa-flexshard), saved by autograd
# but re-gathered by its layout in backward: activation offload leaves it where it is.
GATHERED_PARAMETER = "europa_gathered_parameter"

# A buffer a layout moves in place of a collective it stands for (europa-flexshard's
# point-to-point gather and reduce-scatter on gloo), or whose collective is one of the
# planner's kinds that the entry point alone does not tell (an all-reduce of a replica sum):
# the planner's kind of that traffic ("parameter_gather", "gradient_replica_all_reduce", ...),
# which europa-overlap's timeline and the execution's byte count file it as.
TRAFFIC = "europa_traffic"

# What a buffer is in the planner's memory terms (``MEMORY_TERMS``), for a ledger that sorts
# a rank's memory as the plan does.
MEMORY = "europa_memory"
MEMORY_TERMS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "gathered_parameters",
    "gradient_buffers",
    "sum_buffers",
    "expert_buffers",
    "attention_scores",
    "optimizer_workspace",
    "model_buffers",
    "checkpoint_staging",
)

Observer = Callable[[Any, str, str], None]  # (tensor, tag, value)
_observers: list[Observer] = []


def observe(observer: Observer) -> Callable[[], None]:
    """Call ``observer(tensor, tag, value)`` for every tag put on from now on; returns
    what stops it."""
    _observers.append(observer)
    return lambda: _observers.remove(observer)


def _put(tensor, tag: str, value) -> None:
    setattr(tensor, tag, value)
    for observer in _observers:
        observer(tensor, tag, value)


def mark_gathered(tensor) -> None:
    _put(tensor, GATHERED_PARAMETER, True)


def is_gathered(tensor) -> bool:
    return getattr(tensor, GATHERED_PARAMETER, False) is True


def mark_traffic(tensor, kind: str) -> None:
    _put(tensor, TRAFFIC, kind)


def traffic_kind(tensor) -> str | None:
    kind = getattr(tensor, TRAFFIC, None)
    return kind if isinstance(kind, str) else None


def mark_memory(tensor, term: str) -> None:
    if term not in MEMORY_TERMS:
        raise ValueError(f"memory term {term!r}: expected one of {', '.join(MEMORY_TERMS)}")
    _put(tensor, MEMORY, term)


def memory_term(tensor) -> str | None:
    term = getattr(tensor, MEMORY, None)
    return term if isinstance(term, str) else None


__all__ = [
    "GATHERED_PARAMETER",
    "MEMORY",
    "MEMORY_TERMS",
    "TRAFFIC",
    "Observer",
    "is_gathered",
    "mark_gathered",
    "mark_memory",
    "mark_traffic",
    "memory_term",
    "observe",
    "traffic_kind",
]
