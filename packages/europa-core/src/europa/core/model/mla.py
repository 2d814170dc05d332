"""torchtitan's DeepSeek-V3 attention (MLA) for CPU runs, without its concatenations;
and, for any attention, context parallelism (``ContextParallelMLA``).

torchtitan's ``Attention.forward`` concatenates the query's two parts (``q_nope``, the
rotated ``q_pe``) and the key's (``k_nope``, the shared ``k_pe`` expanded over the heads)
before the attention kernel, and autograd concatenates the query's gradient parts again
in backward. With block-causal attention (``europa.core.model.attention``) the kernel
copies q and k head-major anyway, so this subclass hands it the parts
(``_BlockCausalMLA``): the copies are built from them and the gradients written whole,
three passes over a (B, L, N, H) tensor fewer per layer. Same parameters, names and
init (a subclass of torchtitan's module), same arithmetic: the projections, norms and
rotations are torchtitan's ops, in its order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.deepseek_v3.model import Attention

from europa.core.model import context_parallel
from europa.core.model.attention import BlockCausalAttention, rotate


class ContextParallelMLA(Attention):
    """torchtitan's MLA, or, once ``parallel.cp`` sets ``context_parallel``, the same on
    this rank's rows of each sequence (``europa.core.model.context_parallel``)."""

    context_parallel: context_parallel.ContextParallel | None = None

    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        pass

    def forward(self, x: torch.Tensor, attention_masks, positions: torch.Tensor | None = None):
        if self.context_parallel is None:
            return super().forward(x, attention_masks, positions)
        if attention_masks is not None or positions is not None:
            raise ValueError("context parallelism places each row itself (zig-zag)")
        return context_parallel.mla_forward(self, x, self.context_parallel)


class BlockCausalMLA(ContextParallelMLA):
    @dataclass(kw_only=True, slots=True)
    class Config(ContextParallelMLA.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not isinstance(self.inner_attention, BlockCausalAttention):
            raise ValueError(
                f"BlockCausalMLA: inner_attention = {type(self.inner_attention).__name__}; "
                "expected BlockCausalAttention"
            )

    def forward(self, x: torch.Tensor, attention_masks, positions: torch.Tensor | None = None):
        if self.context_parallel is not None:
            return super().forward(x, attention_masks, positions)
        if attention_masks is not None or positions is not None:  # torchtitan's own path
            return Attention.forward(self, x, attention_masks, positions)
        bsz, seqlen, _ = x.size()
        low_rank = self.q_lora_rank > 0
        q = self.wq_b(self.q_norm(self.wq_a(x))) if low_rank else self.wq(x)
        q = q.view(bsz, seqlen, -1, self.qk_head_dim)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        rope_cache = self.rope._reshape_cache(q[..., self.qk_nope_head_dim :], None)
        k_pe = rotate(k_pe.unsqueeze(2), rope_cache)
        kv = self.wkv_b(self.kv_norm(kv))
        kv = kv.view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        output = self.inner_attention.mla(
            q, kv, k_pe, rope_cache, nope=self.qk_nope_head_dim, scale=self.softmax_scale
        )
        return self.wo(output.view(bsz, seqlen, -1))
