"""Tags one package puts on a tensor for another to read, as plain attributes (so neither
imports the other)."""

from __future__ import annotations

# A parameter gathered whole for forward and backward (europa-flexshard), saved by autograd
# but re-gathered by its layout in backward: activation offload leaves it where it is.
GATHERED_PARAMETER = "europa_gathered_parameter"


def mark_gathered(tensor) -> None:
    setattr(tensor, GATHERED_PARAMETER, True)


def is_gathered(tensor) -> bool:
    return getattr(tensor, GATHERED_PARAMETER, False) is True


# A gradient buffer all-reduced in place as a reduce-scatter (europa-flexshard on gloo, which
# has no reduce-scatter of its own): europa-overlap's timeline files it as one.
REDUCE_SCATTER = "europa_reduce_scatter"


def mark_reduce_scatter(tensor) -> None:
    setattr(tensor, REDUCE_SCATTER, True)


def is_reduce_scatter(tensor) -> bool:
    return getattr(tensor, REDUCE_SCATTER, False) is True
