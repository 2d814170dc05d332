"""What ``europa plan`` says of the expert exchange and the dense layout: each lever's bytes
by link, kept exchanges' memory, and the seed scenario's exchange time."""

from __future__ import annotations

import pytest

from europa.core.plan import load_profile, make_plan
from europa.core.session import open_session

SEED = [
    "parallel.dp_replicate=4",
    "parallel.dp_shard=-1",
    "parallel.ep=384",
    'activation_checkpointing.mode="full"',
    # as docs/plan.md's table of levers: the non-expert matrices within a node (split over
    # all 384 GPUs, a unit's padded reduce-scatter rows alone would need 1.6 TiB a GPU)
    'flexshard.dense_group="node"',
]
LEVERS = {
    "flat": ['parallel.ep_dispatch="flat"'],
    "two_level": [],  # "auto": the ep group spans 96 nodes
    "fp8": ['parallel.ep_dispatch_dtype="float8_e4m3fn"'],
    "kept": ['parallel.ep_dispatch_dtype="float8_e4m3fn"', "parallel.ep_keep_exchanges=true"],
    "max_nodes_4": [
        'parallel.ep_dispatch_dtype="float8_e4m3fn"',
        "parallel.ep_keep_exchanges=true",
        "parallel.ep_max_nodes_per_token=4",
    ],
}


def _plan(preset, settings, plugins, hardware, world):
    config, manager = open_session(preset, settings, plugins)
    return make_plan(config, manager, load_profile(hardware), world)


def _exchange(plan) -> dict[str, tuple[int, float]]:
    """{link: (bytes, seconds)} of the expert exchange."""
    return {
        t.link: (t.bytes_per_step, plan.without_overlap.link_s[t.kind, t.link])
        for t in plan.traffic
        if t.kind == "expert_all_to_all"
    }


@pytest.fixture(scope="module")
def seed_plans():
    return {
        lever: _plan(
            "kimi-k2",
            [*SEED, "offload.optimizer_state=true", *extra],
            ["flexshard", "offload"],
            "gh200-jupiter",
            1536,
        )
        for lever, extra in LEVERS.items()
    }


def test_each_lever_cuts_the_seed_plans_inter_node_exchange(seed_plans):
    inter = [_exchange(seed_plans[lever])["inter_node"][0] for lever in LEVERS]
    assert inter == sorted(inter, reverse=True) and len(set(inter)) == len(inter)
    assert all(plan.fits for plan in seed_plans.values())


def test_the_seed_exchange_time_falls_three_fold_with_every_lever_and_four_nodes(seed_plans):
    before = sum(s for _, s in _exchange(seed_plans["flat"]).values())
    after = sum(s for _, s in _exchange(seed_plans["max_nodes_4"]).values())
    assert before / after >= 3


def test_kept_exchanges_trade_network_for_saved_memory(seed_plans):
    fp8, kept = seed_plans["fp8"], seed_plans["kept"]
    saved = kept.plugins["flexshard"]["expert_exchange"]
    assert saved["forward_passes_exchanging"] == 1
    assert fp8.plugins["flexshard"]["expert_exchange"]["forward_passes_exchanging"] == 2
    assert saved["kept_bytes_per_moe_block"] > 0
    moe_blocks = 60  # kimi-k2: 61 layers, the first dense
    extra = kept.activations.device + kept.activations.host
    extra -= fp8.activations.device + fp8.activations.host
    assert extra == moe_blocks * saved["kept_bytes_per_moe_block"]


def test_two_level_sends_at_most_0_65_of_flat_between_the_benchmarks_two_nodes():
    common = ["parallel.ep=4", "parallel.ranks_per_node=2"]
    flat = _plan("debug", [*common, 'parallel.ep_dispatch="flat"'], ["flexshard"], "cpu", 4)
    two = _plan("debug", common, ["flexshard"], "cpu", 4)
    assert two.plugins["flexshard"]["expert_exchange"]["dispatch"] == "two_level"
    assert _exchange(two)["inter_node"][0] <= 0.65 * _exchange(flat)["inter_node"][0]


