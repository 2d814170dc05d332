"""The optimised optimizer paths (torch's fused AdamW kernel) against the plain
per-tensor AdamW they replace: the same parameters within fp32 noise."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.core.config.schema import OptimizerConfig
from europa.core.optim import MuonWithAdamW
from europa.core.plugins.builtin.optimizer import europa_build_optimizer


def _optimizer_config() -> OptimizerConfig:
    return OptimizerConfig()  # the [optimizer] defaults


shapes = st.lists(
    st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4
)


def _params(shape_list, seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shape_list]


def _run(params, optimizer, seed: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return [p.detach() for p in params]


def _plain_adamw(params, cfg) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
    )


def _assert_fp32_close(got, expected) -> None:
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


@settings(max_examples=15, deadline=None)
@given(shape_list=shapes, seed=st.integers(0, 2**16), lr=st.floats(1e-4, 3e-2))
def test_core_adamw_matches_the_per_tensor_path(shape_list, seed, lr):
    cfg = dataclasses.replace(_optimizer_config(), lr=lr)
    model = torch.nn.Module()
    model.weights = torch.nn.ParameterList(_params(shape_list, seed))
    job = SimpleNamespace(config=SimpleNamespace(optimizer=cfg))
    built = europa_build_optimizer(job=job, model=model)
    assert built.defaults["fused"]
    plain_params = _params(shape_list, seed)
    expected = _run(plain_params, _plain_adamw(plain_params, cfg), seed, steps=4)
    _assert_fp32_close(_run(list(model.weights), built, seed, steps=4), expected)


@settings(max_examples=15, deadline=None)
@given(shape_list=shapes, seed=st.integers(0, 2**16))
def test_muon_optimizer_adamw_group_matches_torch_adamw(shape_list, seed):
    cfg = _optimizer_config()
    params = _params(shape_list, seed)
    combined = MuonWithAdamW(
        muon_params=[],
        adamw_params=params,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    plain_params = _params(shape_list, seed)
    expected = _run(plain_params, _plain_adamw(plain_params, cfg), seed, steps=4)
    _assert_fp32_close(_run(params, combined, seed, steps=4), expected)
