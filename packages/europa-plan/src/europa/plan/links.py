"""How long a collective takes over the links it crosses: latency plus bytes over the
bandwidth a GPU gets, NVLink inside its domain (``gpus_per_node``), the network across.

Ranks are placed as Megatron places them: tp innermost, then cp, then the data-parallel
ranks (with ep carved out of tp × cp × dp for the experts), pp outermost. A group of
``size`` ranks ``stride`` apart spans the domains its members fall into.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from europa.plan.record import Efficiencies, Gpu

NVLINK_LATENCY_S = 10e-6  # a collective's start-up inside a domain (NCCL's order of magnitude)
NETWORK_LATENCY_S = 25e-6  # across domains


@dataclass(frozen=True)
class Group:
    """``size`` ranks, ``stride`` apart in the global order, and the GPUs a domain holds."""

    size: int
    stride: int
    per_node: int

    @property
    def nodes(self) -> int:
        """Domains the group spans."""
        if self.size <= 1:
            return 1
        span = (self.size - 1) * self.stride + 1
        return max(1, math.ceil(span / self.per_node)) if self.stride < self.per_node else self.size

    @property
    def per_domain(self) -> int:
        """Members of the group in one domain."""
        return max(1, self.size // self.nodes)

    @property
    def crosses(self) -> bool:
        return self.nodes > 1


def ring_network_share(members_per_domain: int) -> float:
    """Of what each rank of a ring collective spanning domains sends, the share its own
    network link carries. NCCL runs one ring per rail: each of a domain's members of the
    group carries one ring's crossing on its own network link, so a rank sends
    1/members of its ring bytes across, the rest over NVLink to the next rank of its
    domain (its total, ``(n − 1)/n`` of the tensor, is a ring's either way). With one
    network link a domain (gloo's one ring, on CPU ranks), the rank at the crossing
    sends all of them across: that is one member a domain."""
    return 1 / max(1, members_per_domain)


def _bandwidth(gpu: Gpu, eff: Efficiencies, crosses: bool) -> tuple[float, float]:
    if crosses:
        return gpu.network_gbps * 1e9 * eff.network, NETWORK_LATENCY_S
    return gpu.nvlink_gbps * 1e9 * eff.nvlink, NVLINK_LATENCY_S


def ring_seconds(kind: str, nbytes: float, group: Group, gpu: Gpu, eff: Efficiencies) -> float:
    """All-gather, reduce-scatter (``nbytes``: the whole, gathered tensor) or all-reduce
    (twice the traffic), as NCCL runs them: a ring in which each rank sends ``(n − 1)/n``
    of the tensor; on a group spread over domains, one ring a rail, each rank sending its
    ``ring_network_share`` of that over its own network link and the rest over NVLink, at
    once; the slower of the two sets the time."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    twice = 2 if kind == "all_reduce" else 1
    sent = nbytes * (group.size - 1) / group.size
    local = group.per_domain
    across = sent * ring_network_share(local) if group.crosses else 0.0
    nvlink, nvlink_latency = _bandwidth(gpu, eff, crosses=False)
    seconds = 0.0
    if local > 1:
        seconds = nvlink_latency * (local - 1) + twice * (sent - across) / nvlink
    if group.crosses:
        network, network_latency = _bandwidth(gpu, eff, crosses=True)
        seconds = max(seconds, network_latency * (group.nodes - 1) + twice * across / network)
    return seconds


def all_to_all_seconds(
    nbytes: float, group: Group, gpu: Gpu, eff: Efficiencies, remote_share: float | None = None
) -> float:
    """Each GPU sends ``nbytes`` spread over the group: the share bound for other domains
    over the network, the rest over NVLink, both at once. ``remote_share`` replaces the
    even spread's (a deduplicating dispatcher sends less across)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    local = group.per_domain
    remote = (group.size - local) / group.size if remote_share is None else remote_share
    inside = nbytes * (local - 1) / group.size
    nvlink, nvlink_latency = _bandwidth(gpu, eff, crosses=False)
    seconds = nvlink_latency + inside / nvlink
    if group.crosses:
        network, network_latency = _bandwidth(gpu, eff, crosses=True)
        seconds = max(seconds, network_latency + nbytes * remote / network)
    return seconds


def p2p_seconds(nbytes: float, crosses: bool, gpu: Gpu, eff: Efficiencies) -> float:
    bandwidth, latency = _bandwidth(gpu, eff, crosses)
    return latency + nbytes / bandwidth
