"""Activation and optimizer-state offload on a CUDA device: run where a GPU is present."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from europa.offload import OffloadedOptimizer, OffloadPolicy, offload_activations

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)) for _ in range(6)]
    ).to(CUDA)


def _step(model: nn.Module, optimizer) -> tuple[float, dict[str, torch.Tensor], int]:
    x = torch.randn(64, 256, 512, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    torch.cuda.reset_peak_memory_stats()
    loss = (model(x) - x).pow(2).mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    return loss.item(), grads, torch.cuda.max_memory_allocated()


def test_offload_on_cuda_keeps_gradients_bit_identical_and_lowers_the_peak():
    plain = _blocks()
    offloaded = copy.deepcopy(plain)
    offload = offload_activations(list(offloaded), OffloadPolicy(min_bytes=1 << 16))
    _, expected, base_peak = _step(plain, torch.optim.AdamW(plain.parameters()))
    _, grads, peak = _step(offloaded, torch.optim.AdamW(offloaded.parameters()))
    for name, grad in expected.items():
        assert torch.equal(grads[name], grad), name
    stats = offload.take_stats()
    assert stats.bytes_offloaded > 0 and stats.bytes_prefetched > 0
    assert peak < 0.8 * base_peak


def test_optimizer_state_lives_on_the_host_between_steps_and_steps_identically():
    plain = _blocks()
    streamed = copy.deepcopy(plain)
    plain_optimizer = torch.optim.AdamW(plain.parameters())
    optimizer = OffloadedOptimizer(torch.optim.AdamW(streamed.parameters()), chunk_bytes=1 << 22)
    for _ in range(3):
        _step(plain, plain_optimizer)
        _step(streamed, optimizer)
    for a, b in zip(plain.parameters(), streamed.parameters(), strict=True):
        assert torch.equal(a, b)
    for state in optimizer.optimizer.state.values():
        assert all(t.device.type == "cpu" for t in state.values() if t.ndim > 0)
