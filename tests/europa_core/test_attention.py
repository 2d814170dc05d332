"""Block-causal attention (what CPU runs use) against SDPA's causal attention:
the same output and gradients within fp32 noise, for any block count."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchtitan.models.common.attention import ScaledDotProductAttention

from europa.core.model.attention import BlockCausalAttention, chunk_bounds


@given(seq_len=st.integers(1, 300), chunks=st.integers(1, 16))
def test_blocks_cover_the_sequence_in_order(seq_len, chunks):
    bounds = chunk_bounds(seq_len, chunks)
    assert bounds[0][0] == 0 and bounds[-1][1] == seq_len
    assert all(start < end for start, end in bounds)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def _outputs(module, q, k, v, grad, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, scale=scale)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 2),
    seq_len=st.integers(1, 40),
    heads=st.integers(1, 3),
    qk_dim=st.integers(1, 12),
    v_dim=st.integers(1, 8),
    chunks=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_block_causal_equals_sdpa(batch, seq_len, heads, qk_dim, v_dim, chunks, seed):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, seq_len, heads, qk_dim, generator=generator) for _ in range(2))
    v = torch.randn(batch, seq_len, heads, v_dim, generator=generator)
    grad = torch.randn(batch, seq_len, heads, v_dim, generator=generator)
    scale = qk_dim**-0.5
    expected = _outputs(ScaledDotProductAttention(None), q, k, v, grad, scale)
    blocks = BlockCausalAttention(BlockCausalAttention.Config(chunks=chunks))
    for got, want in zip(_outputs(blocks, q, k, v, grad, scale), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_are_computed_in_fp32_and_returned_in_bf16():
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 16, 2, 8, generator=generator) for _ in range(2))
    v = torch.randn(1, 16, 2, 4, generator=generator)
    blocks = BlockCausalAttention(BlockCausalAttention.Config(chunks=4))
    out = blocks(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    reference = blocks(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float())
    torch.testing.assert_close(out, reference.bfloat16())
