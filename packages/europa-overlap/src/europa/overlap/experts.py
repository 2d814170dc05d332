"""Expert all-to-all beside computation: async dispatch, shared expert in flight, chunks.

Design note. An expert-parallel MoE layer sends each (token, expert) pair to
the rank owning the expert, runs the experts there, and sends the outputs back
(europa-flexshard's ``AllToAllDispatcher``: one all-to-all each way, waited
for at once). Here, for a routed-expert module whose dispatcher exposes its
``group``, ``rank``, ``ranges`` (the contiguous run of experts each rank owns)
and ``top_k``:

1. the per-expert counts are exchanged first (small, synchronous: every
   buffer is then sized exactly);
2. every rank's local experts are split into ``chunks`` contiguous groups,
   and chunk c's all-to-all carries, for each destination, only the pairs of
   that destination's chunk-c experts; all chunks' dispatches are issued at
   once, asynchronously;
3. the shared expert runs while they are in flight (its module is called from
   here and the result handed back when the MoE layer asks for it);
4. chunk by chunk: wait for its tokens, run its experts, issue its combine
   asynchronously, so one chunk's combine travels while the next computes;
5. when every combine is in, the pairs are put back in their unchunked order
   and summed into tokens with one weighted ``index_add``.

Numerics are bit-identical to the unchunked layer: an expert's grouped GEMM
sees exactly the same rows in the same order (its chunk holds all of them;
the other experts of the module get zero rows in that call), the weighting
and ``index_add`` run once, in the unchunked order, and the rest is copies.
The backward mirrors the forward: the gradient of a wait issues the reverse
all-to-all asynchronously and the gradient of the launch waits for it, so the
backward of one chunk's experts overlaps the other chunks' exchanges.

The collectives are ``torch.distributed.all_to_all_single(..., async_op=True)``
(looked up at call time, so a ``Timeline`` sees them). Functional collectives
were not used: on gloo their lazily waited tensors gain nothing over this, and
their backward waits at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def chunk_bounds(experts: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous groups of ``experts`` local experts (possibly empty)."""
    return [(experts * c // chunks, experts * (c + 1) // chunks) for c in range(chunks)]


@dataclass
class ChunkPlan:
    """Index bookkeeping for one layer call, from the exchanged counts.

    ``per_expert[e]``: pairs this rank sends to global expert e;
    ``by_source[s][j]``: pairs rank s sends to this rank's local expert j."""

    send_order: torch.Tensor  # expert-sorted pairs -> chunk-major send order
    back_order: torch.Tensor  # chunk-major order -> expert-sorted pairs
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
    send_order = torch.cat(send_pieces) if send_pieces else torch.zeros(0, dtype=torch.int64)
    mine = ranges[rank][1] - ranges[rank][0]
    recv_splits, regroup, local_counts = [], [], []
    for lo, hi in chunk_bounds(mine, chunks):
        rows = [list(row[lo:hi]) for row in by_source]
        recv_splits.append([sum(r) for r in rows])
        regroup.append(_by_local_expert(rows).to(device))
        counts = torch.zeros(mine, dtype=torch.int64)
        counts[lo:hi] = torch.tensor([sum(r[j] for r in rows) for j in range(hi - lo)],
                                     dtype=torch.int64)  # fmt: skip
        local_counts.append(counts.to(device))
    return ChunkPlan(
        send_order=send_order.to(device),
        back_order=torch.argsort(send_order).to(device),
        send_rows=send_rows,
        send_splits=send_splits,
        recv_splits=recv_splits,
        regroup=regroup,
        local_counts=local_counts,
    )


def _by_local_expert(counts: list[list[int]]) -> torch.Tensor:
    """Received rows (source by source, each sorted by expert) -> by expert, sources in order."""
    starts, offset = [], 0
    for row in counts:
        starts.append([])
        for count in row:
            starts[-1].append(offset)
            offset += count
    experts = len(counts[0]) if counts else 0
    pieces = [
        torch.arange(starts[s][e], starts[s][e] + counts[s][e])
        for e in range(experts)
        for s in range(len(counts))
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


# -- asynchronous all-to-all with autograd ------------------------------------------------


@dataclass
class _InFlight:
    """One all-to-all: its buffers stay referenced until the exchange is done."""

    group: Any
    out_splits: list[int]
    in_splits: list[int]
    work: Any = None
    keep: list[torch.Tensor] = field(default_factory=list)  # what the exchange reads
    out: torch.Tensor | None = None  # what it writes (valid once waited for)
    grad: torch.Tensor | None = None


def _all_to_all(out, inp, out_splits, in_splits, group):
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


class _Launch(torch.autograd.Function):
    """Issue the exchange; the output is valid only after ``_Wait``."""

    @staticmethod
    def forward(ctx, flight: _InFlight, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(sum(flight.out_splits), *x.shape[1:])
        flight.keep = [x]
        flight.work = _all_to_all(out, x, flight.out_splits, flight.in_splits, flight.group)
        ctx.flight = flight
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flight = ctx.flight
        flight.work.wait()  # the reverse exchange ``_Wait.backward`` issued
        grad_in, flight.grad = flight.grad, None
        flight.work, flight.keep = None, []
        return None, grad_in


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: _InFlight, out: torch.Tensor) -> torch.Tensor:
        flight.work.wait()
        flight.work, flight.keep = None, []
        ctx.flight = flight
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flight = ctx.flight
        grad = grad.contiguous()
        flight.grad = grad.new_empty(sum(flight.in_splits), *grad.shape[1:])
        flight.keep = [grad]
        flight.work = _all_to_all(flight.grad, grad, flight.in_splits, flight.out_splits,
                                  flight.group)  # fmt: skip
        return None, grad  # passed to _Launch.backward, which waits and returns flight.grad


def launch(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> _InFlight:
    flight = _InFlight(group, list(out_splits), list(in_splits))
    flight.out = _Launch.apply(flight, x)
    return flight


def wait(flight: _InFlight) -> torch.Tensor:
    out, flight.out = flight.out, None
    return _Wait.apply(flight, out)


# -- the overlapped routed-expert forward -------------------------------------------------


class EarlySharedExpert:
    """Replaces a shared expert's ``forward``: ``compute(x)`` runs the module now
    (its hooks included); the MoE layer's own call later gets that result."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.original = module.forward
        self._ready: tuple[torch.Tensor, torch.Tensor] | None = None
        self._computing = False

    def compute(self, x: torch.Tensor) -> None:
        self._computing = True
        try:
            self._ready = (x, self.module(x))
        finally:
            self._computing = False

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._computing or args or kwargs:
            return self.original(x, *args, **kwargs)
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] is x:
            return ready[1]
        return self.original(x)


class OverlappedRoutedExperts:
    """Replaces a routed-expert module's ``forward`` (torchtitan's signature)."""

    def __init__(
        self, module: nn.Module, chunks: int, shared: EarlySharedExpert | None = None
    ) -> None:
        dispatcher = module.token_dispatcher
        self.module = module
        self.experts = module.inner_experts
        self.group = dispatcher.group
        self.rank = dispatcher.rank
        self.ranges = list(dispatcher.ranges)
        self.top_k = dispatcher.top_k
        self.chunks = chunks
        self.shared = shared
        self.original = module.forward

    def __call__(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_tokens_per_expert_E):
        B, L, D = x_BLD.shape
        x_TD = x_BLD.view(B * L, D)
        order = torch.argsort(topk_expert_ids_BLK.reshape(-1), stable=True)
        scores = topk_scores_BLK.reshape(-1)[order]
        token_indices = order // self.top_k
        pairs = x_TD[token_indices]  # expert-sorted, as the unchunked dispatcher has them

        counts = num_tokens_per_expert_E.to(torch.int64)
        mine = self.ranges[self.rank][1] - self.ranges[self.rank][0]
        received = counts.new_empty(len(self.ranges) * mine)
        dist.all_to_all_single(received, counts, [mine] * len(self.ranges),
                               [b - a for a, b in self.ranges], group=self.group)  # fmt: skip
        by_source = received.view(len(self.ranges), mine).tolist()
        plan = plan_chunks(counts.tolist(), by_source, self.ranges, self.rank, self.chunks,
                           x_TD.device)  # fmt: skip

        send = pairs[plan.send_order].split(plan.send_rows)
        dispatched = [
            launch(piece, plan.recv_splits[c], plan.send_splits[c], self.group)
            for c, piece in enumerate(send)
        ]
        if self.shared is not None:
            self.shared.compute(x_BLD)  # while the tokens travel
        combined = []
        for c, flight in enumerate(dispatched):
            arrived = wait(flight)
            out = self.experts(arrived[plan.regroup[c]], plan.local_counts[c])
            by_source = out[torch.argsort(plan.regroup[c])]
            combined.append(launch(by_source, plan.send_splits[c], plan.recv_splits[c],
                                   self.group))  # fmt: skip
        back = torch.cat([wait(flight) for flight in combined])[plan.back_order]
        weighted = (back.float() * scores.reshape(-1, 1)).to(back.dtype)
        out_TD = torch.zeros_like(x_TD).index_add(0, token_indices, weighted)
        return out_TD.view(B, -1, D)


def overlappable(module: nn.Module) -> bool:
    """A routed-expert module whose dispatcher says where experts live (europa-flexshard's)."""
    dispatcher = getattr(module, "token_dispatcher", None)
    return isinstance(getattr(module, "inner_experts", None), nn.Module) and all(
        hasattr(dispatcher, a) for a in ("group", "rank", "ranges", "top_k")
    )


def overlap_expert_all_to_all(model: nn.Module, chunks: int = 2) -> list[str]:
    """Overlap the expert all-to-all of every MoE layer of ``model`` (a module with
    ``routed_experts`` and, optionally, ``shared_experts``) whose routed experts are
    expert-parallel; returns the layers' names."""
    done = []
    for name, layer in model.named_modules():
        routed = getattr(layer, "routed_experts", None)
        if routed is None or not overlappable(routed):
            continue
        shared_module = getattr(layer, "shared_experts", None)
        shared = None
        if isinstance(shared_module, nn.Module):
            shared = EarlySharedExpert(shared_module)
            shared_module.forward = shared
        routed.forward = OverlappedRoutedExperts(routed, chunks, shared)
        done.append(name)
    return done
