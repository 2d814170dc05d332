"""The keys of a runs file's tables and the check of each value: what ``europa.plan.reader``
accepts, key by key. A check returns the value (converted where it must be) or raises
``BadValue`` saying what was expected; the reader adds where."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from europa.plan.record import (
    DP_KINDS,
    EP_DISPATCHERS,
    FAMILIES,
    FLOPS_CONVENTIONS,
    OPTIMIZERS,
    PRECISION_PEAK,
    RECOMPUTE_MODULES,
    ROUTINGS,
    SCHEDULES,
    STATE_DTYPES,
    Published,
    Recompute,
)

# --- value checks: each returns the value or raises with what was expected ----------------


class BadValue(Exception):
    """A value that is not what its key expects (the reader adds where it is)."""


def _int(minimum: int, maximum: int | None = None) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise BadValue("a positive integer" if minimum == 1 else f"an integer ≥ {minimum}")
        if maximum is not None and value > maximum:
            raise BadValue(f"an integer from {minimum} to {maximum:,}")
        return value

    return check


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise BadValue("a positive number")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise BadValue("a non-empty string")
    return value


def _name(value: Any) -> str:
    """A name another table refers to (a model's, a gpu's, a generation's): one line."""
    if not isinstance(value, str) or not value or not value.isprintable():
        raise BadValue("a one-line printable string")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise BadValue("true or false")
    return value


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise BadValue("one of " + ", ".join(f'"{c}"' for c in choices))
        return value

    return check


def _peaks(value: Any) -> MappingProxyType[str, float]:
    if not isinstance(value, dict) or not value:
        raise BadValue("a table of dense TFLOP/s by precision, e.g. { bfloat16 = 989.0 }")
    out = {}
    for name, peak in value.items():
        try:
            out[name] = _number(peak)
        except BadValue:
            raise BadValue(f"a positive number for {name}") from None
    if "bfloat16" not in out:  # attention, the head and the routers run in bf16 always
        raise BadValue("a table with a bfloat16 peak, e.g. { bfloat16 = 989.0 }")
    return MappingProxyType(out)


def _recompute(value: Any) -> Recompute:
    if value in ("none", "full"):
        return Recompute(kind=value)
    if isinstance(value, list) and value and all(m in RECOMPUTE_MODULES for m in value):
        return Recompute(kind="selective", modules=frozenset(value))
    raise BadValue('"none", "full" or a list of modules from ' + ", ".join(RECOMPUTE_MODULES))


PUBLISHED_KEYS = ("tokens_per_s_per_gpu", "step_s", "tflops_per_gpu", "mfu")


def _published(value: Any) -> Published:
    if not isinstance(value, dict):
        raise BadValue("a table with any of " + ", ".join(PUBLISHED_KEYS))
    unknown = sorted(set(value) - set(PUBLISHED_KEYS))
    if unknown:
        raise BadValue(f"no key {unknown[0]}: expected only " + ", ".join(PUBLISHED_KEYS))
    try:
        return Published(**{k: _number(v) for k, v in value.items()})
    except BadValue as bad:
        raise BadValue(f"{bad} in each figure") from None


# --- the keys of each table: name -> check (required keys first) --------------------------

POSITIVE, COUNT = _int(1), _int(0)
# Layers are planned one by one (which pipeline rank holds each): far more than any model has
LAYERS = _int(1, 10_000)
GPU_REQUIRED = {
    "id": _name,
    "peak_tflops": _peaks,
    "hbm_gb": _number,
    "hbm_tbps": _number,
    "gpus_per_node": POSITIVE,
    "nvlink_gbps": _number,
    "network_gbps": _number,
}
GPU_REQUIRED["generation"] = _name
GPU_REQUIRED["sm_count"] = POSITIVE
GPU_OPTIONAL = {"source": _text}


def _efficiency(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise BadValue("a share of the peak, above 0 and at most 1")
    return float(value)


def _efficiencies(value: Any) -> MappingProxyType[str, float]:
    if not isinstance(value, dict) or "bfloat16" not in value:
        raise BadValue("a table of shares of the peak by precision, e.g. { bfloat16 = 0.7 }")
    try:
        return MappingProxyType({name: _efficiency(v) for name, v in value.items()})
    except BadValue as bad:
        raise BadValue(f"{bad}, for each precision") from None


GENERATION_REQUIRED = {
    "id": _name,
    "gemm": _efficiencies,
    "grouped_gemm": _efficiency,
    "attention": _efficiency,
    "memory": _efficiency,
    "nvlink": _efficiency,
    "network": _efficiency,
    "overlap": _efficiency,
}
GENERATION_OPTIONAL = {"fitted": _text}

MODEL_REQUIRED = {
    "id": _name,
    "family": _one_of(FAMILIES),
    "n_layers": LAYERS,
    "dim": POSITIVE,
    "n_heads": POSITIVE,
    "vocab_size": POSITIVE,
}
MODEL_OPTIONAL = {"tied_embeddings": _flag, "source": _text}
_MOE_REQUIRED = {"moe_hidden_dim": POSITIVE, "num_experts": POSITIVE, "top_k": POSITIVE}
_MOE_OPTIONAL = {
    "num_shared_experts": COUNT,
    "n_dense_layers": COUNT,
    "dense_hidden_dim": POSITIVE,
    "mtp_modules": COUNT,
}
_GQA = {"n_kv_heads": POSITIVE, "head_dim": POSITIVE}
FAMILY_REQUIRED = {
    "mla-moe": {
        "q_lora_rank": COUNT,
        "kv_lora_rank": POSITIVE,
        "qk_nope_head_dim": POSITIVE,
        "qk_rope_head_dim": POSITIVE,
        "v_head_dim": POSITIVE,
        **_MOE_REQUIRED,
    },
    "gqa-moe": {**_GQA, **_MOE_REQUIRED},
    "gqa-dense": {**_GQA, "ffn_hidden_dim": POSITIVE},
}
FAMILY_OPTIONAL = {
    "mla-moe": _MOE_OPTIONAL,
    "gqa-moe": {**_MOE_OPTIONAL, "qk_norm": _flag},
    "gqa-dense": {"qk_norm": _flag, "mtp_modules": COUNT},
}

RUN_REQUIRED = {
    "id": _name,
    "model": _name,
    "gpu": _name,
    "gpus": POSITIVE,
    "precision": _one_of(tuple(PRECISION_PEAK)),
    "seq_len": POSITIVE,
    "global_batch": POSITIVE,
}
# Optional run keys and what the planner takes where the file leaves one out (None: worked
# out from the others). Each one filled in is listed in the run's ``assumed``.
RUN_OPTIONAL: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "micro_batch": (POSITIVE, 1),
    "tp": (POSITIVE, 1),
    "sequence_parallel": (_flag, None),  # on wherever tp > 1
    "cp": (POSITIVE, 1),
    "pp": (POSITIVE, 1),
    "vp": (POSITIVE, 1),
    "pipeline_schedule": (_one_of(SCHEDULES), None),  # interleaved with vp > 1, else 1f1b
    "dp": (POSITIVE, None),  # gpus / (tp × cp × pp)
    "optimizer_sharding": (_one_of(DP_KINDS), "ddp"),
    "dp_shard": (POSITIVE, None),
    "ep": (POSITIVE, 1),
    "etp": (POSITIVE, 1),
    "recompute": (_recompute, Recompute()),
    "optimizer": (_one_of(OPTIMIZERS), "adam"),
    "state_dtype": (_one_of(STATE_DTYPES), "float32"),
    "routing": (_one_of(ROUTINGS), "balanced"),
    "ep_dispatcher": (_one_of(EP_DISPATCHERS), "alltoall"),
    "ep_overlap": (_flag, False),
    "reshard_after_forward": (_flag, True),
    "flops_convention": (_one_of(tuple(FLOPS_CONVENTIONS)), "megatron"),
    "published": (_published, None),
    "source": (_text, None),
    "quote": (_text, None),
    "notes": (_text, None),
}
# Said about a run whether or not the file states them: defaults here are not assumptions.
NOT_ASSUMED = {"published", "source", "quote", "notes", "dp_shard", "sequence_parallel"}
