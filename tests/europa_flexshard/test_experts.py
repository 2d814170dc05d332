"""Expert parallelism: tokens to their experts' owners and back, on real gloo ranks."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.cli.app import run
from europa.core.config import load_config
from europa.flexshard import ParameterSpec, plan_ownership
from europa.flexshard.exchange.traffic import routed_bytes
from europa.flexshard.exchange.wire import RowBytes, Wire
from tests.conftest import run_ranks
from tests.trainer_runs import Run, rank_trainer, train_runs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _links import LinkCounter

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


# Each case runs under every dispatcher: flat, and two-level at each node size that
# splits the ranks (one node, and emulated nodes of fewer ranks).
def _node_sizes(world: int) -> list[int]:
    return sorted({n for n in (world, 2, 1) if world % n == 0}, reverse=True)


def _per_node(kind: str, world: int) -> int:
    """The node size bytes are counted at: the two-level exchange's own; 2 for flat."""
    return int(kind.split("/")[1]) if "/" in kind else min(2, world)


def _dispatchers(rank: int, world: int):
    from europa.flexshard.exchange.flat import FlatDispatcher
    from europa.flexshard.exchange.nodes import expert_node_groups
    from europa.flexshard.exchange.two_level import TwoLevelDispatcher

    def make(kind, ranges, top_k):
        if kind == "flat":
            return FlatDispatcher(None, rank, ranges, top_k)
        return TwoLevelDispatcher(None, rank, ranges, top_k, nodes=nodes[kind])

    nodes = {
        f"two_level/{n}": expert_node_groups([list(range(world))], n) for n in _node_sizes(world)
    }
    return ["flat", *nodes], make


def _routed_rank(rank: int, world: int, cases: list[dict]) -> list[dict]:
    kinds, make = _dispatchers(rank, world)
    results = []
    for case in cases:
        ranges = _ranges(case, world)
        start, stop = ranges[rank]
        by_kind = {}
        for kind in kinds:
            dispatcher = make(kind, ranges, case["top_k"])
            x, scores, ids, probe = _inputs(case, rank)
            x.requires_grad_(True)
            scores.requires_grad_(True)
            local = _weights(case)[start:stop].requires_grad_(True)
            counts = torch.bincount(ids.reshape(-1), minlength=case["experts"])

            with LinkCounter(_per_node(kind, world)) as counter:
                routed, per_local_expert, exchange = dispatcher.dispatch(x, scores, ids, counts)
                out = dispatcher.combine(
                    _apply_experts(routed, per_local_expert, local), exchange, x
                )
                (out * probe).sum().backward()
            again, _, exchange = dispatcher.dispatch(x.detach(), scores.detach(), ids, counts)
            identity = dispatcher.combine(again, exchange, x)  # experts that change nothing
            by_kind[kind] = {
                "identity": identity.detach(),
                "out": out.detach(),
                "x_grad": x.grad,
                "score_grad": scores.grad,
                "expert_grads": local.grad,
                "received": int(per_local_expert.sum()),
                "sent_bytes": counter.bytes,
            }
        results.append(by_kind)
    return results


