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
