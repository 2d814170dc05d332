"""Replica groups that come and go: what a technique does with a cross-replica sum when
the run is fault-tolerant.

Design note. With ``fault_tolerance.enabled``, each of the ``parallel.dp_replicate``
replica groups is a job of its own (its own process group, its own mesh without the
replicate axis), and the groups meet only through a fault-tolerance manager (torchft's),
whose quorum says each step which groups take part. Ownership is positional: rank ``k``
of one group holds what rank ``k`` of every other holds, so a cross-replica sum is one
collective among the ranks ``k`` of the groups in the quorum. A technique that would sum
over a replicate dimension asks ``job.state[REPLICA_GROUPS]`` instead: absent, the run
is not fault-tolerant and its own groups hold every replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

REPLICA_GROUPS = "replica_groups"  # job.state key: this run's ReplicaGroups, if fault-tolerant
# job.state key, set by a layout whose own once-a-step sums average over REPLICA_GROUPS:
# the trainer then leaves the gradients to it.
LAYOUT_SUMS_REPLICAS = "layout_sums_replicas"


class ReplicaGroups(Protocol):
    def average(self, tensors: Sequence[torch.Tensor]) -> None:
        """Average ``tensors`` in place over this step's participating replica groups
        (with rank ``k`` of each). After a failure inside the step the values are
        undefined and the step does not commit."""

    def maximum(self, tensor: torch.Tensor) -> None:
        """The elementwise maximum of ``tensor`` over this step's participating replica
        groups, in place (a group that does not take part counts as zeros)."""

    def participants(self) -> int:
        """How many replica groups take part in this step."""


__all__ = ["LAYOUT_SUMS_REPLICAS", "REPLICA_GROUPS", "ReplicaGroups"]
