"""Expert parallelism: tokens to their experts' owners and back, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.cli.app import run
from europa.flexshard import ParameterSpec, plan_ownership
from tests.conftest import run_ranks
from tests.trainer_runs import Run, train_runs

DIM = 4


@st.composite
def routings(draw, world: int) -> dict:
    """Tokens per rank (possibly none), experts (at least one per rank), top-k, and
    a routing: random, everything to one expert, or only a few experts used."""
    experts = draw(st.integers(world, 9))
    top_k = draw(st.integers(1, min(3, experts)))
    used = {
        "random": list(range(experts)),
        "one expert": [draw(st.integers(0, experts - 1))],
        "few experts": draw(st.lists(st.integers(0, experts - 1), min_size=1, max_size=2)),
    }[draw(st.sampled_from(["random", "one expert", "few experts"]))]
    tokens = draw(st.lists(st.integers(0, 7), min_size=world, max_size=world))
    ids = [[[draw(st.sampled_from(used)) for _ in range(top_k)] for _ in range(t)] for t in tokens]
    return {"experts": experts, "top_k": top_k, "ids": ids, "seed": draw(st.integers(0, 999))}


def _inputs(case: dict, rank: int):
    g = torch.Generator().manual_seed(case["seed"] * 100 + rank)
    ids = torch.tensor(case["ids"][rank], dtype=torch.int64).reshape(-1, case["top_k"])
    x = torch.randn(len(ids), DIM, generator=g)
    scores = torch.rand(len(ids), case["top_k"], generator=g)
    probe = torch.randn(len(ids), DIM, generator=g)
    return x, scores, ids, probe


def _weights(case: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["seed"])
    return torch.randn(case["experts"], DIM, DIM, generator=g)


def _apply_experts(rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor):
    pieces = rows.split(counts.tolist())
    return torch.cat([p @ w for p, w in zip(pieces, weights, strict=True)] + [rows[:0]])


def _ranges(case: dict, world: int):
    stack = ParameterSpec("experts", (case["experts"], 1, DIM * DIM))
    return plan_ownership([stack], world).ranges["experts"]


def _routed_rank(rank: int, world: int, cases: list[dict]) -> list[dict]:
    from europa.flexshard.experts import AllToAllDispatcher

    results = []
    for case in cases:
        ranges = _ranges(case, world)
        start, stop = ranges[rank]
        dispatcher = AllToAllDispatcher(None, rank, ranges, case["top_k"])
        x, scores, ids, probe = _inputs(case, rank)
        x.requires_grad_(True)
        local = _weights(case)[start:stop].requires_grad_(True)
        counts = torch.bincount(ids.reshape(-1), minlength=case["experts"])

        routed, per_local_expert, exchange = dispatcher.dispatch(x, scores, ids, counts)
        identity = dispatcher.combine(routed, exchange, x)  # experts that change nothing
        out = dispatcher.combine(_apply_experts(routed, per_local_expert, local), exchange, x)
        (out * probe).sum().backward()
        results.append(
            {
                "identity": identity.detach(),
                "out": out.detach(),
                "x_grad": x.grad,
                "expert_grads": local.grad,
                "received": int(per_local_expert.sum()),
            }
        )
    return results


def _reference(case: dict, world: int):
    weights = _weights(case).requires_grad_(True)
    outs, xs = [], []
    loss = 0.0
    for rank in range(world):
        x, scores, ids, probe = _inputs(case, rank)
        x.requires_grad_(True)
        out = torch.zeros_like(x)
        for k in range(case["top_k"]):
            out = out + scores[:, k : k + 1] * torch.bmm(x[:, None], weights[ids[:, k]])[:, 0]
        loss = loss + (out * probe).sum()
        outs.append((out, x, scores))
        xs.append(x)
    loss.backward()
    return outs, weights.grad


EDGES = [  # no tokens on rank 0; every pair to the last expert; experts 1.. never used
    {"experts": 4, "top_k": 2, "ids": [[], [[3, 3], [3, 3]], [[0, 0]], [[0, 3]]], "seed": 1},
]


def _check(world: int, cases: list[dict]) -> None:
    results = run_ranks(_routed_rank, world, cases)
    for index, case in enumerate(cases):
        outs, weight_grads = _reference(case, world)
        total_pairs = sum(len(ids) * case["top_k"] for ids in case["ids"])
        assert sum(r[index]["received"] for r in results) == total_pairs
        for rank, ((out, x, scores), result) in enumerate(
            zip(outs, (r[index] for r in results), strict=True)
        ):
            expected_identity = x.detach() * scores.sum(dim=1, keepdim=True)
            torch.testing.assert_close(result["identity"], expected_identity)
            torch.testing.assert_close(result["out"], out.detach(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(result["x_grad"], x.grad, rtol=1e-5, atol=1e-5)
            start, stop = _ranges(case, world)[rank]
            torch.testing.assert_close(
                result["expert_grads"], weight_grads[start:stop], rtol=1e-5, atol=1e-5
            )


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_dispatch_and_combine_match_the_single_process_layer(world, data):
    cases = data.draw(st.lists(routings(world), min_size=12, max_size=12))
    edges = [c for c in EDGES if len(c["ids"]) == world] or [
        {**EDGES[0], "ids": EDGES[0]["ids"][:world]}
    ]
    _check(world, cases + edges)


# -- training with parallel.ep: every run in one spawned group of 4 ranks -----------------

QUIET = ["--set", "metrics.progress=false"]
COMMON = ["training.steps=4", "checkpoint.every=2", "model.num_experts=6"]
RUNS = [
    Run("ep1", [*COMMON, "parallel.ep=1"], ["flexshard"]),
    Run("ep2", [*COMMON, "parallel.ep=2"], ["flexshard"]),
    Run("ep4", [*COMMON, "parallel.ep=4"], ["flexshard"]),  # 6 experts over 4: 2, 2, 1, 1
    # The ep=2 run's step-2 checkpoint, resumed as ep=2 and as ep=1.
    Run("ep2-resumed-ep2", [*COMMON, "parallel.ep=2"], ["flexshard"], resume_from="ep2"),
    Run("ep2-resumed-ep1", [*COMMON, "parallel.ep=1"], ["flexshard"], resume_from="ep2"),
]


@pytest.mark.distributed
def test_expert_parallel_training_equals_ep_1_and_resumes_on_another_ep(tmp_path):
    runs = run_ranks(train_runs, 4, str(tmp_path), RUNS, timeout=300)[0]
    losses = {name: [r["loss"] for r in records] for name, records in runs.items()}
    for ep in ("ep2", "ep4"):  # the same global batch: equal within fp32 noise
        assert losses[ep] == pytest.approx(losses["ep1"], rel=1e-5)
        for mine, theirs in zip(runs[ep], runs["ep1"], strict=True):  # global token counts
            for layer, shares in mine["expert_load"].items():
                assert shares == pytest.approx(theirs["expert_load"][layer], abs=1e-6)
    assert losses["ep2-resumed-ep2"] == losses["ep2"]  # exactly
    assert losses["ep2-resumed-ep1"] == pytest.approx(losses["ep2"], rel=1e-5)


def test_an_expert_split_the_ranks_cannot_hold_is_one_line(tmp_path, capsys):
    code = run(["train", "tiny", "-p", "flexshard", "--nproc", "4", *QUIET,
                "--run-dir", str(tmp_path / "run"), "--set", "parallel.ep=3"])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "europa: error: parallel.dp_replicate × parallel.ep = 3: expected a divisor of the 4 ranks"
    )
