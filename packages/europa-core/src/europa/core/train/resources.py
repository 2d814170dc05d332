"""Refuse, before allocating anything, a run that cannot fit the memory of the
machine it was asked to run on.

The figures are the planner's (``europa.core.plan``), computed for this
machine with its memory measured now, so ``europa train`` refuses with the
same line ``europa plan --hardware <this kind of machine>`` prints.
"""

from __future__ import annotations

import torch

from europa.core.config.schema import EuropaConfig
from europa.core.errors import ResourceError


def _meminfo_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ResourceError("memory: /proc/meminfo has no MemAvailable line; expected Linux")


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return _meminfo_available()


def check_fits(
    config: EuropaConfig,
    plugins,
    device: torch.device,
    world_size: int,
    local_ranks: int = 1,
    model=None,
    ranks_per_node: int = 0,
) -> None:
    """``local_ranks`` processes share this device's memory (CPU workers on one
    node) and, on any machine, its host memory. ``ranks_per_node``: the nodes the
    ranks form (their expert exchanges), as the job resolved them."""
    from europa.core.plan import make_plan, this_machine

    share = max(1, local_ranks)
    device_bytes = available_bytes(device) // (share if device.type == "cpu" else 1)
    host_bytes = _meminfo_available() // share
    hardware = this_machine(device.type, device_bytes, host_bytes)
    per_node = ranks_per_node or config.parallel.ranks_per_node or local_ranks
    make_plan(config, plugins, hardware, world_size, model=model, ranks_per_node=per_node).check()