def test_dense_matrices_within_a_node_gather_on_its_link_and_reduce_once_a_step():
    common = ["parallel.ep=4", "parallel.ranks_per_node=2", "training.grad_accum_steps=4"]
    whole = _plan("debug", common, ["flexshard"], "cpu", 4)
    node = _plan("debug", [*common, 'flexshard.dense_group="node"'], ["flexshard"], "cpu", 4)
    links = {t.kind: t.link for t in node.traffic}
    assert links["parameter_gather"] == links["gradient_reduce_scatter"] == "intra_node"
    assert links["gradient_replica_all_reduce"] == "inter_node"
    assert {t.kind: t.link for t in whole.traffic}["parameter_gather"] == "inter_node"
    dense = node.layout["replicated_elements"]  # the owned non-expert elements
    replica = next(t for t in node.traffic if t.kind == "gradient_replica_all_reduce")
    assert replica.bytes_per_step == 2 * dense * 4 * (1 / 2)  # once, not once per micro-batch
    assert node.layout["group_size"] == 2


def test_dense_matrices_whole_on_every_rank_gather_nothing_and_reduce_once_a_step():
    common = ["parallel.ep=2", "training.grad_accum_steps=4"]
    whole = _plan("debug", [*common, 'flexshard.dense_group="rank"'], ["flexshard"], "cpu", 2)
    shared = _plan("debug", common, ["flexshard"], "cpu", 2)
    sent = {t.kind: t.bytes_per_step for t in whole.traffic}
    assert sent.get("parameter_gather", 0) == sent.get("gradient_reduce_scatter", 0) == 0
    assert {"parameter_gather", "gradient_reduce_scatter"} <= {t.kind for t in shared.traffic}
    assert whole.layout["group_size"] == 1 and whole.layout["gathered_unit_elements"] == {}
    dense = whole.layout["replicated_elements"]  # every non-expert element, on each rank
    assert sent["gradient_replica_all_reduce"] == 2 * dense * 4 * (1 / 2)  # once a step
    assert whole.device_terms["gathered_parameters"] == 0
    assert shared.device_terms["gathered_parameters"] > 0
    assert max(whole.layout["stored_elements"]) > max(shared.layout["stored_elements"])


def test_once_a_step_sums_overlap_only_the_last_backward_and_the_roots_follows_it():
    """The copies' sums start in the last micro-batch's backward: with one micro-batch
    they run beside its whole backward, with more beside a shorter one; the root's sum
    (its gradient completes last) is never hidden."""
    common = [*SEED, 'flexshard.dense_group="node"', *LEVERS["max_nodes_4"]]
    plugins = ["flexshard", "overlap"]
    once = _plan("kimi-k2", common, plugins, "gh200-jupiter", 1536)
    replica = next(t for t in once.traffic if t.kind == "gradient_replica_all_reduce")
    copies = next(t for t in once.traffic if t.kind == "expert_gradient_all_reduce")
    assert replica.window == copies.window == "last_backward"
    assert 0 < replica.tail_bytes < replica.bytes_per_step and copies.tail_bytes == 0
    seconds = once.with_overlap.link_s
    # QK-clip's maxima (kimi-k2 has it on) are reduced after the backward, beside nothing.
    maxima = sum(s for (kind, _), s in seconds.items() if kind == "qk_clip_maxima")
    assert maxima > 0
    inter = sum(
        s
        for (kind, link), s in seconds.items()
        if link == "inter_node" and kind != "qk_clip_maxima"
    )
    compute = once.with_overlap.compute_s
    # One micro-batch: the network's whole load past the compute is what shows.
    assert once.with_overlap.exposed_s == pytest.approx(inter - compute + maxima, rel=1e-12)
    assert (
        once.with_overlap.exposed_s
        < seconds[replica.kind, replica.link] + seconds[copies.kind, copies.link]
    )
    # Eight micro-batches of an eighth of the sequences: the same sums beside an eighth of
    # the backward, so more of them shows.
    eight = _plan(
        "kimi-k2",
        [*common, "training.seq_len=512", "training.grad_accum_steps=8"],
        plugins,
        "gh200-jupiter",
        1536,
    )
    backward = eight.with_overlap.last_backward_s  # the last of eight, recomputation and all
    assert 0 < backward < eight.with_overlap.compute_s / 8
    sums = sum(
        s
        for (kind, _), s in eight.with_overlap.link_s.items()
        if kind in ("gradient_replica_all_reduce", "expert_gradient_all_reduce")
    )
    assert eight.with_overlap.exposed_s >= sums - backward - 1e-9
