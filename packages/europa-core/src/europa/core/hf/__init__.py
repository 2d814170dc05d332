"""Hugging Face DeepSeek-V3 / Kimi-K2 checkpoints in and out.

One concern a file: ``config_map`` (config.json ↔ ``[model]``), ``names``
(tensor names through torchtitan's ``DeepSeekV3StateDictAdapter``), ``reader``
(lazy safetensors slices, block-FP8 dequantised on load), ``load``
(``model.init_from = "hf:DIR"`` as an ``init_matrix`` for any layout),
``export`` (a run's DCP checkpoint streamed to safetensors) and ``plan``
(``europa import-hf``: the meta-device check and per-rank read plan).

Architectural differences to transformers' ``DeepseekV3ForCausalLM`` that
matter, all handled exactly (fp32 logits agree to ~2e-7 relative in the
tests): its router always routes group-limited with sigmoid scores and
``e_score_correction_bias`` (europa: ``num_expert_groups = 0`` ≡ one group;
the bias is europa's ``expert_bias_E``); its MLA latent norms use eps 1e-6
whatever ``rms_norm_eps`` says (equal to europa's ``norm_eps`` only at 1e-6,
which DeepSeek-V3 and Kimi-K2 use); its YaRN cos/sin factor
``mscale / mscale_all_dim`` must be 1. Its RoPE de-interleaves the rotated
pairs, europa's keeps them interleaved: both permute queries and keys alike,
so attention scores are equal. MTP layers (``num_nextn_predict_layers``) are
not built by europa and are skipped on import.
"""