def _reference(case: dict, world: int):
    weights = _weights(case).requires_grad_(True)
    outs = []
    loss = 0.0
    for rank in range(world):
        x, scores, ids, probe = _inputs(case, rank)
        x.requires_grad_(True)
        scores.requires_grad_(True)
        out = torch.zeros_like(x)
        for k in range(case["top_k"]):
            out = out + scores[:, k : k + 1] * torch.bmm(x[:, None], weights[ids[:, k]])[:, 0]
        loss = loss + (out * probe).sum()
        outs.append((out, x, scores))
    loss.backward()
    return outs, weights.grad


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference over the largest value: the 1e-6 the two exchanges must meet."""
    if not b.numel():
        return 0.0
    scale, gap = b.abs().max().item(), (a - b).abs().max().item()
    return gap / scale if scale else gap


EDGES = [  # no tokens on rank 0; every pair to the last expert; experts 1.. never used
    {"experts": 4, "top_k": 2, "ids": [[], [[3, 3], [3, 3]], [[0, 0]], [[0, 3]]], "seed": 1},
]


def _check(world: int, cases: list[dict]) -> None:
    results = run_ranks(_routed_rank, world, cases)
    for index, case in enumerate(cases):
        outs, weight_grads = _reference(case, world)
        total_pairs = sum(len(ids) * case["top_k"] for ids in case["ids"])
        for kind in results[0][index]:
            assert sum(r[index][kind]["received"] for r in results) == total_pairs, kind
        for rank, ((out, x, scores), result) in enumerate(
            zip(outs, (r[index] for r in results), strict=True)
        ):
            start, stop = _ranges(case, world)[rank]
            expected = {
                "identity": x.detach() * scores.detach().sum(dim=1, keepdim=True),
                "out": out.detach(),
                "x_grad": x.grad,
                "score_grad": scores.grad,
                "expert_grads": weight_grads[start:stop],
            }
            for kind, got in result.items():
                dispatch = kind.split("/")[0]
                sent = routed_bytes(
                    case["ids"],
                    _ranges(case, world),
                    _per_node(kind, world),
                    dispatch,
                    RowBytes.of(dispatch, Wire(), DIM, case["top_k"]),
                )
                assert got["sent_bytes"] == sent[rank], kind  # counted == the routing's, exactly
                for key, want in expected.items():
                    torch.testing.assert_close(
                        got[key], want, rtol=1e-5, atol=1e-5, msg=f"{kind} {key}"
                    )
                    if kind != "flat":  # the two exchanges agree far closer than the reference
                        assert _relative(got[key], result["flat"][key]) <= 1e-6, (kind, key)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_dispatch_and_combine_match_the_single_process_layer(world, data):
    """Random routings, uneven expert splits, experts that receive nothing: flat and
    two-level (one node, and emulated nodes) equal the single-process layer, and each
    other within 1e-6, in outputs and every gradient."""
    cases = data.draw(st.lists(routings(world), min_size=12, max_size=12))
    edges = [c for c in EDGES if len(c["ids"]) == world] or [
        {**EDGES[0], "ids": EDGES[0]["ids"][:world]}
    ]
    _check(world, cases + edges)


# -- training with parallel.ep: every run in one spawned group of 4 ranks -----------------

QUIET = ["--set", "metrics.progress=false"]
FP8 = 'parallel.ep_dispatch_dtype="float8_e4m3fn"'
CHECKPOINTING = 'activation_checkpointing.mode="full"'
KEPT = "parallel.ep_keep_exchanges=true"
DENSE_NODE = 'flexshard.dense_group="node"'
DENSE_RANK = 'flexshard.dense_group="rank"'
ACCUMULATE = "training.grad_accum_steps=2"
ONE_NODE = "parallel.ep_max_nodes_per_token=1"
COMMON = ["training.steps=4", "model.num_experts=6", "training.seq_len=32",
          "training.batch_size=4"]  # fmt: skip
# Every run saves its last step; the runs that others resume save step 2 as well.
RESUMED = "checkpoint.every=2"
TWO_NODES = [*COMMON, "parallel.ep=4", "parallel.ranks_per_node=2"]
BF16_REPLICAS = [*COMMON, "parallel.ep=2", "parallel.dp_replicate=2", ACCUMULATE,
                 'training.dtype="bfloat16"']  # fmt: skip
BF16_REDUCE = 'flexshard.reduce_dtype="bfloat16"'
RUNS = [
    Run("ep1", [*COMMON, "parallel.ep=1"], ["flexshard"]),
    Run("ep2", [*COMMON, "parallel.ep=2", RESUMED], ["flexshard"]),
    Run("ep4", [*COMMON, "parallel.ep=4"], ["flexshard"]),  # 6 experts over 4: 2, 2, 1, 1
    # The ep=2 run's step-2 checkpoint, resumed as ep=2 and as ep=1.
    Run("ep2-resumed-ep2", [*COMMON, "parallel.ep=2"], ["flexshard"], resume_from="ep2"),
    Run("ep2-resumed-ep1", [*COMMON, "parallel.ep=1"], ["flexshard"], resume_from="ep2"),
    # Two emulated nodes of 2: "auto" picks the two-level exchange.
    Run("ep4-two-level", [*TWO_NODES, RESUMED], ["flexshard"]),
    Run("ep4-two-level-fp8-kept", [*TWO_NODES, FP8, CHECKPOINTING, KEPT], ["flexshard"]),
    # The non-expert matrices over each node's ranks, copied on the other node, and
    # checkpoints resumed across the two layouts.
    Run("ep4-dense-node", [*TWO_NODES, DENSE_NODE, RESUMED], ["flexshard"]),
    Run(
        "ep4-all-resumed-node", [*TWO_NODES, DENSE_NODE], ["flexshard"], resume_from="ep4-two-level"
    ),
    Run("ep4-node-resumed-all", TWO_NODES, ["flexshard"], resume_from="ep4-dense-node"),
    # The non-expert matrices whole on every rank (DDP-like): nothing gathered, their
    # gradients averaged over all ranks once a step (in the last backward when accumulating).
    Run("ep2-dense-rank", [*COMMON, "parallel.ep=2", DENSE_RANK], ["flexshard"]),
    Run("ep4-accumulated-dense-rank", [*TWO_NODES, ACCUMULATE, DENSE_RANK], ["flexshard"]),
    # Accumulated micro-batches: the copies sum their gradients once, after the last one.
    Run("ep4-accumulated", [*TWO_NODES, ACCUMULATE], ["flexshard"]),
    Run("ep4-accumulated-dense-node", [*TWO_NODES, ACCUMULATE, DENSE_NODE], ["flexshard"]),
    # bf16 replicas (dp_replicate = 2) with accumulation: the replicas' and the expert
    # copies' once-a-step sums in fp32, then in bf16.
    Run("ep2-replicas-bf16", BF16_REPLICAS, ["flexshard"]),
    Run("ep2-replicas-bf16-reduce", [*BF16_REPLICAS, BF16_REDUCE], ["flexshard"]),
    # Node-limited routing: 8 experts, a token's 3 on one of the 2 nodes.
    Run("ep4-one-node-a-token", [*TWO_NODES, "model.num_experts=8", ONE_NODE], ["flexshard"]),
]
CHECKPOINTED = [*TWO_NODES, CHECKPOINTING]
# All-to-alls per MoE layer and forward / backward: the flat exchange sends counts, tokens
# and outputs, and reverses the last two; the two-level one does each at both levels.
EXCHANGES = {"flat": (3, 2), "two_level": (6, 4)}


def _exchange_calls(trainer) -> tuple[int, int]:
    """(all-to-alls, bytes the offloaded blocks moved to host) in one training step."""
    import torch.distributed as dist

    original, calls = dist.all_to_all_single, []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        trainer.step(0)
    finally:
        dist.all_to_all_single = original
    offload = trainer.job.state.get("offload")
    return len(calls), offload.take_stats().bytes_offloaded if offload else 0


def _kept_exchange_rank(rank: int, world: int, root: str) -> dict:
    """One step of each exchange with and without kept exchanges (and offload), counted."""
    from europa.core.session import open_session
    from europa.flexshard.exchange.kept import Keeper

    kept_bytes = []
    stop = Keeper.stop

    def measured_stop(self):
        buffers = stop(self)
        kept_bytes.append(sum(b.numel() * b.element_size() for b in buffers))
        return buffers

    Keeper.stop = measured_stop
    out = {}
    offload = ["offload.min_tensor_kib=0", "offload.keep_last_blocks=0"]
    for dispatch in EXCHANGES:
        for keep in (False, True):
            for plugins in (["flexshard"], ["flexshard", "offload"]):
                settings = [
                    *CHECKPOINTED,
                    f'parallel.ep_dispatch="{dispatch}"',
                    f"parallel.ep_keep_exchanges={str(keep).lower()}",
                    "metrics.progress=false",
                    "flexshard.log_plan=false",
                    *(offload if "offload" in plugins else []),
                ]
                config, manager = open_session("tiny", settings, plugins)
                run_dir = Path(root) / f"{dispatch}-{keep}-{len(plugins)}"
                trainer = rank_trainer(rank, world, config, manager, run_dir)
                kept_bytes.clear()
                calls, offloaded = _exchange_calls(trainer)
                out[dispatch, keep, len(plugins)] = {
                    "calls": calls,
                    "offloaded": offloaded,
                    "kept": sum(kept_bytes),
                    "loss": trainer.step(1)["loss"],
                }
    Keeper.stop = stop
    return out


def _group_rank(rank: int, world: int, root: str) -> dict:
    return {
        "runs": train_runs(rank, world, root, RUNS),
        "kept": _kept_exchange_rank(rank, world, root),
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Every 4-rank check of this module in one spawned group."""
    root = tmp_path_factory.mktemp("expert-runs")
    return root, run_ranks(_group_rank, 4, str(root), timeout=400)


