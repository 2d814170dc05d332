"""QK-clip on one MLA attention: the maxima a training forward records are its logits'
maxima, recorded once per training forward (never in evaluation or a recomputation); after
the clip, a clipped head's logits are exactly gamma times its old ones and every other
weight keeps its bits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.core.model.attention import rotate
from europa.spec import logit_max
from europa.spec.logit_max import LogitMax, arm, causal_score_max
from europa.spec.qk_clip import KEY_VALUE, QUERY, MLAHeads, clip_gammas, row_factors
from europa.spec.qk_clip_step import scale_held_rows
from tests.europa_core.test_mla import _attention


def _heads(module) -> MLAHeads:
    return MLAHeads(module.n_heads, module.qk_nope_head_dim, module.qk_rope_head_dim,
                    module.v_head_dim)  # fmt: skip


def _query_name(module) -> str:
    return "wq.weight" if module.q_lora_rank == 0 else "wq_b.weight"


@torch.no_grad()
def _logits(module, x, magnitudes: bool = False) -> torch.Tensor:
    """(B, N, L, L) pre-softmax logits in float64 from the module's weights, causal entries
    only (-inf above the diagonal): torchtitan's MLA written out, not the kernel's. With
    ``magnitudes``, ‖q_i‖·‖k_j‖ times the scale instead: what bounds each logit's terms, and
    so the rounding of weights held in fp32 (a logit that cancels to near zero keeps the
    rounding of its terms)."""

    def linear(name, t):
        return t @ getattr(module, name).weight.double().T

    def norm(name, t):
        weight = getattr(module, name).weight.double()
        eps = getattr(module, name).eps
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight

    x = x.double()
    batch, seq_len, _ = x.shape
    heads, nope = module.n_heads, module.qk_nope_head_dim
    q = (
        linear("wq", x)
        if module.q_lora_rank == 0
        else linear("wq_b", norm("q_norm", linear("wq_a", x)))
    )
    q = q.view(batch, seq_len, heads, -1)
    kv = linear("wkv_a", x)
    kv, k_pe = kv.split([module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    rope_cache = module.rope._reshape_cache(q[..., nope:], None)
    q_pe = rotate(q[..., nope:], rope_cache.to(torch.complex128))
    k_pe = rotate(k_pe.unsqueeze(2), rope_cache.to(torch.complex128))
    k_nope = linear("wkv_b", norm("kv_norm", kv)).view(batch, seq_len, heads, -1)[..., :nope]
    if magnitudes:
        q_norm = torch.cat([q[..., :nope], q_pe], dim=-1).norm(dim=-1)  # (B, L, N)
        k_norm = (k_nope.pow(2).sum(-1) + k_pe.pow(2).sum(-1)).sqrt()
        scores = torch.einsum("bih,bjh->bhij", q_norm, k_norm)
    else:
        scores = torch.einsum("bihd,bjhd->bhij", q[..., :nope], k_nope)
        scores += torch.einsum("bihd,bjxd->bhij", q_pe, k_pe)
    scores *= module.softmax_scale
    later = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    return scores.masked_fill(later, float("-inf"))


def _train_forward(module, x) -> torch.Tensor:
    module.train()
    return module(x.requires_grad_(), None, None)


SHAPES = dict(
    q_lora_rank=st.sampled_from([0, 8]),
    heads=st.integers(1, 4),
    nope=st.sampled_from([2, 4, 6]),
    rope=st.sampled_from([2, 4]),
    v_dim=st.integers(1, 5),
    batch=st.integers(1, 2),
    seq_len=st.integers(1, 20),
    chunks=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=25, deadline=None)
@given(**SHAPES, tau_share=st.floats(0.05, 1.2))
def test_clip_scales_each_clipped_heads_logits_by_gamma_and_nothing_else(
    q_lora_rank, heads, nope, rope, v_dim, batch, seq_len, chunks, seed, tau_share
):
    module = _attention(q_lora_rank, heads, nope, rope, v_dim, chunks)
    x = torch.randn(batch, seq_len, 32, generator=torch.Generator().manual_seed(seed)) * 3
    recorded = arm(module.inner_attention, heads)
    _train_forward(module, x)
    before, magnitudes = _logits(module, x), _logits(module, x, magnitudes=True)
    true_max = before.amax(dim=(0, 2, 3))
    # what the block-causal kernel records is the logits' maximum (its fp32 arithmetic)
    torch.testing.assert_close(recorded.read().double(), true_max, rtol=1e-5, atol=1e-5)

    tau = max(float(true_max.max()) * tau_share, 1e-3)
    gammas = clip_gammas(true_max, tau)
    names = (_query_name(module), "wkv_b.weight")
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    factors = {
        names[0]: row_factors(_heads(module), QUERY, gammas),
        names[1]: row_factors(_heads(module), KEY_VALUE, gammas),
    }
    scale_held_rows(module, factors)
    after = _logits(module, x)

    clipped = gammas < 1
    for h in range(heads):
        old, new = before[:, h], after[:, h]
        causal = torch.isfinite(old)
        if clipped[h]:
            bound = 1e-6 * magnitudes[:, h][causal].max()
            assert (new[causal] - gammas[h] * old[causal]).abs().max() <= bound
            assert new[causal].max() <= tau * (1 + 1e-6) + bound
        else:
            assert torch.equal(new, old)
    # the shared rotary key, the values and every other weight keep their bits
    query_rows = nope + rope
    for name, old in weights.items():
        new = dict(module.named_parameters())[name].detach()
        if name not in names:
            assert torch.equal(new, old), name
            continue
        width = query_rows if name == names[0] else nope + v_dim
        for h in range(heads):
            rows = slice(h * width, (h + 1) * width)
            if not clipped[h]:
                assert torch.equal(new[rows], old[rows]), (name, h)
            elif name == names[1]:  # the values of a clipped head are not scaled
                assert torch.equal(
                    new[h * width + nope : (h + 1) * width], old[h * width + nope : (h + 1) * width]
                )


def test_a_maximum_at_or_below_zero_clips_nothing():
    gammas = clip_gammas(torch.tensor([-3.0, 0.0, 50.0, 100.0, 400.0]), 100.0)
    assert gammas.tolist() == [1.0, 1.0, 1.0, 1.0, 0.25]
    with pytest.raises(ValueError, match="tau = 0"):
        clip_gammas(torch.zeros(2), 0)


def test_only_training_forwards_record_and_a_recomputation_does_not():
    module = _attention(0, 2, 4, 4, 3, chunks=2)
    recorded = arm(module.inner_attention, 2)
    x = torch.randn(1, 8, 32)

    module.eval()
    with torch.no_grad():
        module(x, None, None)
    assert recorded.value is None
    module.train()
    with torch.no_grad():
        module(x, None, None)
    assert recorded.value is None

    out = torch.utils.checkpoint.checkpoint(
        module, x.clone().requires_grad_(), None, None, use_reentrant=False
    )
    first = recorded.value.clone()
    recorded.reset()
    out.sum().backward()  # recomputes the forward inside backward
    assert recorded.value is None
    torch.testing.assert_close(first.double(), _logits(module, x).amax(dim=(0, 2, 3)),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_micro_batches_keep_the_largest():
    module = _attention(0, 3, 4, 2, 2, chunks=3)
    recorded = arm(module.inner_attention, 3)
    xs = [torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    for x in xs:
        _train_forward(module, x)
    want = torch.stack([_logits(module, x).amax(dim=(0, 2, 3)) for x in xs]).amax(0)
    torch.testing.assert_close(recorded.read().double(), want, rtol=1e-5, atol=1e-5)


def test_the_max_beside_sdpa_is_the_block_kernels(monkeypatch):
    monkeypatch.setattr(logit_max, "SCORE_BLOCK_ELEMENTS", 2 * 3 * 17 * 4)  # blocks of 4 rows
    generator = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 17, 3, 6, generator=generator) for _ in range(2))
    into = LogitMax(3)
    causal_score_max(q, k, 0.4, into)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * 0.4
    scores = scores.masked_fill(torch.ones(17, 17, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(into.read().double(), scores.amax(dim=(0, 2, 3)))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 12),
    earlier=st.integers(0, 9),
    block_rows=st.integers(1, 13),
    seed=st.integers(0, 99),
)
def test_the_max_beside_sdpa_of_a_chunk_of_later_queries_is_over_its_causal_keys(
    rows, earlier, block_rows, seed
):
    """Context parallelism's chunks: ``rows`` queries at positions ``earlier`` and on, over
    every key up to the last of them, in blocks of ``block_rows`` rows."""
    keys = earlier + rows
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, rows, 3, 5, generator=generator)
    k = torch.randn(2, keys, 3, 5, generator=generator)
    into = LogitMax(3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(logit_max, "SCORE_BLOCK_ELEMENTS", 2 * 3 * keys * block_rows)
        causal_score_max(q, k, 0.7, into)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * 0.7
    later = torch.arange(keys) > (earlier + torch.arange(rows)).unsqueeze(1)
    want = scores.masked_fill(later, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(into.read().double(), want, rtol=1e-5, atol=1e-5)  # fp32 vs fp64


def test_an_sdpa_armed_beside_records_in_training_forwards_only():
    from torchtitan.models.common.attention import ScaledDotProductAttention

    sdpa = ScaledDotProductAttention(None)
    into = arm(sdpa, 3)
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 9, 3, 4, generator=generator, requires_grad=True) for _ in "qkv")
    out = torch.utils.checkpoint.checkpoint(sdpa, q, k, v, scale=0.3, use_reentrant=False)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * 0.3
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(into.read().double(), scores.detach().amax(dim=(0, 2, 3)))
    into.reset()
    out.sum().backward()  # the recomputation inside backward records nothing
    assert into.value is None
    sdpa.eval()
    sdpa(q, k, v, scale=0.3)
    assert into.value is None
    assert arm(sdpa, 3) is sdpa.logit_max and len(sdpa._forward_pre_hooks) == 1  # once
