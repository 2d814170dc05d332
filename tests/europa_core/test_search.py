"""``europa plan --search``: the layouts it proposes fit, keep the global batch, are
ranked by planned step time, are reproduced by the arguments printed with them, and
train."""

from __future__ import annotations

import json
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.cli.app import run
from europa.core.model import build_moe_model
from europa.core.plan import load_profile, make_plan
from europa.core.plan.search import plan_inputs, search_layouts
from europa.core.plan.shapes import ModelShapes
from europa.core.plugins import EuropaPluginManager
from europa.core.session import open_session
from tests.conftest import run_ranks
from tests.trainer_runs import Run, train_runs

CPU = load_profile("cpu")


def _search(preset: str, overrides: list[str], world: int, plugins=()):
    manager = EuropaPluginManager()
    base, _ = open_session(preset, overrides, plugins, manager, cross_field_rules=False)
    model = build_moe_model(base.model)
    shapes = ModelShapes.of(model)
    per_node = base.parallel.ranks_per_node or CPU.gpus_per_node
    result = search_layouts(
        source=preset,
        overrides=overrides,
        plugins=list(plugins),
        manager=manager,
        plan_for=lambda cfg, mgr: make_plan(cfg, mgr, CPU, world, shapes=shapes),
        world_size=world,
        ranks_per_node=per_node,
        plan_inputs=plan_inputs(shapes, CPU, world, per_node),
    )
    return result, manager, model


def _arguments(words: str) -> tuple[list[str], list[str]]:
    """(-p plugins, --set overrides) of a printed proposal."""
    tokens = shlex.split(words)
    plugins = [tokens[i + 1] for i, t in enumerate(tokens) if t == "-p"]
    sets = [tokens[i + 1] for i, t in enumerate(tokens) if t == "--set"]
    return plugins, sets


