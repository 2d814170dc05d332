"""Saved activations in host memory, copied asynchronously, prefetched back.

Design note. Each offloaded block's whole call runs inside
``torch.autograd.graph.saved_tensors_hooks``: a forward pre-hook (run first) enters
them and a forward hook (run last, even on an error) leaves them, so whatever else
wraps the block (activation checkpointing of its forward, hooks that save tensors
for it, such as europa-flexshard's kept expert exchanges) saves under them, in any
order of wrapping. When autograd saves a tensor there:

* *pack*: a tensor the policy offloads (large enough, not a weight, not in the
  last ``keep_last_blocks`` blocks) is copied into a pooled host buffer, and
  the hook returns a handle instead of the tensor, so the device storage goes
  as soon as the forward drops its own reference. On an accelerator (CUDA) the
  copy runs on a side stream that first waits for the compute stream (an event
  orders it), and ``record_stream`` keeps the caching allocator from reusing the
  source until the copy is done; nothing synchronises the device. Streams and
  events are torch's device-generic ones (``torch.Stream``, ``torch.Event``,
  ``torch.accelerator``), so any accelerator takes this path.
* *unpack* (backward): the first tensor asked for from block *b* is copied
  back at once, then the rest of block *b*'s and all of block *b − 1*'s
  tensors start coming back on the side stream, so they arrive while block *b*
  computes; a tensor is handed over once the compute stream waits on its
  copy's event. On a CPU-only machine the host
  buffer is the tensor: unpack hands it over without a copy.
* host buffers return to the pool at the end of the backward that used them
  (``queue_callback``), so the next micro-batch or step reuses them.

Weights are left alone: ``nn.Parameter`` (FSDP2's gathered parameters are
parameters) and tensors marked ``europa_gathered_parameter`` (europa-flexshard
marks the weights it gathers), or views of either; their layout already frees
and regathers them.

With activation checkpointing (core's ``activation_checkpointing.mode =
"full"``) the blocks save nothing but their inputs, which checkpointing keeps
through autograd's saved-tensor machinery under these hooks: exactly what is
offloaded then. The recomputed forward runs under checkpointing's own hooks.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from europa.offload.pool import HostBufferPool, on_accelerator
from europa.spec.autograd import in_backward
from europa.spec.tags import is_gathered


@dataclass(frozen=True)
class OffloadPolicy:
    """What to offload: saved tensors of at least ``min_bytes``, in blocks whose
    name matches one of ``patterns``, except the last ``keep_last_blocks`` of them
    (their tensors are needed first in backward)."""

    min_bytes: int = 1 << 20
    patterns: tuple[str, ...] = ("*",)
    keep_last_blocks: int = 1


@dataclass
class OffloadStats:
    bytes_offloaded: int = 0
    bytes_prefetched: int = 0
    bytes_reloaded: int = 0  # brought back on demand, not ahead
    saved_device_bytes: int = 0
    peak_saved_device_bytes: int = 0
    wait_s: float = 0.0  # host time blocked on copy events before reusing buffers

    def as_metrics(self, prefix: str = "offload_") -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in self.__dict__.items() if k != "saved_device_bytes"}


@dataclass
class _Handle:
    """A saved tensor that lives in a host buffer until backward asks for it."""

    buffer: torch.Tensor
    host: torch.Tensor
    device: torch.device
    block: int
    stored: torch.Event | None = None
    arrived: torch.Event | None = None
    on_device: torch.Tensor | None = None


@dataclass
class _Kept:
    tensor: torch.Tensor
    nbytes: int  # counted as a saved activation left on the device (0 for weights)


@dataclass
class _Backward:
    """Bookkeeping of one backward pass."""

    prefetched_blocks: set[int] = field(default_factory=set)
    used: list[_Handle] = field(default_factory=list)


def _is_weight(t: torch.Tensor) -> bool:
    for candidate in (t, t._base):
        if candidate is not None and (
            isinstance(candidate, nn.Parameter) or is_gathered(candidate)
        ):
            return True
    return False


class ActivationOffload:
    """Offloads the saved activations of the blocks it wraps (see the design note)."""

    def __init__(
        self, policy: OffloadPolicy | None = None, pool: HostBufferPool | None = None
    ) -> None:
        self.policy = policy or OffloadPolicy()
        self.pool = pool or HostBufferPool()
        self.stats = OffloadStats()
        self._blocks: list[str] = []
        self._by_block: dict[int, list[_Handle]] = {}
        self._backward: _Backward | None = None
        self._side: torch.Stream | None = None
        # A pipeline may run one micro-batch's backward beside another's forward (two
        # threads): the pool and the handles by block are shared between them.
        self._lock = threading.Lock()

    # -- wrapping ----------------------------------------------------------------------------

    def wrap(self, blocks: Iterable[tuple[str, nn.Module]]) -> list[str]:
        """Offload the saved tensors of each named block matching the policy; returns their
        names."""
        chosen = [
            (name, block)
            for name, block in blocks
            if any(fnmatch.fnmatchcase(name, p) for p in self.policy.patterns)
        ]
        keep = self.policy.keep_last_blocks
        offloaded = chosen[: max(0, len(chosen) - keep)]
        for index, (_, block) in enumerate(offloaded):
            self._hook(block, len(self._blocks) + index)
        self._blocks += [name for name, _ in offloaded]
        return [name for name, _ in offloaded]

    def _hook(self, block: nn.Module, index: int) -> None:
        entered: list[torch.autograd.graph.saved_tensors_hooks] = []

        def enter(module: nn.Module, args: Any) -> None:
            hooks = torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(index, t), self._unpack
            )
            hooks.__enter__()
            entered.append(hooks)

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            entered.pop().__exit__(None, None, None)

        block.register_forward_pre_hook(enter, prepend=True)
        block.register_forward_hook(leave, always_call=True)

    # -- pack --------------------------------------------------------------------------------

    def _pack(self, block: int, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        if _is_weight(tensor):
            return _Kept(tensor, 0)
        if nbytes < self.policy.min_bytes:
            self.stats.saved_device_bytes += nbytes
            self.stats.peak_saved_device_bytes = max(
                self.stats.peak_saved_device_bytes, self.stats.saved_device_bytes
            )
            return _Kept(tensor, nbytes)
        with self._lock:
            buffer = self.pool.take(nbytes)
        host = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        handle = _Handle(buffer, host, tensor.device, block)
        if on_accelerator(tensor.device):
            side = self._side_stream(tensor.device)
            side.wait_stream(torch.accelerator.current_stream(tensor.device))
            with side:
                host.copy_(tensor, non_blocking=True)
                handle.stored = torch.Event(device=tensor.device)
                handle.stored.record(side)
            tensor.record_stream(side)
        else:
            host.copy_(tensor)
        with self._lock:
            self._by_block.setdefault(block, []).append(handle)
        self.stats.bytes_offloaded += nbytes
        return handle

    # -- unpack ------------------------------------------------------------------------------

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            self.stats.saved_device_bytes -= packed.nbytes
            return packed.tensor
        handle: _Handle = packed
        backward = self._start_backward()
        backward.used.append(handle)
        if not on_accelerator(handle.device):
            return handle.host  # a CPU-only machine: the host buffer is the tensor
        if handle.on_device is None:  # not prefetched: bring it now, ahead of the rest
            self._copy_in(handle)
            self.stats.bytes_reloaded += handle.host.numel() * handle.host.element_size()
        self._prefetch(handle.block, backward)  # the rest of this block, then the one before
        self._prefetch(handle.block - 1, backward)
        torch.accelerator.current_stream(handle.device).wait_event(handle.arrived)
        tensor, handle.on_device = handle.on_device, None
        return tensor

    def _copy_in(self, handle: _Handle) -> None:
        # Allocated on the compute stream, which frees it after use; the side stream
        # first waits for the compute stream's earlier work (a previous user of that
        # memory), then for the tensor's own device-to-host copy.
        compute = torch.accelerator.current_stream(handle.device)
        handle.on_device = torch.empty_like(handle.host, device=handle.device)
        side = self._side_stream(handle.device)
        side.wait_stream(compute)
        with side:
            side.wait_event(handle.stored)
            handle.on_device.copy_(handle.host, non_blocking=True)
            handle.arrived = torch.Event(device=handle.device)
            handle.arrived.record(side)

    def _prefetch(self, block: int, backward: _Backward) -> None:
        if block < 0 or block in backward.prefetched_blocks:
            return
        backward.prefetched_blocks.add(block)
        for handle in self._by_block.get(block, ()):
            if handle.on_device is None and handle.arrived is None:
                self._copy_in(handle)
                self.stats.bytes_prefetched += handle.host.numel() * handle.host.element_size()

    def _start_backward(self) -> _Backward:
        if self._backward is None:
            self._backward = _Backward()
            if in_backward():  # release at its end
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        return self._backward

    def _end_backward(self) -> None:
        backward, self._backward = self._backward, None
        if backward is None:
            return
        used = {id(h) for h in backward.used}
        started = time.perf_counter()
        for handle in backward.used:  # a buffer is reused only once its copy is done
            event = handle.arrived or handle.stored
            if event is not None:
                event.synchronize()
        self.stats.wait_s += time.perf_counter() - started
        with self._lock:
            for block, handles in list(self._by_block.items()):
                kept = [h for h in handles if id(h) not in used]
                if kept:
                    self._by_block[block] = kept
                else:
                    del self._by_block[block]
            for handle in backward.used:
                self.pool.give_back(handle.buffer)

    # -- steps -------------------------------------------------------------------------------

    def release(self) -> None:
        """Hand every outstanding buffer back (tensors saved by a forward that never
        ran backward, e.g. under evaluation); call between steps."""
        for handles in self._by_block.values():
            for handle in handles:
                for event in (handle.stored, handle.arrived):
                    if event is not None:
                        event.synchronize()  # no copy may still use the buffer
                self.pool.give_back(handle.buffer)
        self._by_block.clear()
        self.stats.saved_device_bytes = 0

    def take_stats(self) -> OffloadStats:
        """This step's figures; the counters start again."""
        stats, self.stats = self.stats, OffloadStats()
        return stats

    def _side_stream(self, device: torch.device) -> torch.Stream:
        if self._side is None:
            self._side = torch.Stream(device=device)
        return self._side


def offload_activations(
    blocks: Sequence[nn.Module] | Iterable[tuple[str, nn.Module]],
    policy: OffloadPolicy | None = None,
    pool: HostBufferPool | None = None,
) -> ActivationOffload:
    """Offload the saved activations of ``blocks`` (modules, or ``(name, module)``
    pairs matched against ``policy.patterns``); returns the running offload."""
    items = list(blocks)
    named = [
        item if isinstance(item, tuple) else (str(index), item) for index, item in enumerate(items)
    ]
    offload = ActivationOffload(policy, pool)
    offload.wrap(named)
    return offload
