"""A unit's all-gather and reduce-scatter as direct transfers between ranks, for gloo.

Design note. Gloo's own collectives copy what a layout's rows already hold: its
all-gather receives into a fresh flat buffer and then copies every row out of it, and
it has no reduce-scatter (torch clones the input and all-reduces the clone; an
all-reduce of the rows in place still moves every row to every rank). On CPU those
copies and bytes are work for the same cores that compute. Here each row travels once,
straight into place:

* gather: rank r's pieces (its owned matrices of each parameter, sent straight from
  its local parameters: nothing packed) go to every other rank, which receives them
  into their places in its ``rows[r]``; rank r's own row is never filled, since its
  full parameters take its pieces from the local parameters themselves;
* reduce-scatter: rank r sends each of its contributions to rank j's share straight
  from the full gradients (``reduce_scatter_pieces``: one piece per parameter rank j
  owns matrices of, a view, never packed into rows) and receives every other rank's
  contributions to its own pieces into buffers of its own; each piece's sum is taken
  in rank order (p0 + p1 + ...), so it is the same bits whichever rank computes it, and
  it is left in a received buffer, which becomes the gradient (no row, no copy out).

Per rank and unit that is the bytes of the ring algorithms (n - 1 rows out, n - 1 in)
with no copy besides the sum. Every rank issues its transfers in the same order, send
before receive, each kind on its own tag, and pieces in parameter order; gloo matches a
(peer, tag) pair's messages in the order they were posted, so exchanges in flight
together stay paired.

``isend``/``irecv`` are looked up on ``torch.distributed`` at each call and the buffers
are tagged with the traffic they stand for (``europa.spec.tags.mark_traffic``), so
europa-overlap's timeline files them as the gather or reduce-scatter they replace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from europa.spec.lanes import lane_group
from europa.spec.tags import mark_memory, mark_traffic

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


def _buffer_like(piece: torch.Tensor) -> torch.Tensor:
    buffer = torch.empty_like(piece)
    mark_memory(buffer, "gradient_buffers")
    return buffer


def _send(tensor: torch.Tensor, peer: int, group, kind: str):
    mark_traffic(tensor, kind)
    return dist.isend(tensor, group=lane_group(group), group_dst=peer, tag=_TAGS[kind])


def _recv(tensor: torch.Tensor, peer: int, group, kind: str):
    mark_traffic(tensor, kind)
    return dist.irecv(tensor, group=lane_group(group), group_src=peer, tag=_TAGS[kind])


def gather_pieces(
    own: Sequence[torch.Tensor],
    rows: torch.Tensor,
    spans: Sequence[Sequence[slice]],
    rank: int,
    group,
    async_op: bool = False,
) -> DirectWork | None:
    """Send this rank's pieces ``own`` (contiguous, in slot order) to every other rank,
    and receive every other rank's into its row of ``rows`` (``[ranks, width]``): peer's
    i-th piece lands in ``rows[peer, spans[peer][i]]``. This rank's row is left as it is."""
    ranks = rows.size(0)
    peers = [peer for peer in range(ranks) if peer != rank]
    works = [_send(piece.reshape(-1), peer, group, GATHER) for peer in peers for piece in own]
    works += [
        _recv(rows[peer, span], peer, group, GATHER) for peer in peers for span in spans[peer]
    ]
    work = DirectWork(works)
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter_pieces(
    own: Sequence[torch.Tensor],
    outgoing: Sequence[Sequence[torch.Tensor]],
    rank: int,
    group,
    async_op: bool = False,
) -> tuple[list[torch.Tensor], DirectWork | None]:
    """Every rank's pieces summed over the ranks. ``own[i]``: this rank's contribution to
    its own i-th piece; ``outgoing[j]``: its contributions to rank j's pieces, in rank j's
    order (empty for this rank). Returns the sums, new tensors (the list is filled when
    the work is done; at once without ``async_op``), and the work."""
    ranks = len(outgoing)
    peers = [peer for peer in range(ranks) if peer != rank]
    works = [_send(part, peer, group, REDUCE_SCATTER) for peer in peers for part in outgoing[peer]]
    received = {peer: [_buffer_like(piece) for piece in own] for peer in peers}
    works += [_recv(buf, peer, group, REDUCE_SCATTER) for peer in peers for buf in received[peer]]
    sums: list[torch.Tensor] = []

    def rank_order_sums() -> None:
        for i, mine in enumerate(own):
            parts = [mine if source == rank else received[source][i] for source in range(ranks)]
            # The first two are added into whichever is a received buffer (a + b == b + a).
            total, other = (parts[1], parts[0]) if parts[0] is mine else (parts[0], parts[1])
            total.add_(other)
            for part in parts[2:]:
                total.add_(part)
            sums.append(total)

    work = DirectWork(works, rank_order_sums)
    if async_op:
        return sums, work
    work.wait()
    return sums, None
