"""Expert exchange beside computation: chunks in flight, the shared expert computing.

Design note. An expert-parallel MoE layer whose dispatcher offers the chunked
protocol of europa-flexshard (``begin(x, scores, ids, chunks)`` returning a routed
exchange with ``arrive``, ``send_back`` and ``finish``; ``europa.flexshard.exchange.dispatcher``)
(``europa.spec.dispatch.ChunkedDispatcher``) is driven here, chunk by chunk:

1. ``begin`` issues every chunk's dispatch at once, asynchronously (the counts go
   first, synchronously, so every buffer is sized exactly);
2. the shared expert runs while they are in flight (its module is called from
   here and the result handed back when the MoE layer asks for it);
3. chunk by chunk: wait for its tokens, run the experts, issue its return
   asynchronously, so one chunk's return travels while the next computes;
4. ``finish`` waits for every return and sums each token's experts.

The dispatcher owns the exchange (flat or two-level, its wire dtypes, kept
exchanges); nothing of it is re-implemented here. Its flat exchange chunks by local
expert, which keeps results bit-identical to the unchunked layer; its two-level one
chunks by token. The backward mirrors the forward: the gradient of a wait issues
the reverse exchange asynchronously and the gradient of the launch waits for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from europa.spec.dispatch import ChunkedDispatcher


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

    def discard(self) -> None:
        """Drop a result computed early and never asked for."""
        self._ready = None

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
        self.module = module
        self.experts = module.inner_experts
        self.dispatcher = module.token_dispatcher
        self.chunks = chunks
        self.shared = shared
        self.original = module.forward

    def __call__(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_tokens_per_expert_E):
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        routed = self.dispatcher.begin(
            x_BLD.view(B * L, D),
            topk_scores_BLK.view(-1, K),
            topk_expert_ids_BLK.view(-1, K),
            self.chunks,
        )
        try:
            if self.shared is not None:
                self.shared.compute(x_BLD)  # while the tokens travel
            for c in range(routed.chunks):
                rows, counts = routed.arrive(c)
                routed.send_back(c, self.experts(rows, counts))
            return routed.finish().view(B, -1, D)
        except BaseException:
            # A forward that stops here never asks for the shared expert's result: torch's
            # activation checkpointing stops a recomputation as soon as it has what backward
            # needs. Kept, the result would hold the block's recomputed graph until its next
            # forward.
            if self.shared is not None:
                self.shared.discard()
            raise


def overlappable(module: nn.Module) -> bool:
    """A routed-expert module whose dispatcher offers the chunked exchange
    (``europa.spec.dispatch.ChunkedDispatcher``: europa-flexshard's)."""
    dispatcher = getattr(module, "token_dispatcher", None)
    experts = getattr(module, "inner_experts", None)
    return isinstance(experts, nn.Module) and isinstance(dispatcher, ChunkedDispatcher)


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
