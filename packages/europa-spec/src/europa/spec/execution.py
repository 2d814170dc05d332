"""A rank's program executed on fake tensors (``europa plan --execute``): what a plugin
does differently there, stated once.

An execution runs one rank's real training step at the planned world size with no data:
tensors have shapes, dtypes and devices but no storage, and collectives return at once.
Two things a real run reads from data must then be given:

* **routing**: which experts a token picks decides the expert exchange's split sizes.
  A ``RoutingModel`` says how tokens pick, and every rank derives its send *and* receive
  counts from it, so ranks executed in separate processes agree on every exchange;
* **transport**: a layout that picks its transfers by the process group's backend
  (europa-flexshard sends gloo's gathers as direct transfers) takes the path of
  ``Execution.backend``, the backend the planned run would use, not that of the fake one.

A running job carries ``execution`` (``europa.spec.job.RunningJob``): None in a real run.
Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from europa.spec.errors import UserError

ROUTING_FORMS = ("uniform", "skew:S")
BACKENDS = ("nccl", "gloo")


class RoutingModelError(UserError):
    """A routing model given on the command line that cannot be read."""


@dataclass(frozen=True)
class RoutingModel:
    """How every token picks its ``top_k`` distinct experts in an execution.

    ``skew = 0``: uniformly among the experts it may reach (all of them, or those of the
    nodes node-limited routing lets it reach: ``parallel.ep_max_nodes_per_token``, the
    nodes themselves chosen uniformly, as group scores of equal experts choose them).
    ``skew = s > 0``: expert popularity follows Zipf's law with exponent ``s`` (the
    i-th most popular expert is picked in proportion to ``1 / i**s``), the popularity
    order a fixed shuffle of the experts (``seed``), so hot experts land on some ranks
    and not others; picks stay distinct, node limits apply as with ``skew = 0``."""

    skew: float = 0.0
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> RoutingModel:
        """``"uniform"`` or ``"skew:S"`` (S a finite number above 0), as ``--routing`` takes it."""
        text = text.strip()
        if text == "uniform":
            return cls()
        name, _, value = text.partition(":")
        if name == "skew" and value:
            try:
                skew = float(value)
            except ValueError:
                skew = math.nan
            if math.isfinite(skew) and skew > 0:
                return cls(skew=skew)
        raise RoutingModelError(
            f"routing model {text!r}: expected one of {', '.join(ROUTING_FORMS)} "
            "(S a number above 0, e.g. skew:1.2)"
        )

    @property
    def uniform(self) -> bool:
        return self.skew == 0.0

    def describe(self) -> str:
        return "uniform" if self.uniform else f"skew:{self.skew:g}"


@dataclass(frozen=True)
class Execution:
    """What a rank's program under execution takes from the command line instead of data.

    ``backend``: the process-group backend the planned run would use ("nccl" on GPUs,
    "gloo" on CPUs); a transport chosen by backend follows it. ``host_bytes_per_rank``: the
    host memory a rank of the planned machine has, for a plugin that would otherwise read
    this machine's (europa-offload's budget)."""

    routing: RoutingModel = RoutingModel()
    backend: str = "nccl"
    host_bytes_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise UserError(
                f"execution backend = {self.backend!r}: expected one of {', '.join(BACKENDS)}"
            )


__all__ = ["BACKENDS", "ROUTING_FORMS", "Execution", "RoutingModel", "RoutingModelError"]
