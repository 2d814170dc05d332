"""The chunked, asynchronous expert exchange, on 2 gloo ranks: bit-identical to the
unchunked layer with the flat exchange, equal within 1e-6 with the two-level one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

DIM = 8


class GroupedExperts(nn.Module):
    """A stack of expert matrices run by one grouped GEMM (as europa-core's experts)."""

    def __init__(self, weights: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(weights.clone())

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch.tanh(torch._grouped_mm(x, self.w.transpose(-2, -1), offs=offsets))


class RoutedExperts(nn.Module):
    """torchtitan's RoutedExperts.forward: dispatch, experts, combine."""

    def __init__(self, dispatcher, weights: torch.Tensor) -> None:
        super().__init__()
        self.token_dispatcher = dispatcher
        self.inner_experts = GroupedExperts(weights)

    def forward(self, x_BLD, scores_BLK, ids_BLK, counts_E):
        B, L, D = x_BLD.shape
        x_TD = x_BLD.view(B * L, D)
        K = scores_BLK.shape[-1]
        rows, per_expert, meta = self.token_dispatcher.dispatch(
            x_TD, scores_BLK.view(-1, K), ids_BLK.view(-1, K), counts_E
        )
        out = self.inner_experts(rows, per_expert)
        return self.token_dispatcher.combine(out, meta, x_TD).view(B, -1, D)


class MoE(nn.Module):
    """torchtitan's MoE.forward with the routing given: routed experts, then shared."""

    def __init__(self, dispatcher, weights, shared: nn.Linear, experts: int) -> None:
        super().__init__()
        self.routed_experts = RoutedExperts(dispatcher, weights)
        self.shared_experts = shared
        self.experts = experts

    def forward(self, x, scores, ids):
        counts = torch.bincount(ids.reshape(-1), minlength=self.experts)
        return self.routed_experts(x, scores, ids, counts) + self.shared_experts(x)


def _dispatcher(kind, rank: int, ranges, top_k: int):
    from europa.flexshard.exchange.flat import FlatDispatcher
    from europa.flexshard.exchange.two_level import TwoLevelDispatcher

    if kind == "flat":
        return FlatDispatcher(None, rank, ranges, top_k)
    return TwoLevelDispatcher(None, rank, ranges, top_k, nodes=kind)


def _layer(case: dict, rank: int, world: int, chunks: int | None, kind="flat"):
    from europa.flexshard import ParameterSpec, plan_ownership
    from europa.overlap import overlap_expert_all_to_all

    experts, top_k = case["experts"], case["top_k"]
    ranges = plan_ownership([ParameterSpec("e", (experts, 1, DIM * DIM))], world).ranges["e"]
    g = torch.Generator().manual_seed(case["seed"])
    weights = torch.randn(experts, DIM, DIM, generator=g)
    shared = nn.Linear(DIM, DIM)
    with torch.no_grad():
        shared.weight.copy_(torch.randn(DIM, DIM, generator=g))
        shared.bias.copy_(torch.randn(DIM, generator=g))
    start, stop = ranges[rank]
    layer = MoE(_dispatcher(kind, rank, ranges, top_k), weights[start:stop], shared, experts)
    if chunks is not None:
        assert overlap_expert_all_to_all(layer, chunks) == [""]
    return layer


def _run(case: dict, rank: int, world: int, chunks: int | None, kind="flat") -> dict:
    layer = _layer(case, rank, world, chunks, kind)
    g = torch.Generator().manual_seed(case["seed"] * 10 + rank)
    tokens, top_k = case["tokens"][rank], case["top_k"]
    x = torch.randn(1, tokens, DIM, generator=g, requires_grad=True)
    scores = torch.rand(1, tokens, top_k, generator=g, requires_grad=True)
    if case["routing"] == "one expert":
        ids = torch.full((1, tokens, top_k), case["experts"] - 1)
    else:
        picks = [torch.randperm(case["experts"], generator=g)[:top_k] for _ in range(tokens)]
        ids = torch.stack(picks).view(1, tokens, top_k) if picks else torch.zeros(1, 0, top_k)
        ids = ids.long()
    out = layer(x, scores, ids)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return {"out": out.detach(), "x": x.grad, "scores": scores.grad, **grads}


CASES = [
    {"experts": 8, "top_k": 3, "tokens": [24, 17], "seed": 1, "routing": "random"},
    # 5 experts over 2 ranks (3 and 2), a rank with no tokens, 3 chunks: an empty chunk.
    {"experts": 5, "top_k": 2, "tokens": [19, 0], "seed": 2, "routing": "random"},
    {"experts": 4, "top_k": 1, "tokens": [9, 11], "seed": 3, "routing": "one expert"},
]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    if not b.numel():
        return 0.0
    scale, gap = b.abs().max().item(), (a - b).abs().max().item()
    return gap / scale if scale else gap


def compare_rank(rank: int, world: int) -> list[str]:
    from europa.flexshard.exchange.nodes import expert_node_groups

    two_nodes = expert_node_groups([list(range(world))], 1)  # a node per rank
    mismatches = []
    for index, case in enumerate(CASES):
        plain = _run(case, rank, world, None)
        for chunks in (1, 2, 3):
            overlapped = _run(case, rank, world, chunks)
            for key, value in plain.items():
                if not torch.equal(value, overlapped[key]):
                    mismatches.append(f"case {index}, chunks {chunks}: {key}")
        two_level = _run(case, rank, world, None, two_nodes)
        for chunks in (1, 2, 3):  # chunks of tokens: an expert's gradient sums chunk by chunk
            overlapped = _run(case, rank, world, chunks, two_nodes)
            for key, value in two_level.items():
                if _relative(overlapped[key], value) > 1e-6:
                    mismatches.append(f"case {index}, two-level, chunks {chunks}: {key}")
    return mismatches


@pytest.mark.distributed
def test_chunked_all_to_all_is_bit_identical_to_the_unchunked_layer(overlap_group):
    _, results = overlap_group  # compare_rank ran on each of 2 gloo ranks (conftest.py)
    assert [r["numerics"] for r in results] == [[], []]


def held_shared_results_after_recomputation(rank: int, world: int) -> int:
    """Shared experts still holding their early result after a checkpointed layer's
    backward: torch's recomputation stops once it has what backward needs, before the
    MoE layer asks for the shared result, which then must not be kept."""
    from torch.utils.checkpoint import checkpoint

    case = CASES[0]
    layer = _layer(case, rank, world, 2)
    g = torch.Generator().manual_seed(rank)
    tokens, top_k = case["tokens"][rank], case["top_k"]
    x = torch.randn(1, tokens, DIM, generator=g, requires_grad=True)
    scores = torch.rand(1, tokens, top_k, generator=g, requires_grad=True)
    picks = [torch.randperm(case["experts"], generator=g)[:top_k] for _ in range(tokens)]
    ids = torch.stack(picks).view(1, tokens, top_k).long()
    out = checkpoint(layer, x, scores, ids, use_reentrant=False)
    out.sum().backward()
    return int(layer.shared_experts.forward._ready is not None)


@pytest.mark.distributed
def test_a_recomputed_layer_keeps_no_shared_expert_result(overlap_group):
    _, results = overlap_group
    assert [r["held_shared_results"] for r in results] == [0, 0]