@pytest.mark.distributed
def test_a_recomputation_exchanges_nothing_when_exchanges_are_kept(four_ranks):
    """The recomputed forward of full activation checkpointing re-runs no all-to-all; what
    it needed was saved with the block, and europa-offload moved it to host memory."""
    layers = load_config("tiny").model.n_layers - load_config("tiny").model.n_dense_layers
    for result in (r["kept"] for r in four_ranks[1]):
        for dispatch, (forward, backward) in EXCHANGES.items():
            for plugins in (1, 2):
                again, kept = result[dispatch, False, plugins], result[dispatch, True, plugins]
                assert again["calls"] == layers * (2 * forward + backward), dispatch
                assert kept["calls"] == layers * (forward + backward), dispatch
                assert again["kept"] == 0 < kept["kept"]
                assert kept["loss"] == pytest.approx(again["loss"], rel=1e-6)
            # with offload, the kept buffers are saved tensors like the blocks' inputs
            with_offload = result[dispatch, True, 2]
            moved = with_offload["offloaded"] - result[dispatch, False, 2]["offloaded"]
            assert moved == with_offload["kept"], dispatch


@pytest.mark.distributed
def test_expert_parallel_training_equals_ep_1_and_resumes_on_another_ep(four_ranks):
    runs = four_ranks[1][0]["runs"]
    losses = {name: [r["loss"] for r in records] for name, records in runs.items()}
    for ep in ("ep2", "ep4"):  # the same global batch: equal within fp32 noise
        assert losses[ep] == pytest.approx(losses["ep1"], rel=1e-5)
        # each matrix's square counted once, whether the dense and expert groups are the
        # same ranks (ep4: one all-reduce of both sums) or not (ep2 of 4 ranks)
        norms = [[r["grad_norm"] for r in runs[name]] for name in (ep, "ep1")]
        assert norms[0] == pytest.approx(norms[1], rel=1e-5)
        for mine, theirs in zip(runs[ep], runs["ep1"], strict=True):  # global token counts
            for layer, shares in mine["expert_load"].items():
                assert shares == pytest.approx(theirs["expert_load"][layer], abs=1e-6)
    assert losses["ep2-resumed-ep2"] == losses["ep2"]  # exactly
    assert losses["ep2-resumed-ep1"] == pytest.approx(losses["ep2"], rel=1e-5)
    # the two-level exchange across 2 nodes trains as the flat one
    assert losses["ep4-two-level"] == pytest.approx(losses["ep4"], rel=1e-6)
    for node, whole in (("ep4-dense-node", "ep4-two-level"),
                        ("ep4-accumulated-dense-node", "ep4-accumulated"),
                        ("ep2-dense-rank", "ep2"),
                        ("ep4-accumulated-dense-rank", "ep4-accumulated")):  # fmt: skip
        assert losses[node] == pytest.approx(losses[whole], rel=1e-6), node
    assert losses["ep4-all-resumed-node"] == pytest.approx(losses["ep4-two-level"], rel=1e-6)
    assert losses["ep4-node-resumed-all"] == pytest.approx(losses["ep4-dense-node"], rel=1e-6)
    fp8 = losses["ep4-two-level-fp8-kept"]
    assert fp8 == pytest.approx(losses["ep4"], rel=1e-2) and fp8 != losses["ep4"]
    bf16_sums, fp32_sums = losses["ep2-replicas-bf16-reduce"], losses["ep2-replicas-bf16"]
    assert bf16_sums == pytest.approx(fp32_sums, rel=2e-2) and bf16_sums != fp32_sums


