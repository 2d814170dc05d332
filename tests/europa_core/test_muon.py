"""Muon + AdamW: the update rules, and the sharded step equal to the unsharded one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from europa.core.optim import MuonWithAdamW, orthogonalise


@given(rows=st.integers(2, 24), cols=st.integers(2, 24), seed=st.integers(0, 2**16))
def test_orthogonalise_keeps_singular_vectors_and_pushes_values_toward_one(rows, cols, seed):
    matrix = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    out = orthogonalise(matrix)
    u, singular, vh = torch.linalg.svd(matrix, full_matrices=False)
    mapped = torch.diagonal(u.T @ out @ vh.T)
    # Newton–Schulz is a polynomial in G G^T: same singular vectors, new values.
    torch.testing.assert_close(u @ torch.diag(mapped) @ vh, out, rtol=1e-4, atol=1e-4)
    # Five quintic steps land values in roughly [0.5, 1.2] (Jordan et al.), except
    # directions far weaker than the matrix's norm, which have not grown yet.
    assert (mapped.abs() < 1.3).all()
    assert (mapped[singular / matrix.norm() >= 0.01] > 0.5).all()


def test_orthogonalise_treats_a_3d_tensor_as_independent_matrices():
    stack = torch.randn(4, 6, 10)
    batched = orthogonalise(stack)
    for i in range(4):
        torch.testing.assert_close(batched[i], orthogonalise(stack[i]), rtol=1e-5, atol=1e-6)


def _grads_for(params, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_muon_group_matches_torch_muon_on_matrices():
    torch.manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(16, 8))]
    ref_p = [torch.nn.Parameter(ours_p[0].detach().clone())]
    ours = MuonWithAdamW(ours_p, [], lr=1e-2, weight_decay=0.1, momentum=0.95)
    ref = torch.optim.Muon(
        ref_p, lr=1e-2, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw"
    )
    for step in range(3):
        _grads_for(ours_p, step)
        _grads_for(ref_p, step)
        ours.step()
        ref.step()
    # torch.optim.Muon orthogonalises in bf16, ours in the parameter's fp32.
    torch.testing.assert_close(ours_p[0], ref_p[0], rtol=0, atol=2e-3)


def _tiny_stack():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.experts = torch.nn.Parameter(torch.randn(4, 6, 8))  # sharded on dim 0: whole matrices
    model.dense = torch.nn.Parameter(torch.randn(8, 6))  # sharded on rows: gathered
    model.norm = torch.nn.Parameter(torch.ones(6))
    return model


def _muon_step(model, grads):
    muon = [model.experts, model.dense]
    optimizer = MuonWithAdamW(muon, [model.norm], lr=0.05, weight_decay=0.1)
    for _ in range(2):
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        optimizer.step()


def _sharded_muon_step(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = _tiny_stack()
    grads = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        for i, p in enumerate(model.parameters())
    ]
    mesh = init_device_mesh("cpu", (world,))
    for name, p in list(model.named_parameters()):
        setattr(model, name, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
    sharded_grads = [distribute_tensor(g, mesh, [Shard(0)]) for g in grads]
    _muon_step(model, sharded_grads)
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


@pytest.mark.distributed
def test_sharded_muon_step_equals_the_unsharded_step(ranks):
    gathered = ranks(_sharded_muon_step, 2)
    model = _tiny_stack()
    grads = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        for i, p in enumerate(model.parameters())
    ]
    _muon_step(model, grads)
    for name, p in model.named_parameters():
        for rank_view in gathered:
            torch.testing.assert_close(rank_view[name], p.detach(), rtol=1e-5, atol=1e-6)
