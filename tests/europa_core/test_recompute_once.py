"""Recomputation for a split backward (``recompute_once``): a block checkpointed with it
runs its forward once more in all, whether its backward comes in one pass or in two
(input gradients, then weight gradients, as ZBV and DualPipeV take it), and every
gradient is the one without checkpointing, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from europa.core.plugins.builtin.recompute_once import checkpoint_once


class Block(torch.nn.Module):
    """Two products around a nonlinearity and a norm: tensors saved as inputs, as
    outputs (exp) and as weights; it counts its forwards."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.norm = torch.nn.RMSNorm(width)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        hidden = torch.nn.functional.silu(self.up(self.norm(x)))
        return x + self.down(hidden * torch.exp(-hidden.abs()))


def _split_backward(block: Block, run, x: torch.Tensor, grad: torch.Tensor):
    """Input gradients in one autograd pass, the weights' in a second (retain_graph
    between them, as torch.distributed.pipelining's stage_backward_input and _weight)."""
    out = run(block, x)
    (dx,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    dws = torch.autograd.grad(out, list(block.parameters()), grad)
    return dx, dws


def _plain(block, x):
    return block(x)


def _once(block, x):
    return checkpoint_once(block.forward, x)


def _torch(block, x):
    return checkpoint(block.forward, x, use_reentrant=False)


@given(st.integers(1, 4), st.integers(2, 8), st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_a_split_backward_recomputes_once_and_its_gradients_are_exact(batch, width, seed):
    torch.manual_seed(seed)
    block = Block(width)
    x = torch.randn(batch, 3, width, requires_grad=True)
    grad = torch.randn(batch, 3, width)
    dx, dws = _split_backward(block, _plain, x, grad)
    block.forwards = 0
    once_dx, once_dws = _split_backward(block, _once, x, grad)
    assert block.forwards == 2  # the forward, and one recomputation for both passes
    assert torch.equal(once_dx, dx)
    assert all(torch.equal(a, b) for a, b in zip(once_dws, dws, strict=True))


def test_torchs_checkpoint_recomputes_again_for_the_weight_pass():
    """Why recompute_once exists: torch keys its recomputation by the backward pass."""
    torch.manual_seed(0)
    block = Block(4)
    x = torch.randn(2, 3, 4, requires_grad=True)
    _split_backward(block, _torch, x, torch.randn(2, 3, 4))
    assert block.forwards == 3


def test_one_backward_pass_recomputes_once_too():
    torch.manual_seed(0)
    block = Block(4)
    x = torch.randn(2, 3, 4, requires_grad=True)
    _once(block, x).square().sum().backward()
    assert block.forwards == 2
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    _plain(block, x).square().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, block.parameters(), strict=True))


def test_a_forward_that_does_other_work_when_recomputed_is_an_error():
    calls = []

    def changing(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x.exp() if len(calls) == 1 else x.exp().exp()

    x = torch.randn(3, requires_grad=True)
    out = checkpoint_once(changing, x)
    with pytest.raises(RuntimeError, match="saved 2 tensors where the forward saved 1"):
        out.sum().backward()


def test_the_blocks_inputs_are_saved_through_the_hooks_around_it():
    """As europa-offload's hooks take what a checkpointed block saves (its inputs) to host
    memory, they take what recompute_once keeps: the block's inputs, and nothing else."""
    torch.manual_seed(0)
    block = Block(4)
    x = torch.randn(2, 3, 4, requires_grad=True)
    packed, unpacked = [], []

    def pack(tensor):
        packed.append(tensor)
        return tensor.clone()  # a copy elsewhere, as offload's host buffer is

    def unpack(copy):
        unpacked.append(copy)
        return copy

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = _once(block, x)
    assert [t is x for t in packed] == [True]
    _split_backward_from(out, block, x)
    assert len(unpacked) == 1  # read back once, for the one recomputation
    assert block.forwards == 2


def _split_backward_from(out, block, x):
    grad = torch.ones_like(out)
    torch.autograd.grad(out, x, grad, retain_graph=True)
    torch.autograd.grad(out, list(block.parameters()), grad)
