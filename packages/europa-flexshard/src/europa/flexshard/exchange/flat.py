"""The flat expert exchange: one row per (token, expert) pair, straight to the expert's owner.

Design note. ``begin`` sorts this rank's (token, expert) pairs by expert; since each
rank owns a contiguous run of experts, that order is also by destination rank. The
per-expert counts go first (an all-to-all of integers), so every buffer is sized
exactly; then the rows. The received rows, grouped by source, are regrouped by local
expert for the grouped GEMM. The return undoes both steps, and ``finish`` weights
each pair by its routing score and sums a token's pairs, as torchtitan's local
dispatcher does. An expert that receives nothing simply computes nothing.

Chunks: every rank's local experts are split into ``chunks`` contiguous groups;
chunk c carries, for each destination, only the pairs of that destination's chunk-c
experts. An expert's grouped GEMM then sees exactly the rows it sees unchunked (its
chunk holds all of them), and the weighting and sum run once, in the unchunked
order, so chunked results are bit-identical to unchunked ones.

Shape suffixes (``x_TD``, ``ids_TK``, ...): the notation in ``europa.flexshard.exchange``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from europa.flexshard.exchange.all_to_all import Flight, Part, exchange_counts, launch, wait
from europa.flexshard.exchange.dispatcher import ExpertDispatcher, by_local_expert
from europa.flexshard.exchange.summing import sum_rows


def chunk_bounds(experts: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous groups of ``experts`` local experts (possibly empty)."""
    return [(experts * c // chunks, experts * (c + 1) // chunks) for c in range(chunks)]


@dataclass
class ChunkPlan:
    """Index bookkeeping for one layer call, from the exchanged counts.

    ``per_expert[e]``: pairs this rank sends to global expert e;
    ``by_source[s][j]``: pairs rank s sends to this rank's local expert j."""

    send_order: torch.Tensor | None  # expert-sorted pairs -> chunk-major order (None: same)
    back_order: torch.Tensor | None
    send_rows: list[int]  # rows of each chunk's send buffer
    send_splits: list[list[int]]  # [chunk][destination]
    recv_splits: list[list[int]]  # [chunk][source]
    regroup: list[torch.Tensor]  # [chunk]: received (by source) -> by local expert
    local_counts: list[torch.Tensor]  # [chunk]: rows per local expert (0 outside the chunk)


def plan_chunks(
    per_expert: Sequence[int],
    by_source: Sequence[Sequence[int]],
    ranges: Sequence[tuple[int, int]],
    rank: int,
    chunks: int,
    device: torch.device,
) -> ChunkPlan:
    starts, offset = [], 0
    for count in per_expert:
        starts.append(offset)
        offset += count
    send_pieces, send_rows, send_splits = [], [], []
    for c in range(chunks):
        splits = []
        for first, stop in ranges:
            lo, hi = chunk_bounds(stop - first, chunks)[c]
            begin = starts[first + lo] if first + lo < len(starts) else offset
            end = starts[first + hi] if first + hi < len(starts) else offset
            send_pieces.append(torch.arange(begin, end))
            splits.append(end - begin)
        send_splits.append(splits)
        send_rows.append(sum(splits))
    send_order = back_order = None
    if chunks > 1:
        order = torch.cat(send_pieces) if send_pieces else torch.zeros(0, dtype=torch.int64)
        send_order, back_order = order.to(device), torch.argsort(order).to(device)
    mine = ranges[rank][1] - ranges[rank][0]
    recv_splits, regroup, local_counts = [], [], []
    for lo, hi in chunk_bounds(mine, chunks):
        rows = [list(row[lo:hi]) for row in by_source]
        recv_splits.append([sum(r) for r in rows])
        regroup.append(by_local_expert(rows, device))
        counts = torch.zeros(mine, dtype=torch.int64)
        counts[lo:hi] = torch.tensor(
            [sum(r[j] for r in rows) for j in range(hi - lo)], dtype=torch.int64
        )
        local_counts.append(counts.to(device))
    return ChunkPlan(
        send_order, back_order, send_rows, send_splits, recv_splits, regroup, local_counts
    )


class FlatDispatcher(ExpertDispatcher):
    """One row per (token, expert) pair (see the design note)."""

    def begin(self, x_TD, scores_TK, ids_TK, chunks: int = 1) -> FlatRouted:
        ids = ids_TK.reshape(-1)
        order = torch.argsort(ids, stable=True)
        pairs = x_TD[order // self.top_k]
        counts = self.routing.counts(ids, self.num_experts)
        mine, ranks = self.local_experts, len(self.ranges)
        received = exchange_counts(
            counts, self.experts_per_rank, [mine] * ranks, self.group, self.keeper
        )
        # Split sizes are host integers: read each count tensor once (one sync on a GPU).
        pairs_sent = ids.numel()
        per_expert = self.routing.read(counts, lambda: self._to_experts(self.rank, pairs_sent))
        by_source = self.routing.read(received.view(ranks, mine), lambda: self._from(pairs_sent))
        plan = plan_chunks(per_expert, by_source, self.ranges, self.rank, chunks, x_TD.device)
        to_experts, from_experts = self.codecs()
        send = pairs if plan.send_order is None else pairs[plan.send_order]
        flights = [
            launch(
                [Part(piece, to_experts, from_experts)],
                plan.send_splits[c],
                plan.recv_splits[c],
                self.group,
                self.keeper,
            )
            for c, piece in enumerate(send.split(plan.send_rows))
        ]
        return FlatRouted(self, plan, order, scores_TK.reshape(-1)[order], x_TD, flights)

    # -- what a routing model expects (an execution on fake tensors) ------------------------
    # Every source sends as many pairs as this one.

    def _to_experts(self, source: int, pairs: int) -> list[int]:
        """The pairs ``source`` sends to each expert, of ``pairs`` in all."""
        return list(self.table.flat_pairs(source, pairs))

    def _from(self, pairs: int) -> list[list[int]]:
        """The pairs each source sends to each of this rank's experts."""
        first, stop = self.ranges[self.rank]
        return [self._to_experts(s, pairs)[first:stop] for s in range(len(self.ranges))]


@dataclass
class FlatRouted:
    dispatcher: FlatDispatcher
    plan: ChunkPlan
    order: torch.Tensor  # expert-sorted pair -> flat (token, slot) index
    scores: torch.Tensor  # expert-sorted pairs' scores
    x_TD: torch.Tensor
    flights: list[Flight]
    backs: list[Flight] = field(default_factory=list)

    @property
    def chunks(self) -> int:
        return len(self.flights)

    def arrive(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        (rows,) = wait(self.flights[chunk])
        return rows[self.plan.regroup[chunk]], self.plan.local_counts[chunk]

    def send_back(self, chunk: int, out: torch.Tensor) -> None:
        d, plan = self.dispatcher, self.plan
        to_experts, from_experts = d.codecs()
        by_source = out[torch.argsort(plan.regroup[chunk])]
        part = Part(by_source, from_experts, to_experts)
        self.backs.append(
            launch([part], plan.recv_splits[chunk], plan.send_splits[chunk], d.group, d.keeper)
        )

    def finish(self) -> torch.Tensor:
        back = torch.cat([wait(flight)[0] for flight in self.backs])
        if self.plan.back_order is not None:
            back = back[self.plan.back_order]
        token_indices = self.order // self.dispatcher.top_k
        x = self.x_TD
        return sum_rows(back, token_indices, x.shape[0], weights=self.scores, dtype=x.dtype)
