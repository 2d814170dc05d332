"""europa tensor names ↔ Hugging Face tensor names, through torchtitan's adapter.

torchtitan's ``DeepSeekV3StateDictAdapter.to_hf`` knows the name map and splits
a stacked ``[E, out, in]`` expert tensor into E per-expert ``[out, in]``
tensors. We call it on meta tensors of each full shape, one europa tensor at a
time, and keep only what it says: which HF tensors hold matrix ``i`` of a
europa tensor, and with which shape. No data moves through the adapter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Source:
    """Matrix ``index`` of europa tensor ``name`` is HF tensor ``hf_key`` of ``shape``."""

    name: str
    index: int
    hf_key: str
    shape: tuple[int, ...]


def hf_tensors(model: nn.Module) -> dict[str, torch.Size]:
    """Every tensor a checkpoint holds for ``model`` (parameters and persistent buffers),
    by europa name, with its full shape: read before sharding."""
    shapes = {name: p.shape for name, p in model.named_parameters()}
    for module_name, module in model.named_modules():
        for local, buffer in module._buffers.items():
            if buffer is not None and local not in module._non_persistent_buffers_set:
                shapes[f"{module_name}.{local}" if module_name else local] = buffer.shape
    return shapes


def name_map(spec, shapes: dict[str, torch.Size]) -> dict[str, list[Source]]:
    """``{europa name: [Source for each of its matrices]}`` for the torchtitan
    ``DeepSeekV3Model.Config`` ``spec``."""
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    adapter = DeepSeekV3StateDictAdapter(spec, hf_assets_path=None)
    mapped: dict[str, list[Source]] = {}
    for name, shape in shapes.items():
        hf = adapter.to_hf({name: torch.empty(shape, device="meta")})
        sources = []
        for hf_key, tensor in hf.items():
            expert = _EXPERT.search(hf_key) if len(shape) == 3 else None
            index = int(expert.group(1)) if expert else 0
            sources.append(Source(name, index, hf_key, tuple(tensor.shape)))
        mapped[name] = sorted(sources, key=lambda s: s.index)
    return mapped
