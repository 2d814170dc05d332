"""``europa train -p overlap``: the same losses with and without it, under FlexShard (ep = 2,
also with recomputation and offload) and FSDP2; the timeline in metrics.jsonl; ``europa
trace``; the plan; bad input."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from europa.cli.app import run
from tests.trainer_runs import Run

COMMON = [
    "training.steps=3",
    "training.grad_accum_steps=2",
    "training.batch_size=2",
    "training.seq_len=32",
]
EP = ["parallel.ep=2", "flexshard.log_plan=false"]
RECOMPUTE = ['activation_checkpointing.mode="full"', "offload.min_tensor_kib=1"]
TWO_LEVEL_KEPT = ["parallel.ranks_per_node=1", "parallel.ep_keep_exchanges=true"]
KEEP_LAST = ['overlap.reshard_after_forward="all_but_last"', "overlap.prefetch_depth=2"]
RUNS = [
    Run("flexshard", [*COMMON, *EP], ["flexshard"]),
    Run("flexshard-overlap", [*COMMON, *EP, "overlap.trace_steps=2"], ["flexshard", "overlap"]),
    Run("flexshard-offload", [*COMMON, *EP, *RECOMPUTE], ["flexshard", "offload"]),
    Run(
        "flexshard-offload-overlap",
        [*COMMON, *EP, *RECOMPUTE, *KEEP_LAST],
        ["flexshard", "offload", "overlap"],
    ),
    Run("fsdp2", COMMON),
    Run("fsdp2-overlap", [*COMMON, *KEEP_LAST], ["overlap"]),
    # The two-level exchange (a node per rank) with kept exchanges, chunked by token.
    Run("two-level-kept", [*COMMON, *EP, *RECOMPUTE, *TWO_LEVEL_KEPT], ["flexshard", "offload"]),
    Run(
        "two-level-kept-overlap",
        [*COMMON, *EP, *RECOMPUTE, *TWO_LEVEL_KEPT],
        ["flexshard", "offload", "overlap"],
    ),
]
PAIRS = [
    (r.name, f"{r.name}-overlap")
    for r in RUNS
    if "overlap" not in r.name and "two-level" not in r.name
]


@pytest.fixture
def runs(overlap_group):
    root, results = overlap_group  # RUNS on 2 gloo ranks (conftest.py); rank 0's metrics
    return root, results[0]["runs"]


@pytest.mark.distributed
def test_losses_are_identical_with_and_without_overlap(runs):
    _, records = runs
    for plain, overlapped in PAIRS:
        assert len(records[plain]) == 3
        for a, b in zip(records[plain], records[overlapped], strict=True):
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (plain, a["step"])


@pytest.mark.distributed
def test_the_two_level_exchange_overlaps_with_kept_exchanges_and_trains_as_the_flat_one(runs):
    """Chunks of tokens: equal to the unchunked exchange to rounding, which equals the flat
    exchange (recomputing its exchanges) to rounding."""
    _, records = runs
    for name in ("two-level-kept", "two-level-kept-overlap"):
        for a, b in zip(records[name], records["flexshard-offload"], strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (name, a["step"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (name, a["step"])


@pytest.mark.distributed
def test_every_step_reports_its_communication(runs):
    _, records = runs
    for name in ("flexshard-overlap", "flexshard-offload-overlap", "fsdp2-overlap"):
        for record in records[name]:
            assert 0 < record["overlap_compute_s"] <= record["overlap_step_s"]
            assert 0 <= record["overlap_exposed_comm_s"] <= record["overlap_comm_s"]
            assert record["overlap_parameter_gather_s"] > 0
            assert record["overlap_gradient_reduce_scatter_s"] > 0
    assert all(r["overlap_expert_all_to_all_s"] > 0 for r in records["flexshard-overlap"])
    assert all(r["overlap_expert_all_to_all_s"] == 0 for r in records["fsdp2-overlap"])
    assert not any(k.startswith("overlap_") for k in records["flexshard"][0])


@pytest.mark.distributed
def test_trace_draws_one_lane_per_rank_with_compute_and_communication(runs, capsys):
    root, _ = runs
    run_dir = root / "flexshard-overlap"
    assert run(["trace", str(run_dir)]) == 0
    assert capsys.readouterr().out.split() == [
        str(run_dir / "trace.html"),
        str(run_dir / "trace.json"),
    ]
    page = (run_dir / "trace.html").read_text()
    lanes = re.findall(r'<g class="lane" data-rank="(\d+)">(.*?)</g>', page, re.S)
    assert [rank for rank, _ in lanes] == ["0", "1"]
    for _, lane in lanes:
        steps = set(re.findall(r'class="compute" data-step="(\d+)"', lane))
        assert steps == {"1", "2"}  # trace_steps = 2, after the first
        for kind in ("parameter_gather", "gradient_reduce_scatter", "expert_all_to_all"):
            assert f'class="comm {kind}"' in lane
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    assert {e["cat"] for e in slices} == {"compute", "comm"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)


def test_trace_of_a_run_without_timelines_is_one_line(tmp_path, capsys):
    assert run(["trace", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"europa: error: run directory {tmp_path}: no overlap/timeline-rank*.jsonl; expected a "
        "run trained with -p overlap and overlap.timeline = true (overlap.trace_steps > 0)"
    )


def test_a_bad_setting_is_one_line(tmp_path, capsys):
    code = run(["train", "tiny", "-p", "overlap", "--nproc", "1", "--run-dir", str(tmp_path),
                "--set", 'overlap.reshard_after_forward="some"'])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        'europa: error: overlap.reshard_after_forward = "some": expected one of "all", '
        '"all_but_last", "none"'
    ]


def test_the_plan_hook_names_the_kinds_run_beside_compute():
    from europa.core.session import open_session
    from europa.overlap import plugin

    for chunks, all_to_all in ((2, True), (0, False)):
        config, _ = open_session(
            "tiny", ["parallel.ep=2", f"overlap.expert_chunks={chunks}"], ["overlap"]
        )
        plan = {}
        plugin.europa_plan(job=SimpleNamespace(config=config, node_size=1), plan=plan)
        assert ("expert_all_to_all" in plan["overlapped_kinds"]) == all_to_all
        assert {"parameter_gather", "host_copies"} <= set(plan["overlapped_kinds"])
        assert "optimizer_step" not in plan["overlapped_kinds"]


def test_the_expert_exchange_is_chunked_across_nodes_and_not_within_one():
    from europa.core.session import open_session
    from europa.overlap import plugin

    sets = ["overlap.expert_chunks=3", "overlap.expert_chunks_within_node=1"]
    for ep, node_size, chunks in ((2, 1, 3), (4, 2, 3), (2, 2, 1), (2, 4, 1)):
        config, _ = open_session("tiny", [f"parallel.ep={ep}", *sets], ["overlap"])
        job = SimpleNamespace(config=config, node_size=node_size)
        assert plugin.expert_chunks(job) == chunks, (ep, node_size)
        plan = {}
        plugin.europa_plan(job=job, plan=plan)
        assert plan["overlap"]["expert_chunks"] == chunks
