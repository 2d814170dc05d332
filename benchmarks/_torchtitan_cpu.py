"""torchtitan 0.3.0's own ``Trainer`` on CPU gloo ranks: ``_torchtitan_trainer`` with
torchtitan patched first.

Its Trainer assumes an accelerator: the device type it detects at import falls back to
"cuda", FSDP divides gradients with PREMUL_SUM (gloo has none) and it calls
``torch.distributed.set_timeout`` (torch 2.13 has only the private ``_set_pg_timeout``).
This launcher changes those for the process it runs in, and nothing in torchtitan's
training code:

* the device type and module torchtitan reads at import are "cpu" and a CPU module;
* FSDP sums instead of PREMUL_SUM (``set_force_sum_reduction_for_comms``) wherever
  torchtitan turns off FSDP's own gradient division;
* ``torch.distributed.set_timeout`` is torch's ``_set_pg_timeout``.

Import this module only in a fresh process (a spawned rank): it must patch before
torchtitan is first imported.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch._utils
import torch.distributed


class _CpuDeviceModule:
    """The calls torchtitan makes on its device module (``torch.cuda`` on a GPU)."""

    @staticmethod
    def set_device(device: Any) -> None:  # one CPU device per process
        return None

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return type("CpuProperties", (), {"total_memory": total, "name": "cpu"})()

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}  # torchtitan logs -1 for the peaks it cannot read

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def _import_torchtitan_for_cpu() -> None:
    if "torchtitan" in os.sys.modules:
        raise RuntimeError("torchtitan was imported before the CPU launcher could patch it")
    detect, module_of = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda kind=None: (
        _CpuDeviceModule if kind == "cpu" else module_of(kind)
    )
    try:
        import torchtitan.tools.utils  # noqa: F401  (reads the device type once, here)
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = (
            detect,
            module_of,
        )
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout

    import torchtitan.distributed.fsdp as titan_fsdp

    divide_by_one = titan_fsdp.disable_fsdp_gradient_division

    def divide_by_one_with_sums(model: torch.nn.Module) -> None:
        divide_by_one(model)
        for module in model.modules():
            if isinstance(module, titan_fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = divide_by_one_with_sums


_import_torchtitan_for_cpu()

from _torchtitan_trainer import (  # noqa: E402  (after the patch)
    EuropaBatches,
    model_spec,
    routing_of,
    run_trainer,
    trainer_config,
)

__all__ = ["EuropaBatches", "model_spec", "routing_of", "run_trainer", "trainer_config"]
