"""The nodes of an expert-parallel group: which of its ranks share a node's fast link.

Ranks are numbered node by node (as torchrun and SLURM number them) and an ep group
is ``ep`` consecutive ranks (``ep`` is the mesh's innermost axis), so the group is
``nodes × local`` ranks: ``local = min(ep, ranks per node)`` consecutive ranks on
each of its nodes. The two-level exchange uses two kinds of subgroup:

* a *node group*: the ``local`` ranks of the ep group on one node (the fan-out);
* a *rail group*: the ``nodes`` ranks of the ep group with the same position on
  their node, one per node (the crossing between nodes: each rank talks to its
  peers on the other nodes, as DeepEP's RDMA ranks do).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from europa.flexshard.errors import PlanError


@dataclass(frozen=True)
class ExpertNodes:
    """This rank's view of its ep group's nodes: ``local`` ranks of the group per node,
    its node group and its rail group (None: the group lies inside one node)."""

    local: int
    node_group: dist.ProcessGroup | None = None
    rail_group: dist.ProcessGroup | None = None


def split_into_nodes(ep_ranks: Sequence[int], per_node: int) -> list[list[int]]:
    """The global ranks of one ep group, node by node; refuses a group whose consecutive
    ranks do not share nodes."""
    ranks = list(ep_ranks)
    if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        raise PlanError(f"ep group {ranks}: expected consecutive ranks (ep is the innermost axis)")
    local = min(len(ranks), per_node)
    nodes = [ranks[i : i + local] for i in range(0, len(ranks), local)]
    for members in nodes:
        if len(members) != local or len({r // per_node for r in members}) != 1:
            raise PlanError(
                f"ep group {ranks} at {per_node} ranks per node: ranks {members} are expected "
                "on one node; expected an ep group inside one node or holding whole nodes"
            )
    return nodes


def expert_node_groups(ep_groups: Sequence[Sequence[int]], per_node: int) -> ExpertNodes:
    """Build every ep group's node and rail subgroups (a collective: every rank calls it
    with the same ``ep_groups``) and return this rank's. ``per_node``: ranks per node."""
    split = [split_into_nodes(group, per_node) for group in ep_groups]
    local = len(split[0][0])
    node_lists = [members for nodes in split for members in nodes]
    rail_lists = [[node[i] for node in nodes] for nodes in split for i in range(local)]
    node_group, _ = dist.new_subgroups_by_enumeration(node_lists)
    rail_group, _ = dist.new_subgroups_by_enumeration(rail_lists)
    return ExpertNodes(local, node_group, rail_group)


def launcher_ranks_per_node(world_size: int) -> int:
    """Ranks per node as the launcher says (``LOCAL_WORLD_SIZE``), else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world_size
