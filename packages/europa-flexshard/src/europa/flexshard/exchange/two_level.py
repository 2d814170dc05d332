"""The two-level expert exchange: a token crosses between nodes once per destination node,
then fans out inside the node; outputs are summed per node before they travel back.

Design note. The ep group is ``nodes × local`` ranks (``europa.flexshard.exchange.nodes``);
rank (n, l) sits at position l of node n. For a token of rank (n, l):

1. *Between nodes* (rail group: the ranks at position l of every node): one row
   to each node holding at least one of its experts, carrying the token and its
   ``top_k`` routing slots (each slot's expert as an id local to that node, -1 when
   the expert lives elsewhere, and its score). The row for its own node is a local
   copy. The counts of rows per node go first, so buffers are sized exactly.
2. *Inside the node* (node group): the receiving rank (m, l) forwards each row once
   to each rank of node m owning at least one of the row's experts, with the slots
   renumbered to that rank's experts.
3. The expert rank expands each row into its (row, slot) pairs, sorted by local
   expert for the grouped GEMM.

Combine reverses it, summing as early as possible: the expert rank weights each
pair's output by its score and sums a row's pairs; the forwarder sums, per
stage-1 row, what its node's ranks sent back; the token's rank sums over nodes.
Sums run in fp32. Autograd needs nothing more: every step is a differentiable op
or an all-to-all (``europa.flexshard.exchange.all_to_all``), whose backward is the same
all-to-all reversed, so the backward crosses the two levels in reverse order. The
scores travel with the rows (their gradients come back the same way).

Chunks split the rank's *tokens* (not its experts, as the flat exchange does): each
token still crosses to a node once. Results equal the unchunked ones to rounding
(an expert's weight gradient then sums its rows chunk by chunk).

Shape suffixes (``x_TD``, ``ids_TK``, ...): the notation in ``europa.flexshard.exchange``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from europa.flexshard.exchange.all_to_all import Flight, Part, exchange_counts, launch, wait
from europa.flexshard.exchange.codec import Codec
from europa.flexshard.exchange.dispatcher import ExpertDispatcher
from europa.flexshard.exchange.nodes import ExpertNodes
from europa.flexshard.exchange.routing import NO_EXPERT
from europa.flexshard.exchange.summing import sum_rows

# How the routing slots travel: scores as they are (their gradients come back the same
# way); expert ids as they are, with no gradient to send back.
AS_IS, NO_GRADIENT = Codec(), None


class TwoLevelDispatcher(ExpertDispatcher):
    """One row per (token, destination node), then per (token, destination rank)."""

    def __init__(self, group, rank, ranges, top_k, *, nodes: ExpertNodes, **options) -> None:
        super().__init__(group, rank, ranges, top_k, local=nodes.local, **options)
        local = nodes.local
        if len(self.ranges) % local:
            raise ValueError(f"{len(self.ranges)} ep ranks do not split into nodes of {local}")
        self.nodes = nodes
        self.node_count = len(self.ranges) // local
        self.node, self.position = divmod(rank, local)
        owner = torch.cat([torch.full((b - a,), r) for r, (a, b) in enumerate(self.ranges)])
        self.node_of_expert = owner // local  # [E]
        self.node_first = torch.tensor([self.ranges[m * local][0] for m in range(self.node_count)])
        first = self.ranges[self.node * local][0]
        mine = self.ranges[self.node * local : (self.node + 1) * local]
        # This node's experts (ids local to the node) -> the node's rank owning each.
        self.local_owner = torch.cat(
            [torch.full((b - a,), j) for j, (a, b) in enumerate(mine)] + [torch.tensor([local])]
        )
        self.local_first = torch.tensor([a - first for a, _ in mine])

    # -- what a routing model expects (an execution on fake tensors) ------------------------
    # Every source routes as many tokens as this one, so what a source sends to a node
    # depends on the node only, and every forwarder of a node receives as many rows.

    def _to_nodes(self, tokens: int) -> list[int]:
        """Stage-1 rows a source of ``tokens`` tokens sends to each node."""
        return [self.table.rows_to_node(tokens, m) for m in range(self.node_count)]

    def _from_nodes(self, sizes: list[int]) -> list[list[int]]:
        """Stage-1 rows this rank receives from each node's source, per chunk of ``sizes``."""
        return [[self.table.rows_to_node(n, self.node) for n in sizes]] * self.node_count

    def _to_ranks(self, rows: int) -> list[int]:
        """Stage-2 rows a forwarder that received ``rows`` passes to each rank of its node."""
        first = self.node * self.nodes.local
        return [self.table.rows_to_rank(rows, first + j) for j in range(self.nodes.local)]

    def _pairs_here(self, rows: list[int]) -> int:
        """(row, slot) pairs for this rank's experts in the stage-2 ``rows`` it receives."""
        return sum(self.table.pairs_at_rank(n, self.rank) for n in rows)

    def begin(self, x_TD, scores_TK, ids_TK, chunks: int = 1) -> TwoLevelRouted:
        device, nodes, routing = x_TD.device, self.node_count, self.routing
        tokens = x_TD.shape[0]
        node_of_expert, node_first = self.node_of_expert.to(device), self.node_first.to(device)
        bounds = [(tokens * c // chunks, tokens * (c + 1) // chunks) for c in range(chunks)]
        sizes = [hi - lo for lo, hi in bounds]
        plans = []
        for (lo, hi), size in zip(bounds, sizes, strict=True):
            node_of_slot = node_of_expert[ids_TK[lo:hi]]
            destination, row = routing.hits(node_of_slot, nodes, lambda n=size: self._to_nodes(n))
            token = row + lo
            local_id = ids_TK[token] - node_first[destination][:, None]
            slots = torch.where(node_of_slot[row] == destination[:, None], local_id, NO_EXPERT)
            plans.append((token, slots.to(torch.int32), destination))
        # One exchange of every chunk's counts: [destination node, chunk].
        sent = torch.stack([routing.counts(d, nodes) for _, _, d in plans], dim=1)
        received = exchange_counts(
            sent.reshape(-1), [chunks] * nodes, [chunks] * nodes, self.nodes.rail_group, self.keeper
        )
        sent = routing.read(
            sent, lambda: [list(c) for c in zip(*map(self._to_nodes, sizes), strict=True)]
        )
        received = routing.read(received.view(nodes, chunks), lambda: self._from_nodes(sizes))
        to_experts, from_experts = self.codecs()
        routed = TwoLevelRouted(self, x_TD)
        for c, (token, slots, _) in enumerate(plans):
            send_splits = [row[c] for row in sent]
            recv_splits = [row[c] for row in received]
            parts = [
                Part(x_TD[token], to_experts, from_experts),
                Part(scores_TK[token].float(), AS_IS, AS_IS),
                Part(slots, AS_IS, NO_GRADIENT),
            ]
            flight = launch(parts, send_splits, recv_splits, self.nodes.rail_group, self.keeper)
            routed.chunk_states.append(_Chunk(token, send_splits, recv_splits, flight))
        return routed


@dataclass
class _Chunk:
    """One chunk's bookkeeping, filled as it moves."""

    tokens: torch.Tensor  # stage-1 rows sent -> token index
    send_splits: list[int]  # stage 1, per node
    recv_splits: list[int]
    flight: Flight
    forwarded: torch.Tensor | None = None  # stage-2 rows sent -> stage-1 row received
    received_rows: int = 0  # stage-1 rows received
    send_splits_in_node: list[int] = field(default_factory=list)  # stage 2, per local rank
    recv_splits_in_node: list[int] = field(default_factory=list)
    expert_rows: int = 0  # stage-2 rows received
    pair_row: torch.Tensor | None = None  # expert-sorted pair -> stage-2 row
    pair_score: torch.Tensor | None = None
    back: Flight | None = None


@dataclass
class TwoLevelRouted:
    dispatcher: TwoLevelDispatcher
    x_TD: torch.Tensor
    chunk_states: list[_Chunk] = field(default_factory=list)

    @property
    def chunks(self) -> int:
        return len(self.chunk_states)

    def arrive(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        d, state = self.dispatcher, self.chunk_states[chunk]
        device, local, top_k = self.x_TD.device, d.nodes.local, d.top_k
        rows, scores, slots = wait(state.flight)
        state.received_rows = rows.shape[0]
        # Stage 2: each row to the node's ranks owning its experts.
        routing, arrived = d.routing, state.received_rows
        owner_of_slot = d.local_owner.to(device)[slots.long()]  # NO_EXPERT -> local (none)
        destination, forwarded = routing.hits(owner_of_slot, local, lambda: d._to_ranks(arrived))
        renumbered = slots[forwarded].long() - d.local_first.to(device)[destination][:, None]
        mine = owner_of_slot[forwarded] == destination[:, None]
        slots2 = torch.where(mine, renumbered, NO_EXPERT).to(torch.int32)
        state.forwarded = forwarded
        sent = routing.counts(destination, local)
        state.send_splits_in_node = routing.read(sent, lambda: d._to_ranks(arrived))
        send_counts = torch.tensor(state.send_splits_in_node, device=device)
        ones = [1] * local
        received = exchange_counts(send_counts, ones, ones, d.nodes.node_group, d.keeper)
        expected = d._to_ranks(arrived)[d.position] if d.table is not None else 0
        state.recv_splits_in_node = routing.read(received, lambda: [expected] * local)
        to_experts, from_experts = d.codecs()
        parts = [
            Part(rows[forwarded], to_experts, from_experts),
            Part(scores[forwarded], AS_IS, AS_IS),
            Part(slots2, AS_IS, NO_GRADIENT),
        ]
        splits = (state.send_splits_in_node, state.recv_splits_in_node)
        rows2, scores2, slots2 = wait(launch(parts, *splits, d.nodes.node_group, d.keeper))
        state.expert_rows = rows2.shape[0]
        # The expert side: (row, slot) pairs, sorted by local expert, rows in order within one.
        flat = slots2.reshape(-1).long()
        taken = routing.pairs(flat, lambda: d._pairs_here(state.recv_splits_in_node))
        order = torch.argsort(flat[taken], stable=True)
        taken = taken[order]
        state.pair_row = taken // top_k
        state.pair_score = scores2.reshape(-1)[taken]
        counts = routing.counts(flat[taken], d.local_experts)
        return rows2[state.pair_row], counts

    def _wire(self, summed: torch.Tensor) -> torch.Tensor:
        """fp32 sums as they travel: in the compute dtype unless the wire casts them."""
        if self.dispatcher.wire.combine == "compute":
            return summed.to(self.x_TD.dtype)
        return summed

    def send_back(self, chunk: int, out: torch.Tensor) -> None:
        d, state = self.dispatcher, self.chunk_states[chunk]
        to_experts, from_experts = d.codecs()
        per_row = sum_rows(out, state.pair_row, state.expert_rows, weights=state.pair_score)
        part = Part(self._wire(per_row), from_experts, to_experts)
        splits = (state.recv_splits_in_node, state.send_splits_in_node)
        (returned,) = wait(launch([part], *splits, d.nodes.node_group, d.keeper))
        per_node = sum_rows(returned, state.forwarded, state.received_rows)
        part = Part(self._wire(per_node), from_experts, to_experts)
        splits = (state.recv_splits, state.send_splits)
        state.back = launch([part], *splits, d.nodes.rail_group, d.keeper)

    def finish(self) -> torch.Tensor:
        tokens, out = self.x_TD.shape[0], None
        for state in self.chunk_states:  # a token's rows all come back in its own chunk
            (returned,) = wait(state.back)
            summed = sum_rows(returned, state.tokens, tokens)
            out = summed if out is None else out + summed
        return out.to(self.x_TD.dtype)
