"""Refuse, before allocating anything, a model whose weights, gradients and
optimizer state cannot fit the memory of the machine it was asked to run on.

This is a floor (activations come on top), not the planner: it exists so that
``europa train kimi-k2`` on a workstation says so in one line instead of
being killed by the kernel half-way through materialising a trillion
parameters.
"""

from __future__ import annotations

import torch

from europa.core.config.schema import EuropaConfig
from europa.core.errors import ResourceError
from europa.core.model.counting import ParameterCounts

# Sharded master weights and gradients stay fp32 in both dtypes (bf16 is
# FSDP2 mixed precision: only gathered copies and compute are bf16).
_MASTER_AND_GRADIENT_BYTES = 4 + 4
_OPTIMIZER_FP32_COPIES = {"adamw": 2, "muon": 1}  # muon: momentum; its AdamW share is small
GIB = 1024**3


def bytes_per_rank(config: EuropaConfig, counts: ParameterCounts, world_size: int) -> int:
    optimizer = 4 * _OPTIMIZER_FP32_COPIES[config.optimizer.name]
    return counts.total * (_MASTER_AND_GRADIENT_BYTES + optimizer) // world_size


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ResourceError("memory: /proc/meminfo has no MemAvailable line; expected Linux")


def _human(n: int) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_fits(
    config: EuropaConfig,
    counts: ParameterCounts,
    device: torch.device,
    world_size: int,
    local_ranks: int = 1,
) -> None:
    """``local_ranks`` processes share this device's memory (CPU workers on one node)."""
    need = bytes_per_rank(config, counts, world_size)
    have = available_bytes(device) // max(1, local_ranks)
    if need > have:
        raise ResourceError(
            f"model ({config.preset}): {counts.total / 1e9:.2f} B parameters need at least "
            f"{_human(need)} per rank for weights, gradients and optimizer state over "
            f"{world_size} rank(s); {device.type} memory available per rank is {_human(have)}: "
            "expected more ranks or a smaller [model]"
        )
