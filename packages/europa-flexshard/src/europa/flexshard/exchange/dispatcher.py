"""Expert dispatchers: torchtitan's ``dispatch``/``combine`` interface over a chunked one.

A dispatcher moves a rank's (token, expert) pairs to the ranks owning the experts
and the experts' outputs back. Two live beside this file, with one protocol:

* ``FlatDispatcher`` (``europa.flexshard.exchange.flat``): one row per (token, expert) pair;
* ``TwoLevelDispatcher`` (``europa.flexshard.exchange.two_level``): one row per (token,
  destination node) between nodes, then one per (token, destination rank) inside.

``begin(x, scores, ids, chunks)`` issues the dispatch of every chunk and returns a
``RoutedExchange``; for each chunk, ``arrive(c)`` waits for its rows and returns them grouped
by local expert with the count per local expert, and ``send_back(c, out)`` issues the
return of the experts' outputs; ``finish()`` waits for every return and gives each
token the weighted sum of its experts' outputs. torchtitan's ``dispatch`` and
``combine`` are that with one chunk. europa-overlap drives the chunked form (the
shared expert computes while chunks travel); nothing else re-implements an exchange.

Shape suffixes (``x_TD``, ``ids_TK``, ...): the notation in ``europa.flexshard.exchange``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from europa.flexshard.exchange.codec import Codec
from europa.flexshard.exchange.kept import Keeper
from europa.flexshard.exchange.routing import (
    ModelledRouting,
    RoutingTable,
    TensorRouting,
    routing_table,
)
from europa.flexshard.exchange.wire import Wire
from europa.spec.dispatch import RoutedExchange
from europa.spec.execution import RoutingModel


class ExpertDispatcher:
    """``ranges[r]``: the (start, stop) of the experts ep rank ``r`` owns (contiguous runs
    in rank order). ``wire``: the dispatch and combine wire dtypes. ``keeper``: where the
    layer's exchanges are kept for a recomputation (None: they are not). ``routing``: a
    routing model whose expected counts size the exchanges instead of the routing tensors
    (an execution on fake tensors, ``europa.flexshard.exchange.routing``), with at most
    ``max_nodes`` nodes a token (0: all) and ``local`` ranks of the group a node (0: one
    node)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        ranges: Sequence[tuple[int, int]],
        top_k: int,
        *,
        wire: Wire | None = None,
        keeper: Keeper | None = None,
        routing: RoutingModel | None = None,
        max_nodes: int = 0,
        local: int = 0,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = rank
        self.ranges = list(ranges)
        self.top_k = top_k
        self.wire = wire or Wire()
        self.keeper = keeper
        self.experts_per_rank = [stop - start for start, stop in self.ranges]
        self.num_experts = self.ranges[-1][1] if self.ranges else 0
        self.routing = TensorRouting() if routing is None else ModelledRouting()
        self.table: RoutingTable | None = None
        if routing is not None:
            local = local or len(self.ranges)
            self.table = routing_table(routing, self.ranges, local, top_k, max_nodes)

    @property
    def local_experts(self) -> int:
        return self.experts_per_rank[self.rank]

    def codecs(self) -> tuple[Codec, Codec]:
        """(towards the experts, back from them)."""
        return Codec(self.wire.dispatch), Codec(self.wire.combine)

    def begin(
        self, x_TD: torch.Tensor, scores_TK: torch.Tensor, ids_TK: torch.Tensor, chunks: int = 1
    ) -> RoutedExchange:
        raise NotImplementedError

    # -- torchtitan's token dispatcher interface ----------------------------------------------

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, RoutedExchange]:
        routed = self.begin(x_TD, topk_scores_TK, topk_expert_ids_TK)
        rows, counts = routed.arrive(0)
        return rows, counts, routed

    def combine(
        self, routed_output_RD: torch.Tensor, metadata: RoutedExchange, x_TD: torch.Tensor
    ) -> torch.Tensor:
        metadata.send_back(0, routed_output_RD)
        return metadata.finish()

    def wire_meshes(self, **_: Any) -> None:  # torchtitan's interface; the groups are ours
        return None


def by_local_expert(counts: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Indices that reorder rows received source by source (``counts[source][expert]``,
    each source's rows sorted by expert) into local-expert order, sources in order
    within an expert. Made on ``device`` from one offset a (source, expert): a row's
    index never crosses to the device."""
    experts = len(counts[0]) if counts else 0
    starts, offset = [], 0  # each (source, expert)'s first row as received
    for row in counts:
        starts.append([])
        for count in row:
            starts[-1].append(offset)
            offset += count
    segments = [(e, s) for e in range(experts) for s in range(len(counts))]
    sizes = [counts[s][e] for e, s in segments]
    # a row's index is its segment's first received row plus its place in the segment
    shift, placed = [], 0
    for (e, s), size in zip(segments, sizes, strict=True):
        shift.append(starts[s][e] - placed)
        placed += size
    if not placed:
        return torch.zeros(0, dtype=torch.int64, device=device)
    shifts = torch.tensor(shift, dtype=torch.int64, device=device)
    repeats = torch.tensor(sizes, dtype=torch.int64, device=device)
    per_row = torch.repeat_interleave(shifts, repeats, output_size=placed)
    return per_row + torch.arange(placed, device=device)
