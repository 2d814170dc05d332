"""Activation checkpointing whose one recomputation serves a split backward.

torch's non-reentrant checkpoint recomputes a block once for each backward pass (each
autograd graph task). The split-backward schedules (ZBV, DualPipeV) take a block's
backward in two passes, input gradients first and weight gradients later, so with torch's
checkpoint the block's forward runs a third time for the weight half, and everything it
counts (an MoE layer's tokens per expert) is counted once more for those micro-batches
than for the others. Here the first pass that needs the block's activations recomputes
them, and both passes read that one recomputation: it lives from the input half to the
weight half, as a split backward's activations do without checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks


def checkpoint_once(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping none of the tensors its backward needs: they are
    recomputed, once, when a backward pass first asks for one of them."""
    recomputation = _Recomputation(fn, args, kwargs)
    with saved_tensors_hooks(recomputation.pack, recomputation.unpack):
        return fn(*args, **kwargs)


_TENSOR = object()  # where a tensor input stood among the arguments


class _SavedInputs(torch.autograd.Function):
    """Saves a block's tensor inputs as every saved tensor is saved, so that hooks around
    the block (europa-offload's) move them too; its output is the handle to them."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> None:
        raise AssertionError("the saved inputs' handle is never differentiated")


class _Recomputation:
    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.fn, self.kwargs = fn, kwargs
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.wants_grad = [t.requires_grad for t in tensors]
        self.args = [_TENSOR if isinstance(a, torch.Tensor) else a for a in args]
        self.inputs = _SavedInputs.apply(torch.empty(0, requires_grad=True), *tensors)
        self.packed: list[tuple[torch.Size, torch.dtype]] = []  # what forward saved, in order
        self.saved: list[torch.Tensor] | None = None
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self.cpu_rng = torch.get_rng_state()
        self.device_rng = (
            torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        )
        self.autocast = {
            kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in {"cpu", self.device.type}
        }

    def pack(self, tensor: torch.Tensor) -> int:
        self.packed.append((tensor.shape, tensor.dtype))
        return len(self.packed) - 1

    def unpack(self, index: int) -> torch.Tensor:
        if self.saved is None:
            self.saved = self._recompute()
        return self.saved[index]

    def _recompute(self) -> list[torch.Tensor]:
        saved: list[torch.Tensor] = []

        def keep(tensor: torch.Tensor) -> None:
            saved.append(tensor.detach())

        def never(_: None) -> None:  # the recomputation's own graph is never run backward
            raise AssertionError("unreachable")

        tensors = iter(
            t.detach().requires_grad_(grad)
            for t, grad in zip(self.inputs.grad_fn.saved_tensors, self.wants_grad, strict=True)
        )
        inputs = [next(tensors) if a is _TENSOR else a for a in self.args]
        devices = [self.device] if self.device_rng is not None else []
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                torch.cuda.set_rng_state(self.device_rng, self.device)
            for kind, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(saved_tensors_hooks(keep, never))
            self.fn(*inputs, **self.kwargs)
        recomputed = [(t.shape, t.dtype) for t in saved]
        if recomputed != self.packed:
            raise RuntimeError(
                f"recomputation saved {len(recomputed)} tensors where the forward saved "
                f"{len(self.packed)} (or of other shapes or dtypes): the block's forward "
                "must run the same operations again"
            )
        return saved
