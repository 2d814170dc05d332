"""Runs files written by the tests: a small TOML writer for the flat tables of the
format (tomllib reads, it does not write) and a valid file to change one key of."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string is a JSON string
    return repr(value)


def runs_toml(**tables: list[dict[str, Any]]) -> str:
    """``runs_toml(gpu=[...], model=[...], run=[...])`` as TOML text."""
    out = []
    for kind, items in tables.items():
        for table in items:
            out.append(f"[[{kind}]]")
            out += [f"{key} = {_value(value)}" for key, value in table.items()]
            out.append("")
    return "\n".join(out)


def write_runs(path: Path, **tables: list[dict[str, Any]]) -> Path:
    path.write_text(runs_toml(**tables))
    return path


GPU = {
    "id": "test-gpu",
    "peak_tflops": {"bfloat16": 500.0, "float8": 1000.0},
    "hbm_gb": 64,
    "hbm_tbps": 2.0,
    "gpus_per_node": 4,
    "nvlink_gbps": 100.0,
    "network_gbps": 25.0,
    "generation": "hopper",
    "sm_count": 100,
}
MODEL = {
    "id": "small-moe",
    "family": "gqa-moe",
    "n_layers": 8,
    "dim": 1024,
    "n_heads": 16,
    "n_kv_heads": 4,
    "head_dim": 64,
    "moe_hidden_dim": 512,
    "num_experts": 16,
    "top_k": 2,
    "vocab_size": 32000,
}
RUN = {
    "id": "small-run",
    "model": "small-moe",
    "gpu": "test-gpu",
    "gpus": 16,
    "precision": "bfloat16",
    "seq_len": 2048,
    "global_batch": 64,
    "micro_batch": 1,
    "tp": 2,
    "pp": 2,
    "vp": 2,
    "cp": 1,
    "dp": 4,
    "ep": 4,
}


def valid_tables() -> dict[str, list[dict[str, Any]]]:
    return {"gpu": [dict(GPU)], "model": [dict(MODEL)], "run": [dict(RUN)]}
