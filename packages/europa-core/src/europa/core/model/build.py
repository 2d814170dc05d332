"""``[model]`` → a torchtitan DeepSeek-V3 module tree, on the meta device.

torchtitan 0.3.0 assembles the model from per-layer configs
(``build_mla_moe_layers``). We keep its layers, init and parameter names and
swap two leaves for CPU training: causal attention without FlexAttention
(which has no CPU backward), and, for fp32 runs, routed experts that do not
cast to bf16. The attention is SDPA (``attention="sdpa"``: fused kernels on
CUDA) or ``BlockCausalAttention`` (``"block_causal"``: what CPU runs use, as
SDPA's CPU path for MLA computes the masked half of the scores too), whose MLA
module (``BlockCausalMLA``) hands it q and k in parts rather than concatenated.
"""

from __future__ import annotations

import dataclasses

import torch
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers

from europa.core.config.schema import ModelConfig
from europa.core.model import init
from europa.core.model.attention import BlockCausalAttention
from europa.core.model.experts import NativeDtypeGroupedExperts
from europa.core.model.mla import BlockCausalMLA, ContextParallelMLA


def _rope(m: ModelConfig) -> ComplexRoPE.Config:
    yarn = m.rope_factor > 1.0
    return ComplexRoPE.Config(
        dim=m.qk_rope_head_dim,
        max_seq_len=m.max_seq_len,
        theta=m.rope_theta,
        scaling="yarn" if yarn else "none",
        rope_factor=m.rope_factor,
        beta_fast=m.rope_beta_fast,
        beta_slow=m.rope_beta_slow,
        original_seq_len=m.rope_original_seq_len,
    )


ATTENTION_KINDS = ("sdpa", "block_causal")


def _inner_attention(kind: str):
    if kind == "sdpa":
        return ScaledDotProductAttention.Config()
    if kind == "block_causal":
        return BlockCausalAttention.Config()
    raise ValueError(f"attention = {kind!r}: expected one of {', '.join(ATTENTION_KINDS)}")


def _as_config(subclass_config, config):
    """``config``'s fields in a subclass's Config, which builds the subclass."""
    return subclass_config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def model_spec(
    m: ModelConfig, *, native_dtype_experts: bool = True, attention: str = "sdpa"
) -> DeepSeekV3Model.Config:
    """The torchtitan config tree for ``[model]``."""
    groups = m.num_expert_groups or None
    layers = build_mla_moe_layers(
        n_layers=m.n_layers,
        n_dense_layers=m.n_dense_layers,
        dim=m.dim,
        n_heads=m.n_heads,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        mscale=m.mscale,
        dense_hidden_dim=m.dense_hidden_dim,
        moe_hidden_dim=m.moe_hidden_dim,
        num_experts=m.num_experts,
        num_shared_experts=m.num_shared_experts,
        router_top_k=m.top_k,
        router_score_func=m.score_func,
        router_num_expert_groups=groups,
        router_num_limited_groups=m.num_limited_groups or None,
        router_route_scale=m.route_scale,
        router_route_norm=m.route_norm,
        attn_backend="flex",  # replaced below; "sdpa" is refused by the factory
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=_rope(m),
        linear_init=init.LINEAR_INIT,
        norm_init=init.NORM_INIT,
        depth_init=init.depth_init,
        depth_experts_init=init.depth_experts_init,
    )
    for layer in layers:
        layer.attention.inner_attention = _inner_attention(attention)
        mla = BlockCausalMLA if attention == "block_causal" else ContextParallelMLA
        layer.attention = _as_config(mla.Config, layer.attention)
        for norm in (layer.attention_norm, layer.ffn_norm, layer.attention.kv_norm):
            norm.eps = m.norm_eps
        if layer.attention.q_norm is not None:
            layer.attention.q_norm.eps = m.norm_eps
        if layer.moe is None:
            continue
        layer.moe.load_balance_coeff = m.load_balance_coeff or None
        if m.num_shared_experts == 0:
            layer.moe.shared_experts = None
        if native_dtype_experts:
            layer.moe.routed_experts.inner_experts = _as_config(
                NativeDtypeGroupedExperts.Config, layer.moe.routed_experts.inner_experts
            )
    return DeepSeekV3Model.Config(
        vocab_size=m.vocab_size,
        dim=m.dim,
        tok_embeddings=Embedding.Config(
            num_embeddings=m.vocab_size, embedding_dim=m.dim, param_init=init.EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=m.dim, eps=m.norm_eps, param_init=init.NORM_INIT),
        lm_head=Linear.Config(
            in_features=m.dim, out_features=m.vocab_size, param_init=init.output_linear_init(m.dim)
        ),
        layers=layers,
        mtp_layers=[],
    )


def build_moe_model(
    m: ModelConfig, *, native_dtype_experts: bool = True, attention: str = "sdpa"
) -> DeepSeekV3Model:
    """Build on the meta device: no memory is allocated until the trainer materialises it."""
    with torch.device("meta"):
        spec = model_spec(m, native_dtype_experts=native_dtype_experts, attention=attention)
        return spec.build()
