"""Hugging Face ``config.json`` (DeepSeek-V3 architecture) ↔ europa's ``[model]`` table.

What maps one to one is mapped; what europa's model cannot express (another
router score function, a non-interleaved RoPE, tied embeddings, biases, ...)
is refused in one line naming the key, its value and what was expected.

Differences kept in mind (see also ``europa.core.hf``'s design note):

* transformers' ``DeepseekV3TopkRouter`` always routes group-limited
  (``n_group``/``topk_group``); one group of all experts is plain top-k, which
  is europa's ``num_expert_groups = 0``.
* It always uses sigmoid scores and a shared expert; europa's ``softmax``
  router and ``num_shared_experts = 0`` have no HF equivalent.
* YaRN: europa's ``mscale`` is HF's ``mscale_all_dim`` (the softmax-scale
  correction); HF also multiplies cos/sin by ``mscale / mscale_all_dim``,
  which europa's RoPE (a pure rotation) does not, so the two must be equal.
* transformers hard-codes eps 1e-6 for the MLA latent norms
  (``q_a_layernorm``, ``kv_a_layernorm``) whatever ``rms_norm_eps`` says;
  europa's ``norm_eps`` is one value for every norm. DeepSeek-V3 and Kimi-K2
  use 1e-6 everywhere, where the two agree exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from europa.core.config.schema import ModelConfig
from europa.core.config.values import show
from europa.core.errors import CheckpointError, ConfigError

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# europa keys that are run choices rather than properties of the weights.
NOT_COMPARED = ("init_from", "load_balance_coeff", "max_seq_len")


def read_config(directory: Path) -> dict[str, Any]:
    """``DIR/config.json``, checked to describe a DeepSeek-V3-architecture model."""
    path = directory / "config.json"
    if not directory.is_dir():
        raise CheckpointError(
            f"{str(directory)!r} is not a directory: expected a Hugging Face checkpoint folder"
        )
    if not path.is_file():
        raise CheckpointError(
            f"{str(directory)!r} has no config.json: expected a Hugging Face checkpoint "
            "(config.json, *.safetensors and model.safetensors.index.json)"
        )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{str(path)!r} is not valid JSON ({err}); expected a model config"
        ) from None
    architectures = config.get("architectures") or []
    if ARCHITECTURE not in architectures and config.get("model_type") not in MODEL_TYPES:
        raise CheckpointError(
            f"{str(path)!r}: architectures = {show(architectures)}, model_type = "
            f"{show(config.get('model_type'))}: expected {ARCHITECTURE} (model_type one of "
            f"{', '.join(MODEL_TYPES)})"
        )
    return config


def _refuse(source: str, key: str, value: Any, expected: str) -> CheckpointError:
    return CheckpointError(f"{source}: {key} = {show(value)}: expected {expected}")


def _rope(config: dict[str, Any], source: str) -> dict[str, Any]:
    """RoPE keys: legacy ``rope_theta`` + ``rope_scaling``, or transformers 5's
    ``rope_parameters``."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {}) or params
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind in ("default", None):
        return out | {"rope_factor": 1.0}
    if kind != "yarn":
        raise _refuse(source, "rope_scaling.type", kind, '"yarn" or no scaling')
    if scaling.get("truncate", True) is not True:
        raise _refuse(source, "rope_scaling.truncate", scaling["truncate"], "true")
    mscale_all = scaling.get("mscale_all_dim")
    if not mscale_all:
        raise _refuse(
            source, "rope_scaling.mscale_all_dim", mscale_all, "a number > 0 (europa's mscale)"
        )
    factor = scaling.get("attention_factor")
    equal = math.isclose(float(scaling.get("mscale") or 0), float(mscale_all))
    if not (equal or (factor is not None and math.isclose(float(factor), 1.0))):
        raise _refuse(
            source,
            "rope_scaling.mscale",
            scaling.get("mscale"),
            f"equal to mscale_all_dim ({mscale_all}): europa's RoPE does not scale cos/sin",
        )
    return out | {
        "rope_factor": float(scaling["factor"]),
        "rope_original_seq_len": int(scaling["original_max_position_embeddings"]),
        "rope_beta_fast": float(scaling.get("beta_fast") or 32.0),
        "rope_beta_slow": float(scaling.get("beta_slow") or 1.0),
        "mscale": float(mscale_all),
    }


def _require(config: dict[str, Any], source: str, key: str, allowed: tuple, expected: str) -> None:
    if key in config and config[key] not in allowed:
        raise _refuse(source, key, config[key], expected)


