"""``europa import-hf DIR``: check a Hugging Face checkpoint against ``[model]`` and
plan its import on the meta device: which HF tensors feed which europa tensor,
and how many bytes each rank would read, without allocating a weight.

Per-rank bytes come from the layout the planner uses (``europa.core.plan``):
core's FSDP2 by default, or the one a layout plugin states through
``europa_plan`` (europa-flexshard does); a rank reads the elements it holds,
without FSDP2's padding. Every rank also reads the replicated routing biases
whole.

With only ``config.json`` present (the weights not yet downloaded), the plan
uses the checkpoint's declared dtype and cannot name shard files.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from europa.core.hf.config_map import check_model_matches, model_table_from_hf, read_config
from europa.core.hf.load import HFInitialiser
from europa.core.hf.names import hf_tensors, name_map
from europa.core.hf.reader import INDEX, SINGLE, HFCheckpoint
from europa.core.plan.assemble import plugin_plan
from europa.core.plan.shapes import ModelShapes
from europa.spec.units import human

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _abstract(name: str) -> str:
    name = re.sub(r"layers\.\d+\.", "layers.{L}.", name, count=1)
    return re.sub(r"experts\.\d+\.", "experts.{E}.", name)


def _declared_itemsize(config: dict[str, Any]) -> int:
    if config.get("quantization_config"):
        return 1  # block FP8; scales add 4 bytes per 128 x 128 block
    return _ITEMSIZE.get(config.get("torch_dtype") or config.get("dtype") or "bfloat16", 2)


def layout_elements_per_rank(plan: dict[str, Any], world_size: int) -> list[int]:
    """The parameter elements each global rank holds under ``plan["layout"]``."""
    layout = plan["layout"]
    local = zip(layout["muon_elements"], layout["adamw_elements"], strict=True)
    per_shard = [muon + adamw for muon, adamw in local]
    return [per_shard[r % layout["group_size"]] for r in range(world_size)]


def plan_import(
    directory: str | Path, job, plugins, world_size: int, *, per_tensor: bool = False
) -> dict[str, Any]:
    """Everything ``europa import-hf`` prints; ``job.config`` is the run's config."""
    from europa.core.model import model_spec

    config = job.config
    directory = Path(directory)
    hf_config = read_config(directory)
    source = str(directory / "config.json")
    check_model_matches(config.model, model_table_from_hf(hf_config, source), source)
    model = plugins.hook.europa_build_model(job=job)
    spec = model_spec(config.model)
    weights = (directory / INDEX).is_file() or (directory / SINGLE).is_file()
    files: dict[str, str] = {}
    skipped: list[str] = []
    if weights:
        init = HFInitialiser(model, spec, config.model, HFCheckpoint(directory))
        sources, skipped = init.sources, init.skipped
        infos = init.checkpoint.tensors
        files = {k: info.file for k, info in infos.items()}
        dtypes = {info.dtype for k, info in infos.items() if not k.endswith("_scale_inv")}
        itemsize = max(d.itemsize for d in dtypes)
    else:
        sources = name_map(spec, hf_tensors(model))
        itemsize = _declared_itemsize(hf_config)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    buffers = {n: s for n, s in hf_tensors(model).items() if n not in params}
    plan = plugin_plan(job, plugins, ModelShapes.of(model), itemsize=itemsize)
    layout_bytes = [n * itemsize for n in layout_elements_per_rank(plan, world_size)]
    buffer_bytes = sum(math.prod(s) * 4 for s in buffers.values())
    per_rank = [b + buffer_bytes for b in layout_bytes]
    mapping: dict[str, dict[str, Any]] = {}
    for name, srcs in sources.items():
        key = f"{_abstract(name)} <- {_abstract(srcs[0].hf_key)}"
        row = mapping.setdefault(key, {"tensors": 0, "bytes": 0})
        row["tensors"] += len(srcs)
        row["bytes"] += sum(math.prod(s.shape) for s in srcs) * itemsize
    result = {
        "checkpoint": str(directory),
        "weights_present": weights,
        "itemsize": itemsize,
        "world_size": world_size,
        "hf_tensors": sum(len(s) for s in sources.values()),
        "skipped": skipped,
        "total_bytes": sum(r["bytes"] for r in mapping.values()),
        "bytes_per_rank": per_rank,
        "mapping": mapping,
    }
    if per_tensor:
        result["tensors"] = {
            name: [
                {
                    "hf": s.hf_key,
                    "matrix": s.index,
                    "shape": list(s.shape),
                    "file": files.get(s.hf_key),
                }
                for s in srcs
            ]
            for name, srcs in sources.items()
        }
    return result


def describe(result: dict[str, Any]) -> str:
    per_rank = result["bytes_per_rank"]
    lines = [
        f"europa import-hf {result['checkpoint']}: {result['hf_tensors']} Hugging Face tensors "
        f"({human(result['total_bytes'], 2)} at {result['itemsize']} byte(s) an element) "
        f"map onto this [model]"
        + ("" if result["weights_present"] else " (config.json only: weights not checked)"),
    ]
    for key, row in result["mapping"].items():
        lines.append(f"  {key}  ({row['tensors']} tensors, {human(row['bytes'], 2)})")
    if result["skipped"]:
        lines.append(f"  skipped (MTP layers europa does not build): {len(result['skipped'])}")
    lines.append(
        f"bytes read per rank over {result['world_size']} rank(s): max "
        f"{human(max(per_rank), 2)}, mean {human(sum(per_rank) / len(per_rank), 2)}, "
        f"min {human(min(per_rank), 2)}"
    )
    return "\n".join(lines)
