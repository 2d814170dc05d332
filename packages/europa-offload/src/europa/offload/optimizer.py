"""Optimizer state in host memory, streamed to the device chunk by chunk for ``step()``.

Design note. Between steps every tensor of the wrapped optimizer's state
(moments, momentum buffers) lives in host memory, pinned when an accelerator is present.
``step()`` walks the parameters in chunks of at most ``chunk_bytes`` of state:
it copies a chunk's state to the parameters' device, runs the wrapped
optimizer on that chunk alone (the other parameters' gradients are hidden for
the moment: torch's optimizers, europa-core's ``MuonWithAdamW`` and
europa-flexshard's optimizer all skip a parameter whose ``.grad`` is None), and
copies the state back into its host buffer. The maths is the wrapped
optimizer's, untouched, so results are identical. The device holds one chunk of
state at a time, instead of all of it through forward and backward. The first
step creates the state on the device, as the optimizer always does; it moves
to the host after that step.

On a CPU-only machine host and device are the same memory: nothing moves,
though ``step()`` still walks the chunks (which is how the tests check that
chunked stepping changes no result).

Why not FSDP2's ``CPUOffloadPolicy``: it is given to ``fully_shard`` when the
layout is built (a plugin cannot add it to core's layout afterwards), it
also moves parameters and gradients and steps on the CPU, and it does not
exist for europa-flexshard's layout. This wrapper works on any optimizer whose
state is plain tensors; DTensor state (core's FSDP2 layout) on a GPU is
refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from europa.offload.errors import OffloadError
from europa.offload.pool import on_accelerator
from europa.spec.muon import closure_loss
from europa.spec.tags import mark_memory


class OffloadedOptimizer:
    """Wraps ``optimizer``; everything but ``step()`` is delegated to it."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, chunk_bytes: int = 256 << 20) -> None:
        if chunk_bytes < 1:
            raise OffloadError(f"chunk_bytes = {chunk_bytes}: expected an integer >= 1")
        self.optimizer = optimizer
        self.chunk_bytes = chunk_bytes
        self.streamed_bytes = 0
        self._host: dict[tuple[int, str], torch.Tensor] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    @property
    def host_state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host.values())

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        chunks = list(self._chunks(params))
        on_device = [p.device for p in params if on_accelerator(p.device)]
        if len(chunks) <= 1 and not on_device:
            self.optimizer.step()
            return loss
        grads = {id(p): p.grad for p in params}
        for p in params:
            p.grad = None
        try:
            for chunk in chunks:
                for p in chunk:
                    p.grad = grads[id(p)]
                    self._state_to(p, p.device)
                self.optimizer.step()
                for p in chunk:
                    self._state_to_host(p)
                    p.grad = None
        finally:
            for p in params:
                p.grad = grads[id(p)]
        if on_device:
            # The host buffers are complete before anyone (a checkpoint) reads them.
            torch.accelerator.current_stream(on_device[0]).synchronize()
        return loss

    def _chunks(self, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        chunk: list[torch.Tensor] = []
        size = 0
        for p in params:
            state = self._state_bytes(p) or p.numel() * p.element_size()
            if chunk and size + state > self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(p)
            size += state
        if chunk:
            yield chunk

    def _state_bytes(self, p: torch.Tensor) -> int:
        return sum(
            v.numel() * v.element_size()
            for v in self.optimizer.state.get(p, {}).values()
            if isinstance(v, torch.Tensor) and v.ndim > 0
        )

    def _tensors(self, p: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for key, value in self.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                if hasattr(value, "to_local"):
                    raise OffloadError(
                        "offload.optimizer_state = true: this optimizer's state is DTensor "
                        "(core's FSDP2 layout); expected -p flexshard, or "
                        "offload.optimizer_state = false"
                    )
                yield key, value

    def _state_to(self, p: torch.Tensor, device: torch.device) -> None:
        state = self.optimizer.state.get(p, {})
        for key, value in list(self._tensors(p)):
            if value.device != device:
                state[key] = value.to(device, non_blocking=True)
                self.streamed_bytes += value.numel() * value.element_size()

    def _state_to_host(self, p: torch.Tensor) -> None:
        if not on_accelerator(p.device):
            return  # host and device are one memory
        state = self.optimizer.state[p]
        for key, value in list(self._tensors(p)):
            host = self._host.get((id(p), key))
            if host is None:
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                mark_memory(host, "optimizer_state")
                self._host[(id(p), key)] = host
            host.copy_(value, non_blocking=True)
            state[key] = host
            self.streamed_bytes += value.numel() * value.element_size()