@pytest.mark.distributed
def test_a_node_limited_run_exports_the_routing_it_trained_with(four_ranks, tmp_path):
    root, results = four_ranks
    run_dir = root / "ep4-one-node-a-token"
    job = json.loads((run_dir / "job.json").read_text())
    assert job["routing_groups"] == {"num_expert_groups": 2, "num_limited_groups": 1}
    assert run(["export-hf", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["n_group"], config["topk_group"]) == (2, 1)
    losses = [r["loss"] for r in results[0]["runs"]["ep4-one-node-a-token"]]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


def test_an_expert_split_the_ranks_cannot_hold_is_one_line(tmp_path, capsys):
    code = run(["train", "tiny", "-p", "flexshard", "--nproc", "4", *QUIET,
                "--run-dir", str(tmp_path / "run"), "--set", "parallel.ep=3"])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "europa: error: parallel.dp_replicate × parallel.ep = 3: expected a divisor of the 4 ranks"
    )


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ep2-replicas-bf16", "ep4-dense-node", "ep2-dense-rank"])
def test_a_flexshard_checkpoint_holds_each_byte_once_as_the_plan_says(four_ranks, name):
    """Replicas (dp_replicate) and the experts' copies on the other node write one copy:
    the bytes on disk are the unique state bytes europa plan reports."""
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session
    from tests.checkpoint_bytes import state_bytes_on_disk

    run_dir = four_ranks[0] / name
    config, plugins = open_session(str(run_dir / "config.toml"))
    plan = make_plan(config, plugins, load_profile("cpu"), 4)
    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    disk = state_bytes_on_disk(checkpoint, {p.name for p in plan.shapes.parameters})
    assert disk["files"] == disk["indexed"]
    assert disk["state_payload"] == plan.checkpoint_bytes
    assert 0 < disk["state_written"] - disk["state_payload"] < 2048 * disk["state_items"]
