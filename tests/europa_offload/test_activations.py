"""Activation offload: exact gradients, released storage, a pool that stops growing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from europa.core.config import load_config
from europa.core.model import build_moe_model, materialise
from europa.core.plugins.builtin.activation_checkpointing import checkpoint_blocks
from europa.offload import (
    HostBufferPool,
    HostMemoryExceeded,
    OffloadPolicy,
    offload_activations,
)
from europa.offload.activations import _Kept
from europa.offload.pool import size_class


def _model() -> nn.Module:
    model = build_moe_model(load_config("tiny").model)
    materialise(model, torch.device("cpu"), seed=0)
    return model


def _grads_after_steps(model: nn.Module, steps: int = 2) -> list[dict[str, torch.Tensor]]:
    grads = []
    for step in range(steps):
        tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(step))
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("recompute", [False, True])
def test_gradients_are_bit_identical_with_and_without_offload(recompute):
    plain = _model()
    offloaded = copy.deepcopy(plain)
    if recompute:  # offload then holds what checkpointing keeps: each block's input
        checkpoint_blocks(plain)
        checkpoint_blocks(offloaded)
    offload = offload_activations(
        offloaded.layers.values(), OffloadPolicy(min_bytes=1, keep_last_blocks=1)
    )
    expected, got = _grads_after_steps(plain), _grads_after_steps(offloaded)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)
    assert offload.stats.bytes_offloaded > 0


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64, 64))
        self.seen: list[StorageWeakRef] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x @ self.scale  # an intermediate the next op saves for backward
        self.seen.append(StorageWeakRef(hidden.untyped_storage()))
        return hidden.sin()


@pytest.mark.parametrize("offloaded", [False, True])
def test_the_storage_of_an_offloaded_tensor_is_released_after_packing(offloaded):
    block = _Block()
    offload = None
    if offloaded:
        offload = offload_activations([block], OffloadPolicy(min_bytes=1, keep_last_blocks=0))
    x = torch.randn(32, 64, requires_grad=True)
    out = block(x)
    (intermediate,) = block.seen
    # Only the saved copy could keep it alive: with offload, autograd holds a handle.
    assert intermediate.expired() is offloaded
    out.sum().backward()
    assert x.grad is not None
    if offload is not None:
        # x (saved by the matmul) and the intermediate (saved by sin); the weight is kept.
        assert offload.stats.bytes_offloaded == 2 * 32 * 64 * 4
        assert offload.stats.peak_saved_device_bytes == 0


def test_weights_are_left_to_their_layout():
    block = _Block()
    offload = offload_activations([block], OffloadPolicy(min_bytes=1, keep_last_blocks=0))
    x = torch.randn(8, 64, requires_grad=True)
    block(x).sum().backward()
    # Saved for backward: x, the weight (a Parameter: kept) and the intermediate.
    assert offload.stats.bytes_offloaded == (8 * 64 + 8 * 64) * 4
    gathered = torch.randn(64, 64, requires_grad=True) * 1.0
    gathered.europa_gathered_parameter = True  # as europa-flexshard marks its gathered weights
    assert isinstance(offload._pack(0, gathered.t()), _Kept)  # a view of it, as matmuls save
    assert not isinstance(offload._pack(0, gathered.detach().clone()), _Kept)


def test_the_pool_stops_allocating_after_the_first_step():
    model = _model()
    offload = offload_activations(
        model.layers.values(), OffloadPolicy(min_bytes=1024, keep_last_blocks=1)
    )
    allocations = []
    for step in range(3):
        for micro in range(2):  # gradient accumulation: buffers come back after each backward
            tokens = torch.randint(0, 2048, (2, 17), generator=torch.Generator().manual_seed(micro))
            model(tokens).float().logsumexp(-1).mean().backward()
        offload.release()
        allocations.append(offload.pool.allocations)
        assert step or offload.pool.allocations > 0
    assert allocations[0] == allocations[1] == allocations[2]


def test_pool_buffers_come_in_quarter_octave_classes():
    assert [size_class(n) for n in (1, 4096, 4097, 5120, 5121, 8192, 10000)] == [
        4096, 4096, 5120, 5120, 6144, 8192, 10240,
    ]  # fmt: skip
    pool = HostBufferPool(pin=False)
    first = pool.take(5000)
    pool.give_back(first)
    assert pool.take(4500) is first and pool.allocations == 1


def test_growth_past_the_host_budget_is_one_line():
    pool = HostBufferPool(pin=False, limit_bytes=10_000)
    pool.reserved_bytes = 2_000
    pool.take(4096)
    with pytest.raises(HostMemoryExceeded) as err:
        pool.take(6000)
    assert str(err.value) == (
        "offload.host_memory_gib = 9.31e-06: this rank would hold 0.01 MiB in host memory "
        "(0.00 MiB of optimizer state, 0.01 MiB of saved activations); expected a larger "
        "budget, a larger offload.min_tensor_kib, more blocks kept on the device "
        "(offload.keep_last_blocks) or more ranks"
    )
    assert err.value.europa_user_error is True
