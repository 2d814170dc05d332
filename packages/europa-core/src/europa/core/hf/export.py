"""``europa export-hf``: a run's DCP checkpoint → a Hugging Face checkpoint folder
(``config.json``, ``model-0000i-of-0000n.safetensors``, the index).

Design note. One process streams the checkpoint shard by shard: the output
files are planned from the shapes alone, then for each file DCP reads just the
tensors it holds (a run of experts is one region of a stacked ``[E, out, in]``
tensor, read through ``OwnedChunk``, DCP's own chunk protocol), which are written
and dropped. So the most a process holds is one output file's worth of
tensors, whatever layout (FSDP2 or FlexShard) and world size wrote the
checkpoint. The folder is written as ``.NAME.partial`` and renamed when
complete.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from europa.core.checkpoint.reader import load_restricted, read_metadata, saved_checks
from europa.core.checkpoint.store import find_checkpoint
from europa.core.errors import CheckpointError, ConfigError
from europa.core.hf.config_map import check_exportable, hf_config_from_model
from europa.core.hf.names import Source, hf_tensors, name_map
from europa.core.hf.reader import INDEX
from europa.spec.dcp import OwnedChunk

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class _File:
    name: str = ""
    sources: list[Source] = field(default_factory=list)
    nbytes: int = 0


def _plan_files(sources: list[Source], itemsize: int, max_bytes: int) -> list[_File]:
    files = [_File()]
    for s in sources:
        nbytes = math.prod(s.shape) * itemsize
        if files[-1].sources and files[-1].nbytes + nbytes > max_bytes:
            files.append(_File())
        files[-1].sources.append(s)
        files[-1].nbytes += nbytes
    for i, f in enumerate(files):
        f.name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
    return files


def _check_checkpoint(path: Path, shapes: dict[str, torch.Size]) -> set[str]:
    """The model tensors the checkpoint holds, each with the shape the config gives it."""
    saved = read_metadata(path).state_dict_metadata
    present = set()
    for name, shape in shapes.items():
        entry = saved.get(f"model.{name}")
        if entry is None:
            if name.endswith("expert_bias_E"):
                continue
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no model.{name}: expected a checkpoint "
                "written with the run's config"
            )
        if tuple(entry.size) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {str(path)!r}: model.{name} is {list(entry.size)}, the run's "
                f"config gives {list(shape)}: expected equal shapes"
            )
        present.add(name)
    return present


def _read_file(path: Path, file: _File, shapes, present: set[str]) -> dict[str, torch.Tensor]:
    """This output file's tensors, read from the checkpoint with one DCP load."""
    runs: dict[str, list[Source]] = {}
    for s in file.sources:
        runs.setdefault(s.name, []).append(s)
    state: dict[str, Any] = {}
    locals_: dict[str, torch.Tensor] = {}
    for name, run in runs.items():
        if name not in present:
            continue
        shape = shapes[name]
        if len(shape) == 3:
            first = run[0].index
            local = torch.empty(len(run), *shape[1:])
            state[f"model.{name}"] = OwnedChunk(shape, local, (first, 0, 0))
        else:
            local = torch.empty(shape)
            state[f"model.{name}"] = local
        locals_[name] = local
    if state:
        with warnings.catch_warnings():  # one process on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            metadata, pieces = saved_checks(path)
            load_restricted(state, path, metadata=metadata, pieces=pieces, no_dist=True)
    out = {}
    for name, run in runs.items():
        local = locals_.get(name)
        for j, s in enumerate(run):
            if local is None:  # a routing bias europa did not keep: zero, as HF initialises it
                out[s.hf_key] = torch.zeros(s.shape)
            else:
                out[s.hf_key] = local[j] if len(shapes[name]) == 3 else local
    return out


def _cast(key: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # The routing bias stays fp32, as DeepSeek-V3 publishes it and transformers keeps it.
    keep = key.endswith("e_score_correction_bias")
    return (tensor if keep else tensor.to(dtype)).contiguous()


def _prepare_out(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out = {str(out)!r}: already exists; expected a new or empty folder")
    staged = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    return staged


def _as_trained(config, run_dir: Path):
    """``[model]`` with the routing groups the run trained with: node-limited routing
    (``parallel.ep_max_nodes_per_token``) sets them from the nodes, as ``job.json`` records."""
    import dataclasses

    from europa.core.run_dir import JOB_FILE

    if not config.parallel.ep_max_nodes_per_token:
        return config.model
    job_file = run_dir / JOB_FILE
    groups = json.loads(job_file.read_text()).get("routing_groups") if job_file.is_file() else None
    if not groups:
        raise ConfigError(
            f"parallel.ep_max_nodes_per_token = {config.parallel.ep_max_nodes_per_token}: "
            f"{job_file} does not say the routing groups the run trained with; expected the "
            "job.json of a run started by europa train"
        )
    return dataclasses.replace(config.model, **groups)


def export_hf(
    run_dir: Path,
    out: Path,
    *,
    step: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Write the run's checkpoint ``step`` (default: the newest) to ``out`` in
    Hugging Face's format. Returns a summary."""
    from europa.core.model import build_moe_model, model_spec
    from europa.core.session import load_run_config

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype = {dtype!r}: expected one of {', '.join(DTYPES)}")
    if max_shard_bytes <= 0:
        raise ConfigError(f"--max-shard-size = {max_shard_bytes}: expected a size > 0")
    config, _ = load_run_config(run_dir)
    model_config = _as_trained(config, run_dir)
    check_exportable(model_config)
    done, path = find_checkpoint(run_dir, step)
    model = build_moe_model(model_config)
    shapes = hf_tensors(model)
    present = _check_checkpoint(path, shapes)
    sources = [
        s for per_name in name_map(model_spec(config.model), shapes).values() for s in per_name
    ]
    files = _plan_files(sources, DTYPES[dtype].itemsize, max_shard_bytes)
    staged = _prepare_out(out)
    weight_map, total = {}, 0
    for file in files:
        tensors = _read_file(path, file, shapes, present)
        tensors = {k: _cast(k, v, DTYPES[dtype]) for k, v in tensors.items()}
        save_file(tensors, str(staged / file.name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file.name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (staged / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    hf_config = hf_config_from_model(model_config, dtype)
    (staged / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if out.exists():
        out.rmdir()  # checked empty above
    staged.rename(out)
    return {"step": done, "files": len(files), "tensors": len(weight_map), "bytes": total}
