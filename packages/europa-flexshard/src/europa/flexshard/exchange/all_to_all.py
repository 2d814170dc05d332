"""One all-to-all of packed rows: with autograd, asynchronous when asked, and kept for a
recomputation when asked. Both expert dispatchers are built from it.

Design note. An exchange sends several row-aligned tensors at once (a token, its
routing slots, their scores): each is encoded by its codec into uint8 columns
(``europa.flexshard.exchange.codec``), the columns are concatenated, and one
``all_to_all_single`` moves the rows, ``send_splits[r]`` of them to rank ``r`` of
the group. The receiver cuts the columns apart and decodes each tensor to the
sender's dtype.

Autograd. ``launch`` issues the collective and returns a *flight*; ``wait`` waits
for it and returns the decoded tensors. Two autograd functions joined by an empty
token carry the graph: the backward of ``wait`` encodes the gradients of the
differentiable parts with their ``grad_codec`` and issues the reverse exchange
asynchronously; the backward of ``launch`` waits for it and decodes. So a chunked
caller's backward overlaps like its forward. Integer parts (routing slots) have no
gradient and are not sent back.

Kept exchanges. A ``Keeper`` (one per MoE layer) records, while its block's forward
runs, every buffer the layer received; those buffers are then saved for backward
(``europa.flexshard.exchange.kept``). When the same layer's forward runs again inside the
backward, that is the recomputation of activation checkpointing: each collective is
then answered from the kept buffers, in order, and nothing is sent. The backward's
own exchanges always travel.

The collectives are looked up on ``torch.distributed`` at each call, so a tool that
wraps them (europa-overlap's timeline, a byte counter) sees every one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from europa.flexshard.exchange.codec import Codec
from europa.flexshard.exchange.kept import Keeper
from europa.spec.lanes import lane_group
from europa.spec.tags import mark_memory


def _replaying(keeper: Keeper | None) -> bool:
    return keeper is not None and Keeper.in_recomputation()


def exchange_counts(
    send: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None,
    keeper: Keeper | None = None,
) -> torch.Tensor:
    """A synchronous all-to-all of int64 counts (no autograd)."""
    shape = (sum(recv_splits),)
    if _replaying(keeper):
        return keeper.answer(shape)
    recv = send.new_empty(shape)
    dist.all_to_all_single(
        recv, send, list(recv_splits), list(send_splits), group=lane_group(group)
    )
    if keeper is not None:
        keeper.record(recv)
    return recv


@dataclass(frozen=True)
class Part:
    """One row-aligned tensor of an exchange: how it travels, and how its gradient
    travels back (``None``: it has none)."""

    tensor: torch.Tensor
    codec: Codec = field(default_factory=Codec)
    grad_codec: Codec | None = field(default_factory=Codec)


@dataclass
class Flight:
    """One exchange in progress, and the reverse one its backward issues."""

    group: Any
    send_splits: list[int]
    recv_splits: list[int]
    codecs: list[Codec]
    grad_codecs: list[Codec | None]
    cols: list[int]
    dtypes: list[torch.dtype]
    keeper: Keeper | None
    work: Any = None
    sent: torch.Tensor | None = None  # alive until the exchange is done
    received: torch.Tensor | None = None
    grad_work: Any = None
    grad_buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # (sent, received)
    token: torch.Tensor | None = None
    device: torch.device | None = None

    def widths(self, codecs: Sequence[Codec | None]) -> list[int]:
        return [
            0 if c is None else c.row_bytes(cols, dtype)
            for c, cols, dtype in zip(codecs, self.cols, self.dtypes, strict=True)
        ]


def _pack(tensors: Sequence[torch.Tensor | None], codecs: Sequence[Codec | None], rows, device):
    pieces = [c.encode(t) for t, c in zip(tensors, codecs, strict=True) if c is not None]
    if not pieces:
        packed = torch.empty(rows, 0, dtype=torch.uint8, device=device)
    else:
        packed = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0].contiguous()
    mark_memory(packed, "expert_buffers")
    return packed


def _receiving(like: torch.Tensor, shape) -> torch.Tensor:
    buffer = like.new_empty(shape)
    mark_memory(buffer, "expert_buffers")
    return buffer


def _unpack(buffer: torch.Tensor, flight: Flight, codecs: Sequence[Codec | None]):
    out, start = [], 0
    for codec, width, cols, dtype in zip(
        codecs, flight.widths(codecs), flight.cols, flight.dtypes, strict=True
    ):
        if codec is None:
            out.append(None)
            continue
        out.append(codec.decode(buffer[:, start : start + width], cols, dtype))
        start += width
    return out


def _zeros_if_none(grad: torch.Tensor | None, rows: int, cols: int, dtype, device) -> torch.Tensor:
    """A gradient autograd left out (``None``) as the zeros it stands for."""
    if grad is not None:
        return grad
    return torch.zeros(rows, cols, dtype=dtype, device=device)


def _issue(recv: torch.Tensor, send: torch.Tensor, recv_splits, send_splits, group):
    return dist.all_to_all_single(
        recv, send, list(recv_splits), list(send_splits), group=lane_group(group), async_op=True
    )


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: Flight, *tensors: torch.Tensor) -> torch.Tensor:
        device = tensors[0].device
        rows = sum(flight.send_splits)
        shape = (sum(flight.recv_splits), sum(flight.widths(flight.codecs)))
        if _replaying(flight.keeper):
            flight.received = flight.keeper.answer(shape)
        else:
            flight.sent = _pack(tensors, flight.codecs, rows, device)
            flight.received = _receiving(flight.sent, shape)
            flight.work = _issue(
                flight.received, flight.sent, flight.recv_splits, flight.send_splits, flight.group
            )
            if flight.keeper is not None:  # in launch order, the order a replay asks in
                flight.keeper.record(flight.received)
        ctx.flight = flight
        return torch.empty(0, device=device)

    @staticmethod
    def backward(ctx, _token: torch.Tensor):
        flight = ctx.flight
        flight.grad_work.wait()
        _, received = flight.grad_buffers
        flight.grad_work = flight.grad_buffers = None
        grads = _unpack(received, flight, flight.grad_codecs)
        return (None, *grads)


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: Flight, token: torch.Tensor):
        if flight.work is not None:
            flight.work.wait()
        received, flight.work, flight.sent, flight.received = flight.received, None, None, None
        outs = _unpack(received, flight, flight.codecs)
        no_gradient = zip(outs, flight.grad_codecs, strict=True)
        ctx.mark_non_differentiable(*(out for out, codec in no_gradient if codec is None))
        ctx.flight = flight
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        flight = ctx.flight
        rows, device = sum(flight.recv_splits), flight.device
        tensors = [
            _zeros_if_none(grad, rows, cols, dtype, device) if codec is not None else None
            for grad, codec, cols, dtype in zip(
                grads, flight.grad_codecs, flight.cols, flight.dtypes, strict=True
            )
        ]
        sent = _pack(tensors, flight.grad_codecs, rows, device)
        received = _receiving(sent, (sum(flight.send_splits), sent.shape[1]))
        flight.grad_work = _issue(
            received, sent, flight.send_splits, flight.recv_splits, flight.group
        )
        flight.grad_buffers = (sent, received)
        return None, torch.empty(0, device=device)


def launch(
    parts: Sequence[Part],
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None,
    keeper: Keeper | None = None,
) -> Flight:
    """Issue the exchange of ``parts`` (rows grouped by destination) asynchronously."""
    tensors = [p.tensor for p in parts]
    flight = Flight(
        group=group,
        send_splits=list(send_splits),
        recv_splits=list(recv_splits),
        codecs=[p.codec for p in parts],
        grad_codecs=[p.grad_codec for p in parts],
        cols=[t.shape[1] for t in tensors],
        dtypes=[t.dtype for t in tensors],
        keeper=keeper,
        device=tensors[0].device,
    )
    flight.token = _Launch.apply(flight, *tensors)
    return flight


def wait(flight: Flight) -> list[torch.Tensor]:
    """The received parts (rows grouped by source), once the exchange is done."""
    token, flight.token = flight.token, None
    return list(_Wait.apply(flight, token))
