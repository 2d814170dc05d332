"""A unit's all-gather and reduce-scatter as direct transfers between ranks, for gloo.

Design note. Gloo's own collectives copy what a layout's rows already hold: its
all-gather receives into a fresh flat buffer and then copies every row out of it, and
it has no reduce-scatter (torch clones the input and all-reduces the clone; an
all-reduce of the rows in place still moves every row to every rank). On CPU those
copies and bytes are work for the same cores that compute. Here each row travels once,
straight into place:

* gather: rank r's row ``rows[r]`` (already packed by the caller) goes to every other
  rank, which receives it into its own ``rows[r]``;
* reduce-scatter: rank r sends ``rows[j]`` (its contribution to rank j's share) to each
  rank j and receives every other rank's contribution to ``rows[r]`` into a buffer of
  its own; the sum is taken in rank order (p0 + p1 + ...), so it is the same bits
  whichever rank computes it.

Per rank and unit that is the bytes of the ring algorithms (n - 1 rows out, n - 1 in)
with no copy besides the sum. Every rank issues its transfers in the same order, send
before receive, each kind on its own tag; gloo matches a (peer, tag) pair's messages in
the order they were posted, so exchanges in flight together stay paired.

``isend``/``irecv`` are looked up on ``torch.distributed`` at each call and the buffers
are tagged with the traffic they stand for (``europa.spec.tags.mark_traffic``), so
europa-overlap's timeline files them as the gather or reduce-scatter they replace.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from europa.spec.tags import mark_traffic

GATHER, REDUCE_SCATTER = "parameter_gather", "gradient_reduce_scatter"
_TAGS = {GATHER: 1, REDUCE_SCATTER: 2}


def runs_direct(group) -> bool:
    """Gloo: its all-gather and reduce-scatter copy more than the rows need."""
    return dist.get_backend(group) == dist.Backend.GLOO


class DirectWork:
    """The transfers of one exchange; ``wait`` waits for them all, then runs ``finish``."""

    def __init__(self, works: list, finish: Callable[[], None] | None = None) -> None:
        self.works, self.finish = works, finish

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True


def _send(tensor: torch.Tensor, peer: int, group, kind: str):
    mark_traffic(tensor, kind)
    return dist.isend(tensor, group=group, group_dst=peer, tag=_TAGS[kind])


def _recv(tensor: torch.Tensor, peer: int, group, kind: str):
    mark_traffic(tensor, kind)
    return dist.irecv(tensor, group=group, group_src=peer, tag=_TAGS[kind])


def gather_rows(rows: torch.Tensor, rank: int, group, async_op: bool = False) -> DirectWork | None:
    """Fill every other rank's row of ``rows`` (``[ranks, width]``, this rank's row
    packed) with that rank's row."""
    ranks = rows.size(0)
    works = [_send(rows[rank], peer, group, GATHER) for peer in range(ranks) if peer != rank]
    works += [_recv(rows[peer], peer, group, GATHER) for peer in range(ranks) if peer != rank]
    work = DirectWork(works)
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter_rows(
    rows: torch.Tensor, rank: int, group, async_op: bool = False
) -> DirectWork | None:
    """Sum every rank's ``rows[rank]`` into this rank's ``rows[rank]`` (``rows`` is
    ``[ranks, width]``: row j this rank's contribution to rank j's share)."""
    ranks = rows.size(0)
    peers = [peer for peer in range(ranks) if peer != rank]
    received = rows.new_empty(len(peers), rows.size(1))
    works = [_send(rows[peer], peer, group, REDUCE_SCATTER) for peer in peers]
    works += [_recv(received[i], peer, group, REDUCE_SCATTER) for i, peer in enumerate(peers)]

    def rank_order_sum() -> None:
        lower = [received[i] for i, peer in enumerate(peers) if peer < rank]
        higher = [received[i] for i, peer in enumerate(peers) if peer > rank]
        if lower:  # (p0 + p1 + ... + p[rank-1]) + p[rank], added as a + b == b + a
            for part in lower[1:]:
                lower[0].add_(part)
            rows[rank].add_(lower[0])
        for part in higher:
            rows[rank].add_(part)

    work = DirectWork(works, rank_order_sum)
    if async_op:
        return work
    work.wait()
    return None
