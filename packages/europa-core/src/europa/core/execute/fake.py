"""Fake tensors for a rank's program: device memory without storage, host arithmetic for real.

Design note. ``FakeDeviceMode`` is torch's ``FakeTensorMode`` with three rules added for a
whole training program rather than a traced function:

* **host index arithmetic runs for real.** The program computes some things on the host
  from tensors that never touch the device: the device mesh's rank tables, a dispatcher's
  expert-to-rank maps, index lists read back with ``tolist()``. An op whose inputs are all
  real CPU tensors, whose output stays on the CPU, and which makes no float data (a
  factory of an integer or bool dtype, at most ``HOST_INDEX_LIMIT`` elements) runs for
  real; everything else (every device tensor, every float or large host buffer: offloaded
  activations, host optimizer state) is fake. A real tensor meeting a fake one becomes
  fake.
* **a read of a fake float is answered, and counted.** A loss or a gradient norm read back
  (``.item()``) gets ``STANDIN_FLOAT`` and its call site is recorded
  (``scalar_reads``); a read of a fake *integer* is refused: integers size buffers, and
  the only ones a program may take without data are those a routing model gives.
* **ops with no meaning here are no-ops**: ``record_stream`` (the caching allocator's
  bookkeeping).

Observers (``OpObserver``) see every fake op with its outputs: the memory ledger and the
host-copy count. Autograd runs device work on a thread of its own, which does not inherit
the flag that keeps ``torch.tensor(..., device=...)`` from allocating on the device for
real (``_only_lift_cpu_tensors``), so the mode sets it in whichever thread it runs.
"""

from __future__ import annotations

import math
import threading
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map_only

aten = torch.ops.aten
HOST_INDEX_LIMIT = 1 << 22  # elements of a real host index tensor made from nothing
STANDIN_FLOAT = 1.0
_INDEX_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
_SIZED_FACTORIES = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
}
_NO_OPS = {aten.record_stream.default}
_TORCH_DIR = str(Path(torch.__file__).parent)


class DataDependentRead(RuntimeError):
    """The program read an integer it could only have from data."""


class OpObserver(Protocol):
    def op(self, func, args: tuple, kwargs: dict, out: Any) -> None: ...


class FakeDeviceMode(FakeTensorMode):
    def __init__(self, observers: Sequence[OpObserver] = ()) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.observers = list(observers)
        self.scalar_reads: Counter[str] = Counter()
        self._nesting = threading.local()  # .depth: ops this mode is dispatching, per thread

    @property
    def avoid_device_init(self) -> bool:  # never allocate on a device for real
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch._C._only_lift_cpu_tensors():
            torch._C._set_only_lift_cpu_tensors(True)
        if func in _NO_OPS:
            return None
        if func is aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return self._answer_read(args[0])
        # An op the fake mode dispatches while running another (a decomposition's factory)
        # is part of that op: fake, whatever it makes.
        depth = getattr(self._nesting, "depth", 0)
        if not depth and _host_index_op(func, args, kwargs):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        args, kwargs = tree_map_only(torch.Tensor, self._fake, (args, kwargs))
        self._nesting.depth = depth + 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._nesting.depth = depth
        for observer in self.observers:
            observer.op(func, args, kwargs, out)
        return out

    def _fake(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, FakeTensor):
            return tensor
        with unset_fake_temporarily():
            return self.from_tensor(tensor)

    def _answer_read(self, tensor: FakeTensor) -> float:
        site = caller_outside_torch()
        if not tensor.dtype.is_floating_point:
            raise DataDependentRead(
                f"{site}: reads a {tensor.dtype} value back to the host, which a fake tensor "
                "does not hold; expected every count a program sizes buffers with to come "
                "from the routing model"
            )
        self.scalar_reads[site] += 1
        return STANDIN_FLOAT


def caller_outside_torch() -> str:
    """``file:line`` of the innermost frame outside torch (and this package)."""
    here = str(Path(__file__).parent)
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith((_TORCH_DIR, here)):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def _host_index_op(func, args, kwargs) -> bool:
    flat, _ = tree_flatten((args, kwargs))
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    if any(isinstance(t, FakeTensor) for t in tensors) or kwargs.get("pin_memory"):
        return False
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return False
    if tensors:
        return all(t.device.type == "cpu" for t in tensors)
    dtype = kwargs.get("dtype")
    if func in _SIZED_FACTORIES:
        return dtype in _INDEX_DTYPES and math.prod(args[0]) <= HOST_INDEX_LIMIT
    return dtype is None or dtype in _INDEX_DTYPES
