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


# A buffer a layout moves in place of a collective it stands for (europa-flexshard's
# point-to-point gather and reduce-scatter on gloo): the planner's kind of that traffic
# ("parameter_gather", "gradient_reduce_scatter"), which europa-overlap's timeline files it as.
TRAFFIC = "europa_traffic"


def mark_traffic(tensor, kind: str) -> None:
    setattr(tensor, TRAFFIC, kind)


def traffic_kind(tensor) -> str | None:
    kind = getattr(tensor, TRAFFIC, None)
    return kind if isinstance(kind, str) else None