def model_table_from_hf(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``[model]`` table (as TOML values) that describes the checkpoint's model."""
    _require(config, source, "hidden_act", ("silu",), '"silu"')
    _require(config, source, "tie_word_embeddings", (False,), "false")
    _require(config, source, "attention_bias", (False,), "false")
    _require(config, source, "rope_interleave", (True,), "true (europa rotates interleaved pairs)")
    _require(config, source, "scoring_func", ("sigmoid",), '"sigmoid"')
    _require(config, source, "topk_method", ("noaux_tc",), '"noaux_tc"')
    _require(config, source, "moe_layer_freq", (1,), "1 (every layer after the dense ones is MoE)")
    heads = config["num_attention_heads"]
    _require(config, source, "num_key_value_heads", (heads, None), f"{heads} (MLA)")
    if not config.get("n_shared_experts"):
        raise _refuse(source, "n_shared_experts", config.get("n_shared_experts"), "at least 1")
    groups, limited = config.get("n_group") or 1, config.get("topk_group") or 1
    grouped = groups > 1
    try:
        table = {
            "vocab_size": config["vocab_size"],
            "dim": config["hidden_size"],
            "n_layers": config["num_hidden_layers"],
            "n_dense_layers": config.get("first_k_dense_replace", 0),
            "n_heads": heads,
            "q_lora_rank": config.get("q_lora_rank") or 0,
            "kv_lora_rank": config["kv_lora_rank"],
            "qk_nope_head_dim": config["qk_nope_head_dim"],
            "qk_rope_head_dim": config["qk_rope_head_dim"],
            "v_head_dim": config["v_head_dim"],
            "dense_hidden_dim": config["intermediate_size"],
            "moe_hidden_dim": config["moe_intermediate_size"],
            "num_experts": config["n_routed_experts"],
            "num_shared_experts": config["n_shared_experts"],
            "top_k": config["num_experts_per_tok"],
            "score_func": "sigmoid",
            "route_norm": bool(config.get("norm_topk_prob", True)),
            "route_scale": float(config.get("routed_scaling_factor", 1.0)),
            "num_expert_groups": groups if grouped else 0,
            "num_limited_groups": limited if grouped else 0,
            "max_seq_len": config["max_position_embeddings"],
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        }
    except KeyError as err:
        raise CheckpointError(
            f"{source}: has no {err.args[0]!r}: expected a DeepSeek-V3 config.json"
        ) from None
    return table | _rope(config, source)


def check_model_matches(model: ModelConfig, table: dict[str, Any], source: str) -> None:
    """Every key of ``table`` that describes the weights equals ``[model]``'s."""
    for key, theirs in table.items():
        if key in NOT_COMPARED:
            continue
        ours = getattr(model, key)
        if isinstance(ours, float):
            same = math.isclose(ours, theirs, rel_tol=1e-9)
        else:
            same = ours == theirs
        if not same:
            raise ConfigError(
                f"model.{key} = {show(ours)}, but {source} gives {show(theirs)}: expected them "
                "to match (`europa config from-hf DIR` derives a [model] table from it)"
            )


def check_exportable(model: ModelConfig) -> None:
    """What transformers' DeepseekV3 cannot express is refused before any file is written."""
    if model.score_func != "sigmoid":
        raise ConfigError(
            f'model.score_func = {show(model.score_func)}: expected "sigmoid", the only '
            "router score function of Hugging Face's DeepseekV3"
        )
    if model.num_shared_experts < 1:
        raise ConfigError(
            "model.num_shared_experts = 0: expected at least 1; Hugging Face's DeepseekV3 "
            "always has a shared expert"
        )


def hf_config_from_model(model: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` for the model: what transformers, vLLM and SGLang read."""
    check_exportable(model)
    grouped = model.num_expert_groups > 0
    rope_scaling = None
    if model.rope_factor > 1.0:
        rope_scaling = {
            "type": "yarn",
            "factor": model.rope_factor,
            "original_max_position_embeddings": model.rope_original_seq_len,
            "beta_fast": model.rope_beta_fast,
            "beta_slow": model.rope_beta_slow,
            "mscale": model.mscale,
            "mscale_all_dim": model.mscale,
        }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v3",
        "vocab_size": model.vocab_size,
        "hidden_size": model.dim,
        "intermediate_size": model.dense_hidden_dim,
        "moe_intermediate_size": model.moe_hidden_dim,
        "num_hidden_layers": model.n_layers,
        "first_k_dense_replace": model.n_dense_layers,
        "moe_layer_freq": 1,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_heads,
        "q_lora_rank": model.q_lora_rank or None,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        "n_routed_experts": model.num_experts,
        "n_shared_experts": model.num_shared_experts,
        "num_experts_per_tok": model.top_k,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": model.route_norm,
        "routed_scaling_factor": model.route_scale,
        "n_group": model.num_expert_groups if grouped else 1,
        "topk_group": model.num_limited_groups if grouped else 1,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
