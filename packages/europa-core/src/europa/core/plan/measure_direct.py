"""Direct transfers at the step's cadence: the ``point_to_point`` rate a training step gets.

Design note. europa-flexshard on gloo sends each block's pieces straight to the other
ranks (``europa.flexshard.direct``) and waits for them between blocks: a gather before
the block's forward, and a gather and a reduce-scatter before its backward. Timed alone,
with every rank at a barrier, such a transfer runs at the loopback copy rate. Inside a
step it runs slower: every rank must first reach the same block, and on a CPU machine
the ranks share the cores, so one rank's compute delays another's transfer (measured on
2 cores and 4 ranks: about twice as long). A profile rated from the lone transfer
planned FlexShard's steps 1.3-1.6x too fast.

So the rate is taken where training takes it: the model's own forward and backward on
one micro-batch, once as it is and once with a block-sized direct exchange at each of
those three points of every block. The bytes the exchanges sent over the time they added
is the rate; the lone transfer's rate stays in the printed figures beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def direct_exchanges(
    nbytes: int, group, device
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], int]:
    """(a gather, a reduce-scatter, the bytes each sends) of an ``nbytes`` tensor over
    ``group`` as direct transfers, each doing what FlexShard's does besides the bytes:
    the gather receives every other rank's piece into a new buffer; the reduce-scatter
    sends every other rank its piece, receives its own piece's contributions into new
    buffers and sums them."""
    n = dist.get_world_size(group)
    elements = max(n, nbytes // 4 // n * n)
    piece = elements // n
    rank = dist.get_rank(group)
    mine = torch.full((piece,), rank + 1.0, device=device)
    outgoing = torch.full((n, piece), rank + 1.0, device=device)
    peers = [peer for peer in range(n) if peer != rank]

    def wait(works) -> None:
        for work in works:
            work.wait()

    def gather() -> torch.Tensor:
        rows = torch.empty(n, piece, device=device)
        works = [dist.isend(mine, group=group, group_dst=p) for p in peers]
        wait(works + [dist.irecv(rows[p], group=group, group_src=p) for p in peers])
        return rows

    def reduce_scatter() -> torch.Tensor:
        received = [torch.empty(piece, device=device) for _ in peers]
        works = [dist.isend(outgoing[p], group=group, group_dst=p) for p in peers]
        wait(
            works
            + [
                dist.irecv(b, group=group, group_src=p)
                for p, b in zip(peers, received, strict=True)
            ]
        )
        total = mine.clone()
        for buffer in received:
            total.add_(buffer)
        return total

    return gather, reduce_scatter, piece * 4 * (n - 1)


def exchanges_in_step(
    blocks: list[nn.Module], gather: Callable[[], None], reduce_scatter: Callable[[], None]
) -> Callable[[], None]:
    """Hook the exchanges where FlexShard waits on a block's transfers: a gather before
    its forward, a gather and a reduce-scatter before its backward. Returns what removes
    the hooks."""

    def before_forward(module, args):
        gather()

    def before_backward(module, grad_output):
        gather()
        reduce_scatter()

    handles = []
    for block in blocks:
        handles.append(block.register_forward_pre_hook(before_forward))
        handles.append(block.register_full_backward_pre_hook(before_backward))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


EXCHANGES_PER_BLOCK = 3


def direct_rate_in_step(
    step: Callable[[], None],
    blocks: list[nn.Module],
    nbytes: int,
    group,
    device,
    timed: Callable[..., float],
) -> dict[str, float]:
    """Bytes/s one rank sends in direct transfers of ``nbytes`` blocks, issued inside
    ``step`` (the model's forward and backward) at each block's three waiting points;
    with the step's seconds alone and with the exchanges."""
    gather, reduce_scatter, sent = direct_exchanges(nbytes, group, device)
    dist.barrier(group=group)
    alone = timed(step, group)
    remove = exchanges_in_step(blocks, gather, reduce_scatter)
    try:
        dist.barrier(group=group)
        with_exchanges = timed(step, group)
    finally:
        remove()
    added = with_exchanges - alone
    total = EXCHANGES_PER_BLOCK * len(blocks) * sent
    # An added time at or under zero is noise larger than the exchanges: no slower than alone.
    rate = total / added if added > 0 else float("inf")
    return {"step_s": alone, "step_with_exchanges_s": with_exchanges, "bytes_per_s": rate}