@settings(max_examples=4, deadline=None)
@given(
    sequences=st.sampled_from([1, 2, 4]),
    world=st.sampled_from([2, 4]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
def test_proposals_fit_keep_the_global_batch_and_are_reproduced_by_their_arguments(
    sequences, world, dtype
):
    overrides = [
        "training.seq_len=32",
        f"training.batch_size={sequences}",
        f'training.dtype="{dtype}"',
        "parallel.ranks_per_node=2",
    ]
    result, manager, model = _search("tiny", overrides, world)
    proposals = result.proposals
    assert proposals and result.planned >= len(proposals) and result.skipped > 0
    steps = [round(p.step.step_s, 9) for p in proposals]  # ties within 1e-9 s: less memory first
    assert steps == sorted(steps)
    for p in proposals:
        assert p.plan.fits
        assert p.plan.tokens_per_step == world * sequences * 32  # the same global batch
        sets = dict(p.sets)
        if sets.get("parallel.ep_keep_exchanges"):  # refused without recomputation
            assert sets["activation_checkpointing.mode"] == "full"
    for p in proposals[:5]:  # the printed arguments, added to the command, give the layout
        plugins, sets = _arguments(result.arguments(p))
        config, plugins_on = open_session("tiny", [*overrides, *sets], plugins, manager)
        again = make_plan(config, plugins_on, CPU, world, model=model)
        assert again.device_total == p.plan.device_total
        assert again.with_overlap == p.plan.with_overlap
        assert again.without_overlap == p.plan.without_overlap


def test_the_search_leaves_node_limited_routing_as_the_config_sets_it():
    overrides = ["training.seq_len=32", "parallel.ranks_per_node=2", "model.num_experts=8"]
    unlimited, _, _ = _search("tiny", overrides, 4)
    assert all(p.plan.config.parallel.ep_max_nodes_per_token == 0 for p in unlimited.proposals)
    limited, _, _ = _search("tiny", [*overrides, "parallel.ep_max_nodes_per_token=1"], 4)
    assert limited.proposals
    for p in limited.proposals:  # only layouts the limit applies to: with ep
        assert p.plan.config.parallel.ep_max_nodes_per_token == 1
        assert p.plan.config.parallel.ep > 1


def _long(seq_len: int) -> list[str]:
    return [f"model.max_seq_len={seq_len}", f"training.seq_len={seq_len}",
            "training.batch_size=1", "parallel.ranks_per_node=4"]  # fmt: skip


def test_the_search_cuts_sequences_over_ranks_only_when_no_layout_fits_without():
    """tiny on 4 CPU ranks: 32k tokens fit a rank, 64k do not; then each group of cp ranks
    reads cp sequences, so the global batch stays, and the arguments give the layout."""
    whole, _, _ = _search("tiny", _long(32768), 4)
    assert whole.proposals
    assert all(p.plan.config.parallel.cp == 1 for p in whole.proposals)
    overrides = _long(65536)
    cut, manager, model = _search("tiny", overrides, 4)
    assert cut.proposals
    for p in cut.proposals:
        assert p.plan.config.parallel.cp > 1 and p.plan.fits
        assert p.plan.tokens_per_step == 4 * 65536
    plugins, sets = _arguments(cut.arguments(cut.proposals[0]))
    assert any(s.startswith("parallel.cp=") for s in sets)
    config, plugins_on = open_session("tiny", [*overrides, *sets], plugins, manager)
    again = make_plan(config, plugins_on, CPU, 4, model=model)
    assert again.with_overlap == cut.proposals[0].plan.with_overlap


def test_the_seed_search_prints_its_best_layouts_as_json(capsys):
    seed = ["plan", "kimi-k2", "--hardware", "gh200-jupiter", "--replicas", "4",
            "--gpus-per-replica", "384", "--search", "--json"]  # fmt: skip
    assert run([*seed, "--set", "parallel.ep_max_nodes_per_token=4"]) == 0
    found = json.loads(capsys.readouterr().out)
    proposals = found["search"]["proposals"]
    assert len(proposals) == 5 and found["fits"]
    best = proposals[0]
    assert best["mfu"] == pytest.approx(found["step"]["with_overlap"]["mfu"])
    assert best["device_bytes"] <= best["device_capacity"]
    assert [p["step_s"] for p in proposals] == sorted(p["step_s"] for p in proposals)
    assert "-p flexshard" in best["arguments"] and "parallel.ep=384" in best["arguments"]
    # the best with pipeline stages beside the best without: the seed's 61 layers in stages
    staged = found["search"]["stages"]
    assert staged["without_stages"] == best
    assert "parallel.pp=" in staged["with_stages"]["arguments"]
    assert staged["with_stages"]["device_bytes"] <= staged["with_stages"]["device_capacity"]


# -- every proposal trains: the 3 best for debug on 4 CPU ranks, 2 steps each --------------

DEBUG = ["training.seq_len=64", "training.batch_size=2", "parallel.ranks_per_node=2"]


def _proposal_runs(rank: int, world: int, root: str, runs: list[Run]):
    return train_runs(rank, world, root, runs)


@pytest.mark.distributed
def test_the_three_best_proposals_for_debug_train(tmp_path):
    result, _, _ = _search("debug", DEBUG, 4)
    runs = []
    for i, p in enumerate(result.proposals[:3]):
        plugins, sets = _arguments(result.arguments(p))
        overrides = [*DEBUG, *sets, "training.steps=2", "checkpoint.every=0"]
        runs.append(Run(f"proposal-{i}", overrides, plugins, preset="debug"))
    records = run_ranks(_proposal_runs, 4, str(tmp_path), runs, timeout=400)[0]
    for r in runs:
        losses = [line["loss"] for line in records[r.name]]
        assert len(losses) == 2 and all(loss == loss for loss in losses), r


KEY = "overlap.reshard_after_forward"


def test_the_search_keeps_blocks_gathered_to_backward_where_it_plans_that_faster():
    # overlap.reshard_after_forward = "none": one gather of each block a micro-batch instead
    # of two, for the memory of every block kept; the search plans both and ranks them.
    result, _, _ = _search("tiny", [], 2)
    for proposal in result.proposals:
        policy = dict(proposal.sets).get(KEY)
        assert (policy is not None) == ("overlap" in proposal.plugins)
    kept = [p for p in result.proposals if dict(p.sets).get(KEY) == "none"]
    freed = {
        (p.plugins, tuple(s for s in p.sets if s[0] != KEY)): p
        for p in result.proposals
        if dict(p.sets).get(KEY) == "all"
    }
    assert kept
    fewer = 0
    for p in kept:
        twin = freed.get((p.plugins, tuple(s for s in p.sets if s[0] != KEY)))
        if twin is None:
            continue
        gathers = [
            sum(t.bytes_per_step for t in q.plan.traffic if t.kind == "parameter_gather")
            for q in (p, twin)
        ]
        assert gathers[0] <= gathers[1] and p.plan.device_total >= twin.plan.device_total
        fewer += gathers[0] < gathers[1]
    assert fewer  # a gathered layout among them, planned with one gather a block, not two
