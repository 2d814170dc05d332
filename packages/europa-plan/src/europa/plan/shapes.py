"""A model's work per token, by part: the multiply-adds (MACs) of each matrix multiply and
the elements of each memory-bound operation, forward, for one layer of each kind. The
FLOP counts (``europa.plan.flops``) and the activation memory (``europa.plan.memory``)
are both read off these parts.

Notation: h model width, n query heads, g key/value heads, d head width, s sequence
length, V vocabulary; MLA: ql / kvl the query and key/value latent ranks, dn / dr / dv
the no-position, rotary and value head widths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from europa.plan.record import Model


def padded_vocab(model: Model, tp: int, multiple: int = 128) -> int:
    """The vocabulary as Megatron allocates it: padded to ``multiple`` × tp rows."""
    step = multiple * tp
    return math.ceil(model.vocab_size / step) * step


@dataclass(frozen=True)
class AttentionMacs:
    """One attention layer's forward MACs per token."""

    down_proj: int  # MLA's query and key/value latents (and the shared rotary key)
    up_proj: int  # MLA's up-projections from the latents (``mla_up_proj``)
    qkv_proj: int  # GQA's query, key and value projections
    out_proj: int
    core: float  # QKᵀ and AV against s/2 earlier positions on average (causal)

    @property
    def projections(self) -> int:
        return self.down_proj + self.up_proj + self.qkv_proj + self.out_proj


def attention_macs(model: Model, seq_len: int) -> AttentionMacs:
    h, n = model.dim, model.n_heads
    if model.mla:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        ql, kvl = model.q_lora_rank, model.kv_lora_rank
        q_down = h * ql if ql else 0
        q_up = ql * n * qk if ql else h * n * qk
        down = q_down + h * (kvl + model.qk_rope_head_dim)
        up = q_up + kvl * n * (model.qk_nope_head_dim + model.v_head_dim)
        core = seq_len / 2 * n * (qk + model.v_head_dim)
        return AttentionMacs(down, up, 0, n * model.v_head_dim * h, core)
    d, g = model.head_dim, model.n_kv_heads
    core = seq_len / 2 * n * d * 2
    return AttentionMacs(0, 0, h * d * (n + 2 * g), n * d * h, core)


def dense_ffn_macs(model: Model) -> int:
    """A dense SwiGLU feed-forward: gate, up and down projections."""
    return 3 * model.dim * model.ffn_hidden_dim


def expert_macs(model: Model) -> int:
    """One routed expert (SwiGLU) for one token."""
    return 3 * model.dim * model.moe_hidden_dim


def shared_macs(model: Model) -> int:
    return model.num_shared_experts * expert_macs(model)


def router_macs(model: Model) -> int:
    return model.dim * model.num_experts


@dataclass(frozen=True)
class Elementwise:
    """One layer's memory-bound operations, in elements touched per token, forward."""

    norms: int  # RMSNorms (and MLA's latent norms, GQA's QK-norm)
    activation: int  # SwiGLU's gate × up (the experts' share under ``moe_act``)
    expert_activation: int
    rotary: int
    router: int
    residual: int


def elementwise(model: Model, moe_layer: bool) -> Elementwise:
    h, n = model.dim, model.n_heads
    if model.mla:
        norms = 2 * h + model.q_lora_rank + model.kv_lora_rank
        rotary = (n + 1) * model.qk_rope_head_dim
    else:
        norms = 2 * h + (2 * n * model.head_dim if model.qk_norm else 0)
        rotary = (n + model.n_kv_heads) * model.head_dim
    if moe_layer:
        routed = model.top_k * model.moe_hidden_dim
        shared = model.num_shared_experts * model.moe_hidden_dim
        activation, expert_act, router = shared, routed, model.num_experts
    else:
        activation, expert_act, router = model.ffn_hidden_dim, 0, 0
    return Elementwise(norms, activation, expert_act, rotary, router, residual=2 * h)
