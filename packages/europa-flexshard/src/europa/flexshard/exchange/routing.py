"""Where an expert exchange's data-dependent decisions come from.

Design note. A dispatcher sizes every buffer from the routing: how many (token, expert)
pairs go to each expert (flat), how many rows reach each node and then each rank of it
(two-level), how many pairs each expert receives. In a run those counts are read from
the routing tensors (``TensorRouting``: ``bincount``, ``nonzero`` and one read back to
the host per exchange, exactly as the dispatchers always did). In an execution on fake
tensors (``europa.spec.execution``) the tensors hold no values, so ``ModelledRouting``
answers the same questions from a routing model instead: the *expected* counts, rounded,
computed by every rank for every sender and receiver with the same arithmetic, so a
rank's received counts equal what its senders send, whichever process runs which rank.

Each dispatcher asks at the same points with the same arguments, so a run and its
execution take the same code path around the answers:

* ``counts(index, bins)``: the count tensor a dispatcher exchanges (``bincount``);
* ``hits(owner_of_slot, destinations, rows_to)``: (destination, row) of every row that has
  a slot owned by a destination (``nonzero``), destination-major (``rows_to()``: the rows
  the model expects to each destination);
* ``read(tensor, expected)``: a count tensor read back to the host (``tolist``);
* ``pairs(slots)``: the (row, slot) entries that name an expert (``nonzero``).

``rows_to`` and ``expected`` are what the model expects there (callables, evaluated only
by ``ModelledRouting``); ``RoutingTable`` holds the probabilities they come from.

Every source is assumed to route the same number of tokens per layer call (a training
micro-batch is the same size on every rank).
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from europa.spec.execution import RoutingModel

NO_EXPERT = -1
SKEW_SAMPLES = 4096  # tokens drawn to estimate a skewed model's probabilities


class TensorRouting:
    """The routing as the tensors hold it (every real run)."""

    def counts(self, index: torch.Tensor, bins: int) -> torch.Tensor:
        return torch.bincount(index, minlength=bins).to(torch.int64)

    def hits(
        self, owner_of_slot: torch.Tensor, destinations: int, rows_to: Callable[[], list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = owner_of_slot.shape[0]
        hit = torch.zeros(rows, destinations + 1, dtype=torch.bool, device=owner_of_slot.device)
        hit.scatter_(1, owner_of_slot, True)
        return hit[:, :destinations].t().nonzero(as_tuple=True)

    def read(self, tensor: torch.Tensor, expected: Callable[[], list]) -> list:
        return tensor.tolist()

    def pairs(self, slots: torch.Tensor, expected: Callable[[], int]) -> torch.Tensor:
        return (slots != NO_EXPERT).nonzero().squeeze(1)


class ModelledRouting:
    """The counts a routing model expects (an execution on fake tensors): tensors of the
    expected lengths, whose values nobody reads, and host counts from the model. Index
    tensors hold zeros, valid wherever they index: on a CPU plan the host's index
    arithmetic runs for real on them."""

    def counts(self, index: torch.Tensor, bins: int) -> torch.Tensor:
        return torch.empty(bins, dtype=torch.int64, device=index.device)

    def hits(
        self, owner_of_slot: torch.Tensor, destinations: int, rows_to: Callable[[], list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = sum(rows_to())
        device = owner_of_slot.device
        return (
            torch.zeros(total, dtype=torch.int64, device=device),
            torch.zeros(total, dtype=torch.int64, device=device),
        )

    def read(self, tensor: torch.Tensor, expected: Callable[[], list]) -> list:
        return expected()

    def pairs(self, slots: torch.Tensor, expected: Callable[[], int]) -> torch.Tensor:
        return torch.zeros(expected(), dtype=torch.int64, device=slots.device)


def rounded(x: float) -> int:
    """Half up: the same integer on every rank for the same expectation."""
    return math.floor(x + 0.5)


@dataclass(frozen=True)
class RoutingTable:
    """What a routing model expects of one ep group's tokens: per expert the share of a
    source's (token, expert) pairs, per node and per rank the probability that a token
    reaches it, and per rank the expected picks of its experts by one token."""

    expert_share: tuple[float, ...]
    node_hit: tuple[float, ...]
    rank_hit: tuple[float, ...]
    rank_picks: tuple[float, ...]
    local: int  # ranks of the group per node
    _flat: dict[tuple[int, int], tuple[int, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def node_of(self, rank: int) -> int:
        return rank // self.local

    # -- flat: one row per (token, expert) pair ----------------------------------------------

    def flat_pairs(self, source: int, pairs: int) -> tuple[int, ...]:
        """``pairs`` (token, expert) pairs of ``source`` apportioned over the experts by
        largest remainder; ties go round the experts from one that depends on the source,
        so the rounding does not favour the same experts on every source."""
        key = (source, pairs)
        if key not in self._flat:
            self._flat[key] = self._apportion(source, pairs)
        return self._flat[key]

    def _apportion(self, source: int, pairs: int) -> tuple[int, ...]:
        experts = len(self.expert_share)
        exact = [pairs * share for share in self.expert_share]
        counts = [math.floor(x) for x in exact]
        left = pairs - sum(counts)

        def priority(e: int) -> tuple[float, int]:
            return -(exact[e] - counts[e]), (e - source) % experts

        for e in sorted(range(experts), key=priority)[:left]:
            counts[e] += 1
        return tuple(counts)

    # -- two-level: one row per (token, node), then per (token, rank) ---------------------------

    def rows_to_node(self, tokens: int, node: int) -> int:
        """Rows a source of ``tokens`` tokens sends to ``node`` (its own node included)."""
        return rounded(tokens * self.node_hit[node])

    def rows_to_rank(self, rows: int, rank: int) -> int:
        """Rows a forwarder that received ``rows`` for its node passes to ``rank`` of it."""
        node_hit = self.node_hit[self.node_of(rank)]
        return rounded(rows * self.rank_hit[rank] / node_hit) if node_hit else 0

    def pairs_at_rank(self, rows: int, rank: int) -> int:
        """(row, expert) pairs ``rows`` rows reaching ``rank`` carry for its experts."""
        hit = self.rank_hit[rank]
        return rounded(rows * self.rank_picks[rank] / hit) if hit else 0


def routing_table(
    model: RoutingModel,
    ranges: Sequence[tuple[int, int]],
    local: int,
    top_k: int,
    max_nodes: int = 0,
) -> RoutingTable:
    """The table of ``model`` for an ep group whose rank r owns experts ``ranges[r]``,
    ``local`` ranks a node, each token picking ``top_k`` distinct experts among those of at
    most ``max_nodes`` nodes (0: all)."""
    return _table(model, tuple(tuple(r) for r in ranges), local, top_k, max_nodes)


@functools.lru_cache(maxsize=16)
def _table(model, ranges, local, top_k, max_nodes) -> RoutingTable:
    experts = ranges[-1][1]
    nodes = max(1, len(ranges) // local)
    node_ranges = [(ranges[n * local][0], ranges[(n + 1) * local - 1][1]) for n in range(nodes)]
    limit = max_nodes if 0 < max_nodes < nodes else 0
    if model.uniform:
        return _uniform(ranges, node_ranges, local, experts, top_k, nodes, limit)
    return _sampled(model, ranges, node_ranges, local, experts, top_k, limit)


def _uniform(ranges, node_ranges, local, experts, top_k, nodes, limit) -> RoutingTable:
    """Closed forms: ``top_k`` distinct experts uniformly among ``pool`` reachable ones
    (all, or those of ``limit`` nodes chosen uniformly) miss a set of ``s`` experts with
    probability C(pool - s, k) / C(pool, k)."""
    chosen = limit / nodes if limit else 1.0  # P(a given node is reachable)
    pool = experts * limit // nodes if limit else experts

    def hit(size: int) -> float:
        if size <= 0:
            return 0.0
        miss = math.comb(pool - size, top_k) / math.comb(pool, top_k) if pool - size >= 0 else 0.0
        return chosen * (1.0 - miss)

    return RoutingTable(
        expert_share=tuple(1.0 / experts for _ in range(experts)),
        node_hit=tuple(hit(b - a) for a, b in node_ranges),
        rank_hit=tuple(hit(b - a) for a, b in ranges),
        rank_picks=tuple(top_k * (b - a) / experts for a, b in ranges),
        local=local,
    )


def _sampled(model, ranges, node_ranges, local, experts, top_k, limit) -> RoutingTable:
    """Estimates from ``SKEW_SAMPLES`` tokens drawn with a fixed seed (the same numbers on
    every rank): each draws its experts without replacement in proportion to Zipf
    popularity (Efraimidis–Spirakis keys), node limits applied by the top two keys of each
    node, as the router scores groups."""
    rng = random.Random(model.seed)
    popularity = list(range(experts))
    rng.shuffle(popularity)  # expert e is the popularity[e]-th most popular
    weight = [1.0 / (popularity[e] + 1) ** model.skew for e in range(experts)]
    owner_rank = [r for r, (a, b) in enumerate(ranges) for _ in range(a, b)]
    picks = [0] * experts
    node_hits = [0] * len(node_ranges)
    rank_hits = [0] * len(ranges)
    for _ in range(SKEW_SAMPLES):
        keys = [rng.random() ** (1.0 / w) for w in weight]
        pool: Sequence[int] = range(experts)
        if limit:
            scores = [sum(heapq.nlargest(2, keys[a:b])) for a, b in node_ranges]
            nodes = heapq.nlargest(limit, range(len(node_ranges)), key=scores.__getitem__)
            pool = [e for n in nodes for e in range(*node_ranges[n])]
        chosen = heapq.nlargest(top_k, pool, key=keys.__getitem__)
        ranks = {owner_rank[e] for e in chosen}
        for e in chosen:
            picks[e] += 1
        for r in ranks:
            rank_hits[r] += 1
        for n in {r // local for r in ranks}:
            node_hits[n] += 1
    total = SKEW_SAMPLES * top_k
    return RoutingTable(
        expert_share=tuple(p / total for p in picks),
        node_hit=tuple(h / SKEW_SAMPLES for h in node_hits),
        rank_hit=tuple(h / SKEW_SAMPLES for h in rank_hits),
        rank_picks=tuple(sum(picks[a:b]) / SKEW_SAMPLES for a, b in ranges),
        local=local,
    )
