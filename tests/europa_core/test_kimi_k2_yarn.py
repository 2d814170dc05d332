"""The kimi-k2 preset's YaRN against Kimi-K2's published config.json.

Kimi-K2-Base and Kimi-K2-Instruct (moonshotai on Hugging Face) publish
``rope_theta = 50000.0``, ``max_position_embeddings = 131072`` and
``rope_scaling = {type "yarn", factor 32.0, original_max_position_embeddings 4096,
beta_fast 1.0, beta_slow 1.0, mscale 1.0, mscale_all_dim 1.0}`` (Megatron-Bridge's
KimiK2Provider carries the same values; Kimi-K2-Instruct-0905 keeps the betas with
factor 64.0). The betas are not DeepSeek-V3's 32 and 1, europa's defaults.

The rotary table europa builds for the preset is checked against a reference written
here from the YaRN code Kimi-K2 ships (DeepSeek-V3's ``modeling_deepseek.py``:
``yarn_find_correction_range``, ``yarn_linear_ramp_mask``, ``yarn_get_mscale``).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from europa.core.config import load_config
from europa.core.hf.config_map import hf_config_from_model
from europa.core.model import model_spec

# Kimi-K2-Base / Kimi-K2-Instruct config.json, the keys that shape the rotary table.
PUBLISHED_ROPE_THETA = 50000.0
PUBLISHED_MAX_POSITION_EMBEDDINGS = 131072
PUBLISHED_QK_ROPE_HEAD_DIM = 64
PUBLISHED_ROPE_SCALING = {
    "type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


# --- reference: DeepSeek-V3 / Kimi-K2 modeling_deepseek.py, in float64 ----------------


def _yarn_find_correction_dim(num_rotations, dim, base, max_position_embeddings):
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (
        2 * math.log(base)
    )


def _yarn_find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings):
    low = math.floor(_yarn_find_correction_dim(low_rot, dim, base, max_position_embeddings))
    high = math.ceil(_yarn_find_correction_dim(high_rot, dim, base, max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def _yarn_linear_ramp_mask(low, high, n):
    if low == high:
        high += 0.001
    linear = (torch.arange(n, dtype=torch.float64) - low) / (high - low)
    return torch.clamp(linear, 0, 1)


def _yarn_get_mscale(scale=1.0, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _reference_inv_freq(dim, base, factor, beta_fast, beta_slow, original):
    """``DeepseekV3YarnRotaryEmbedding``'s inverse frequencies."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    freq_extra = 1.0 / (base**exponents)
    freq_inter = 1.0 / (factor * base**exponents)
    low, high = _yarn_find_correction_range(beta_fast, beta_slow, dim, base, original)
    inv_freq_mask = 1.0 - _yarn_linear_ramp_mask(low, high, dim // 2)
    return freq_inter * (1 - inv_freq_mask) + freq_extra * inv_freq_mask


def _published_inv_freq(beta_fast=None, beta_slow=None):
    s = PUBLISHED_ROPE_SCALING
    return _reference_inv_freq(
        PUBLISHED_QK_ROPE_HEAD_DIM,
        PUBLISHED_ROPE_THETA,
        s["factor"],
        s["beta_fast"] if beta_fast is None else beta_fast,
        s["beta_slow"] if beta_slow is None else beta_slow,
        s["original_max_position_embeddings"],
    )


# --- europa's side -------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi():
    return load_config("kimi-k2").model


@pytest.fixture(scope="module")
def attention_spec(kimi):
    return model_spec(kimi).layers[0].attention


def _rope_table(rope_config, max_seq_len: int) -> torch.Tensor:
    """The complex table (positions x dim/2) of the RoPE europa builds, on the CPU."""
    with torch.device("cpu"):
        rope = dataclasses.replace(rope_config, max_seq_len=max_seq_len).build()
    return rope.cache


def test_the_preset_carries_the_published_yarn(kimi):
    s = PUBLISHED_ROPE_SCALING
    assert kimi.rope_theta == PUBLISHED_ROPE_THETA
    assert kimi.max_seq_len == PUBLISHED_MAX_POSITION_EMBEDDINGS
    assert kimi.qk_rope_head_dim == PUBLISHED_QK_ROPE_HEAD_DIM
    assert kimi.rope_factor == s["factor"]
    assert kimi.rope_original_seq_len == s["original_max_position_embeddings"]
    assert (kimi.rope_beta_fast, kimi.rope_beta_slow) == (s["beta_fast"], s["beta_slow"])
    # europa's mscale is HF's mscale_all_dim; HF's cos/sin factor mscale / mscale_all_dim is 1
    assert kimi.mscale == s["mscale_all_dim"] == s["mscale"]


def test_the_exported_config_json_has_the_published_rope_keys(kimi):
    config = hf_config_from_model(kimi)
    assert config["rope_scaling"] == PUBLISHED_ROPE_SCALING
    assert config["rope_theta"] == PUBLISHED_ROPE_THETA
    assert config["max_position_embeddings"] == PUBLISHED_MAX_POSITION_EMBEDDINGS


def test_the_rope_config_europa_builds_is_yarn_with_the_published_values(attention_spec):
    rope = attention_spec.rope
    s = PUBLISHED_ROPE_SCALING
    assert rope.scaling == "yarn"
    assert rope.dim == PUBLISHED_QK_ROPE_HEAD_DIM
    assert rope.theta == PUBLISHED_ROPE_THETA
    assert rope.max_seq_len == PUBLISHED_MAX_POSITION_EMBEDDINGS
    assert rope.rope_factor == s["factor"]
    assert rope.original_seq_len == s["original_max_position_embeddings"]
    assert (rope.beta_fast, rope.beta_slow) == (s["beta_fast"], s["beta_slow"])
    assert rope.truncate  # floor/ceil of the correction range, as DeepSeek-V3's code does


def test_the_rotary_table_matches_the_published_formula(attention_spec):
    table = _rope_table(attention_spec.rope, 4096)
    assert table.shape == (4096, PUBLISHED_QK_ROPE_HEAD_DIM // 2)
    # position 1 holds the inverse frequencies themselves (every one is below pi)
    ours = torch.angle(table[1]).double()
    reference = _published_inv_freq()
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)
    # and every position p rotates by p times them (float32 table: ~1e-3 at p = 4095)
    positions = torch.arange(4096, dtype=torch.float64)
    expected = torch.polar(
        torch.ones(4096, reference.numel(), dtype=torch.float64),
        torch.outer(positions, reference),
    )
    torch.testing.assert_close(table.to(torch.complex128), expected, rtol=0, atol=2e-3)
    # HF multiplies cos/sin by mscale / mscale_all_dim; the published values make it 1
    s = PUBLISHED_ROPE_SCALING
    ratio = _yarn_get_mscale(s["factor"], s["mscale"]) / _yarn_get_mscale(
        s["factor"], s["mscale_all_dim"]
    )
    assert ratio == 1.0
    torch.testing.assert_close(table.abs(), torch.ones_like(table.abs()))


def test_the_full_length_table_keeps_the_published_frequencies(attention_spec):
    table = _rope_table(attention_spec.rope, PUBLISHED_MAX_POSITION_EMBEDDINGS)
    assert table.shape == (PUBLISHED_MAX_POSITION_EMBEDDINGS, PUBLISHED_QK_ROPE_HEAD_DIM // 2)
    torch.testing.assert_close(
        torch.angle(table[1]).double(), _published_inv_freq(), rtol=1e-6, atol=0
    )


def test_deepseek_v3_betas_would_give_another_table():
    """The check above has teeth: with beta_fast 32 (DeepSeek-V3, europa's default) the
    correction range starts at dimension pair 8 instead of 19, and pairs 9..19 differ."""
    published = _published_inv_freq()
    deepseek = _published_inv_freq(beta_fast=32.0, beta_slow=1.0)
    differ = (~torch.isclose(published, deepseek, rtol=1e-6, atol=0)).nonzero().flatten()
    assert differ.tolist() == list(range(9, 20))


def test_the_softmax_scale_folds_in_the_published_mscale_all_dim(attention_spec):
    with torch.device("meta"):
        attention = attention_spec.build()
    s = PUBLISHED_ROPE_SCALING
    qk_head_dim = attention_spec.qk_nope_head_dim + attention_spec.qk_rope_head_dim
    mscale = _yarn_get_mscale(s["factor"], s["mscale_all_dim"])
    assert attention.softmax_scale == pytest.approx(qk_head_dim**-0.5 * mscale * mscale)
