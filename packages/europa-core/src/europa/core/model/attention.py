"""Causal attention that skips the masked half of the scores, for CPU runs.

On CPU, SDPA runs its reference ("math") path for MLA attention: the CPU flash
kernel needs value heads as wide as query heads (MLA's are 128 against 192, and
padding v to 192 measured slower). That path multiplies every query with every
key, then masks half the scores away. This module cuts the queries into
``chunks`` row blocks; block i multiplies only with the keys up to its own end,
with an additive -inf mask on its diagonal block. Score, softmax and
probability-times-value work drop to (chunks + 1) / (2 chunks) of SDPA's (5/8
at 4), and so do the saved probabilities. The maths is SDPA's up to fp32
rounding (masked scores add exact zeros to every sum), in fp32 whatever the
compute dtype (as SDPA's CPU path). Forward and backward are written out
(``_BlockCausal``) because autograd through the per-block slices would build
a zero-filled whole-size gradient per block.

Same interface as torchtitan's ``ScaledDotProductAttention``: (B, L, N, H)
tensors in and out, causal only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torchtitan.protocols.module import Module

DEFAULT_CHUNKS = 4


def chunk_bounds(seq_len: int, chunks: int) -> list[tuple[int, int]]:
    """(start, end) of each query block: ``chunks`` near-equal blocks, none empty."""
    chunks = max(1, min(chunks, seq_len))
    edges = [seq_len * i // chunks for i in range(chunks + 1)]
    return list(itertools.pairwise(edges))


def _diagonal_mask(start: int, end: int, like: torch.Tensor) -> torch.Tensor:
    """Additive mask (rows start..end, keys 0..end): -inf where a key follows its query."""
    rows = torch.arange(start, end, device=like.device).unsqueeze(1)
    keys = torch.arange(end, device=like.device).unsqueeze(0)
    mask = torch.zeros(end - start, end, dtype=like.dtype, device=like.device)
    return mask.masked_fill_(keys > rows, float("-inf"))


class _BlockCausal(torch.autograd.Function):
    """q, k: (B·N, L, H); v: (B·N, L, Hv). Saves q, k, v and each block's probabilities;
    backward writes each block's share into whole-size gradients in place (autograd's
    slicing would build a zero-filled full gradient per block)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, bounds: list[tuple[int, int]]):
        out = q.new_empty(*q.shape[:2], v.size(-1))
        probabilities = []
        for start, end in bounds:
            scores = torch.baddbmm(
                _diagonal_mask(start, end, q), q[:, start:end], k[:, :end].mT, alpha=scale
            )
            probs = scores.softmax(dim=-1)
            torch.bmm(probs, v[:, :end], out=out[:, start:end])
            probabilities.append(probs)
        ctx.save_for_backward(q, k, v, *probabilities)
        ctx.scale, ctx.bounds = scale, bounds
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *probabilities = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (start, end), probs in zip(ctx.bounds, probabilities, strict=True):
            grad_block = grad_out[:, start:end]
            grad_v[:, :end].baddbmm_(probs.mT, grad_block)
            grad_probs = torch.bmm(grad_block, v[:, :end].mT)
            # softmax backward, dS = P * (dP - rowsum(P * dP)), in one fused pass
            grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
            torch.bmm(grad_scores, k[:, :end], out=grad_q[:, start:end])
            grad_k[:, :end].baddbmm_(grad_scores.mT, q[:, start:end], alpha=ctx.scale)
        return grad_q.mul_(ctx.scale), grad_k, grad_v, None, None


class BlockCausalAttention(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        chunks: int = DEFAULT_CHUNKS

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.chunks = config.chunks

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks=None,
        scale: float | None = None,
        is_causal: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        if attention_masks is not None or not is_causal:
            raise ValueError("BlockCausalAttention computes plain causal attention only")
        batch, seq_len, heads, _ = q_BLNH.shape
        scale = q_BLNH.size(-1) ** -0.5 if scale is None else scale

        def by_head(t: torch.Tensor) -> torch.Tensor:  # (B·N, L, H), contiguous
            return t.transpose(1, 2).reshape(batch * heads, seq_len, t.size(-1)).contiguous()

        # fp32 arithmetic whatever the compute dtype, as SDPA's CPU path does
        q, k, v = (by_head(t).float() for t in (q_BLNH, k_BLNH, v_BLNH))
        out = _BlockCausal.apply(q, k, v, scale, chunk_bounds(seq_len, self.chunks))
        return out.to(v_BLNH.dtype).view(batch, heads, seq_len, -1).transpose(1, 2)
