"""europa's MLA for CPU runs (q and k handed to block-causal attention in parts) against
torchtitan's own MLA forward on the same module: the same output and gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.core.model.attention import BlockCausalAttention
from europa.core.model.mla import BlockCausalMLA


def _spec(
    q_lora_rank: int,
    heads: int,
    nope: int,
    rope: int,
    v_dim: int,
    chunks: int,
    attention: str = "block_causal",
):
    from europa.core.config.schema import ModelConfig
    from europa.core.model import model_spec

    config = ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=1,
        n_dense_layers=1,
        n_heads=heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
        dense_hidden_dim=64,
        moe_hidden_dim=16,
        num_experts=4,
        num_shared_experts=1,
        top_k=2,
        max_seq_len=64,
        rope_factor=40.0,
        rope_original_seq_len=16,
    )
    spec = model_spec(config, attention=attention).layers[0].attention
    if attention == "block_causal":
        spec.inner_attention = BlockCausalAttention.Config(chunks=chunks)
    return spec


def _attention(
    q_lora_rank: int,
    heads: int,
    nope: int,
    rope: int,
    v_dim: int,
    chunks: int,
    attention: str = "block_causal",
):
    """One MLA layer (``model_spec``'s, with ``attention``) on the CPU, random weights."""
    from europa.core.model.materialise import init_buffers

    spec = _spec(q_lora_rank, heads, nope, rope, v_dim, chunks, attention)
    with torch.device("meta"):
        module = spec.build()
    module.to_empty(device="cpu")
    init_buffers(module, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return module


def _run(module, x, grad, through_torchtitan: bool):
    x = x.detach().clone().requires_grad_()
    module.zero_grad()
    forward = super(BlockCausalMLA, module).forward if through_torchtitan else module.forward
    out = forward(x, None, None)
    out.backward(grad)
    return [out.detach(), x.grad, *(p.grad.clone() for p in module.parameters())]


@settings(max_examples=15, deadline=None)
@given(
    q_lora_rank=st.sampled_from([0, 8]),
    heads=st.integers(1, 3),
    nope=st.sampled_from([2, 4, 6]),  # torchtitan rotates pairs at an even offset
    rope=st.sampled_from([2, 4]),
    v_dim=st.integers(1, 5),
    batch=st.integers(1, 2),
    seq_len=st.integers(1, 24),
    chunks=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_mla_in_parts_equals_torchtitans_mla(
    q_lora_rank, heads, nope, rope, v_dim, batch, seq_len, chunks, seed
):
    module = _attention(q_lora_rank, heads, nope, rope, v_dim, chunks)
    assert isinstance(module, BlockCausalMLA)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, 32, generator=generator)
    grad = torch.randn(batch, seq_len, 32, generator=generator)
    expected = _run(module, x, grad, through_torchtitan=True)
    for got, want in zip(_run(module, x, grad, through_torchtitan=False), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mla_in_parts_keeps_the_dtype_it_is_given():
    module = _attention(0, 2, 4, 4, 3, chunks=2)
    for param in module.parameters():  # not the complex RoPE table
        param.data = param.data.bfloat16()
    x = torch.randn(1, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    out = module(x, None, None)
    out.sum().backward()
    assert out.dtype == x.grad.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.bfloat16 for p in module.parameters())


def test_mla_in_parts_needs_block_causal_attention():
    from torchtitan.models.common.attention import ScaledDotProductAttention

    spec = _spec(0, 1, 2, 2, 2, chunks=1)
    spec.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"), pytest.raises(ValueError, match="expected BlockCausalAttention"):
        spec.build()
