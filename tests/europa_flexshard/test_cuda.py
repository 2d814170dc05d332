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


# -- the two-level exchange's local work on CUDA --------------------------------------------


@pytest.fixture(scope="module")
def one_rank():
    """A world of one process with gloo for CPU tensors and NCCL for CUDA ones."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def _two_level_step(device: torch.device, wire: str) -> dict:
    """One layer through the two-level exchange (one node of one rank: the sort, regroup,
    per-node sum and payload codec all run, the collectives are local copies)."""
    from europa.flexshard.exchange.nodes import expert_node_groups
    from europa.flexshard.exchange.two_level import TwoLevelDispatcher
    from europa.flexshard.exchange.wire import Wire

    experts, top_k, dim, tokens = 8, 3, 256, 64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g).to(device).requires_grad_(True)
    scores = torch.rand(tokens, top_k, generator=g).to(device).requires_grad_(True)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.randn(experts, dim, dim, generator=g).div(dim**0.5).to(device)
    weights.requires_grad_(True)
    nodes = expert_node_groups([[0]], 1)
    dispatcher = TwoLevelDispatcher(None, 0, [(0, experts)], top_k, nodes=nodes, wire=Wire(wire))
    rows, counts, routed = dispatcher.dispatch(x, scores, ids.to(device), None)
    pieces = rows.split(counts.tolist())
    out = dispatcher.combine(
        torch.cat([p @ w for p, w in zip(pieces, weights, strict=True)]), routed, x
    )
    out.square().sum().backward()
    return {"out": out, "x": x.grad, "scores": scores.grad, "weights": weights.grad}


@pytest.mark.parametrize("wire", ["compute", "bfloat16", "float8_e4m3fn"])
def test_the_two_level_exchange_computes_on_cuda_as_on_cpu(one_rank, wire):
    on_cpu, on_cuda = _two_level_step(torch.device("cpu"), wire), _two_level_step(CUDA, wire)
    for key, expected in on_cpu.items():
        torch.testing.assert_close(
            on_cuda[key].cpu(), expected.detach(), rtol=2e-3, atol=2e-3, msg=key
        )
