"""Kept expert exchanges: a recomputed block sends and receives nothing.

Design note. With activation checkpointing the backward reruns each block's
forward, and with it every expert exchange of the block: the all-to-alls cross the
network twice. ``keep_exchanges(block, keepers)`` prevents that with two hooks on
the block module (outside ``block.forward``, so outside the checkpointed region):

* forward pre-hook: each MoE layer's ``Keeper`` starts recording the buffers its
  exchanges receive (``europa.flexshard.exchange.all_to_all``);
* forward hook: the recorded buffers become the saved tensors of an identity
  autograd function on the block's output. They are saved like any other tensor,
  under whatever saved-tensor hooks surround the block's call: europa-offload moves
  them to host memory and brings them back, with no special API.

In backward the identity's gradient comes first (it is the block's last node), and
hands the buffers back to the keepers; the recomputation that follows, run inside
the backward, asks each keeper instead of the network, in the order the forward
sent. The forward of a block under ``no_grad`` (evaluation) records nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from torch import nn

from europa.spec.autograd import in_backward


class Keeper:
    """The received buffers of one layer's exchanges, for its recomputation."""

    def __init__(self) -> None:
        self.recording = False
        self.kept: list[torch.Tensor] = []
        self.replay: deque[torch.Tensor] = deque()

    @staticmethod
    def in_recomputation() -> bool:
        return in_backward()  # a forward run inside a backward

    def start(self) -> None:
        self.recording, self.kept, self.replay = True, [], deque()

    def stop(self) -> list[torch.Tensor]:
        kept, self.recording, self.kept = self.kept, False, []
        return kept

    def give(self, buffers: Sequence[torch.Tensor]) -> None:
        self.replay = deque(buffers)

    def answer(self, shape: tuple[int, ...]) -> torch.Tensor:
        if not self.replay:
            raise RuntimeError(
                "a recomputed forward asked for an expert exchange that was not kept; "
                "expected the block's kept exchanges to be handed back first"
            )
        buffer = self.replay.popleft()
        if tuple(buffer.shape) != shape:
            raise RuntimeError(
                f"a recomputed expert exchange expects a {shape} buffer, the kept one is "
                f"{tuple(buffer.shape)}: the recomputation routed differently"
            )
        return buffer

    def record(self, buffer: torch.Tensor) -> None:
        if self.recording:
            self.kept.append(buffer)


class _KeepExchanges(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keepers, counts, output, *buffers):
        ctx.keepers, ctx.counts = keepers, counts
        ctx.save_for_backward(*buffers)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        buffers, start = ctx.saved_tensors, 0
        for keeper, count in zip(ctx.keepers, ctx.counts, strict=True):
            keeper.give(buffers[start : start + count])
            start += count
        return (None, None, grad, *([None] * len(buffers)))


class KeptExchanges:
    """The hooks of one block whose MoE layers keep their exchanges (see the design note)."""

    def __init__(self, block: nn.Module, keepers: Sequence[Keeper]) -> None:
        self.keepers = list(keepers)
        self.handles = [
            block.register_forward_pre_hook(self._start),
            block.register_forward_hook(self._keep),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _start(self, module, args) -> None:
        if torch.is_grad_enabled() and not Keeper.in_recomputation():
            for keeper in self.keepers:
                keeper.start()

    def _keep(self, module, args, output):
        if not any(keeper.recording for keeper in self.keepers):
            return None
        kept = [keeper.stop() for keeper in self.keepers]
        if not (torch.is_tensor(output) and output.requires_grad):
            return None
        flat = [buffer for buffers in kept for buffer in buffers]
        return _KeepExchanges.apply(self.keepers, [len(b) for b in kept], output, *flat)


def keep_exchanges(block: nn.Module, keepers: Sequence[Keeper]) -> KeptExchanges:
    """Keep the exchanges of ``keepers`` (the MoE layers inside ``block``) for the block's
    recomputation."""
    return KeptExchanges(block, keepers)
