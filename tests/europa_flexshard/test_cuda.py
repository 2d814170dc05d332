"""FlexShard on a CUDA device (one process): run where a GPU is present, skipped elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch

from europa.core.config import load_config
from europa.core.model import MatrixInitialiser, build_moe_model, init_buffers, materialise
from europa.flexshard import FlexShardOptimizer, flex_shard

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


def _model(native_fp32_experts: bool = True) -> torch.nn.Module:
    config = load_config("tiny")
    model = build_moe_model(config.model, native_dtype_experts=native_fp32_experts)
    materialise(model, torch.device("cpu"), seed=0)
    return model


def _step(model: torch.nn.Module, device: torch.device, **layout_options) -> dict:
    layout = flex_shard(model, **layout_options)
    optimizer = FlexShardOptimizer(layout, lr=0.02)
    tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    norm = layout.clip_grad_norm_(1.0)
    optimizer.step()
    return {
        "loss": loss.item(),
        "norm": norm,
        "dtypes": {p.dtype for _, p in layout.named_local_parameters()},
        "params": {n: p.detach().cpu() for n, p in layout.full_parameters().items()},
    }


def test_an_fp32_step_on_cuda_matches_the_cpu_step():
    cpu_model = _model()
    cuda_model = copy.deepcopy(cpu_model).to(CUDA)
    on_cpu, on_cuda = _step(cpu_model, torch.device("cpu")), _step(cuda_model, CUDA)
    assert on_cuda["loss"] == pytest.approx(on_cpu["loss"], rel=1e-4)
    assert on_cuda["norm"] == pytest.approx(on_cpu["norm"], rel=1e-3)
    for name, expected in on_cpu["params"].items():
        torch.testing.assert_close(on_cuda["params"][name], expected, rtol=1e-3, atol=1e-4)


def test_bf16_compute_over_fp32_storage_on_cuda():
    model = _model(native_fp32_experts=False).to(CUDA)  # torchtitan's bf16 grouped GEMM
    result = _step(model, CUDA, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert result["dtypes"] == {torch.float32}
    assert torch.isfinite(torch.tensor([result["loss"], result["norm"]])).all()
    assert all(p.dtype == torch.bfloat16 for p in result["params"].values())


def test_owned_matrices_are_drawn_on_cuda_as_core_draws_them():
    config = load_config("tiny")
    reference = build_moe_model(config.model)
    materialise(reference, CUDA, seed=4)
    model = build_moe_model(config.model)
    init_matrix = MatrixInitialiser(model, seed=4)
    layout = flex_shard(model)
    layout.materialise(CUDA, init_matrix)
    init_buffers(model, CUDA)
    fulls = layout.full_parameters()
    for name, param in reference.named_parameters():
        assert torch.equal(fulls[name], param.detach()), name
