"""Reusable host buffers: after the first step, offloading allocates nothing.

Buffers are flat byte tensors, pinned when an accelerator is present (so
device-to-host copies can run asynchronously), grouped in size classes of a
quarter octave (a request takes the smallest class that fits, wasting at most
a quarter), and handed back to the pool once the data they hold has been used.
A byte limit turns growth past the host-memory budget into a one-line error
instead of an out-of-memory kill.
"""

from __future__ import annotations

import torch

from europa.offload.errors import HostMemoryExceeded
from europa.spec.tags import mark_memory
from europa.spec.units import GIB, MIB

_MIN_CLASS = 4096


def size_class(nbytes: int) -> int:
    """The smallest size of the form 2**k * (4 + j) / 4 (j = 0..3) holding ``nbytes``."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    octave = 1 << (nbytes.bit_length() - 1)
    step = octave // 4
    return -(-nbytes // step) * step


class HostBufferPool:
    def __init__(self, *, pin: bool | None = None, limit_bytes: int | None = None) -> None:
        self.pin = torch.accelerator.is_available() if pin is None else pin
        self.limit_bytes = limit_bytes
        self.reserved_bytes = 0  # held outside the pool by its owner (optimizer state)
        self.allocations = 0
        self.allocated_bytes = 0
        self.peak_in_use_bytes = 0
        self._in_use = 0
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (uint8, flat)."""
        size = size_class(nbytes)
        free = self._free.get(size)
        if free:
            buffer = free.pop()
        else:
            self._check_limit(size)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            mark_memory(buffer, "activations")
            self.allocations += 1
            self.allocated_bytes += size
        self._in_use += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self._in_use)
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        self._in_use -= buffer.numel()
        self._free.setdefault(buffer.numel(), []).append(buffer)

    def _check_limit(self, size: int) -> None:
        if self.limit_bytes is None:
            return
        total = self.allocated_bytes + self.reserved_bytes + size
        if total > self.limit_bytes:
            raise HostMemoryExceeded(
                f"offload.host_memory_gib = {self.limit_bytes / GIB:.3g}: this rank would hold "
                f"{human(total)} in host memory ({human(self.reserved_bytes)} of optimizer "
                f"state, {human(self.allocated_bytes + size)} of saved activations); expected "
                "a larger budget, a larger offload.min_tensor_kib, more blocks kept on the "
                "device (offload.keep_last_blocks) or more ranks"
            )


def on_accelerator(device: torch.device) -> bool:
    """A device with memory of its own (CUDA or any other accelerator): copies to the host
    are real and asynchronous."""
    return device.type not in ("cpu", "meta")


def human(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.2f} MiB"
