"""The plan of pipeline stages (``europa.plan.simulate``,
``europa.core.plan.pipeline_plan``): the schedules' orders played out, and each pipeline
rank planned over its own layers."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from europa.core.pipeline.kinds import stages_per_rank
from europa.plan.schedules import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    SCHEDULE_NAMES,
    WEIGHT_GRAD,
    Action,
    rank_orders,
)
from europa.plan.simulate import simulate

schedules = st.sampled_from(SCHEDULE_NAMES)


def _valid(schedule: str, pp: int, micro: int) -> bool:
    stages = pp * stages_per_rank(schedule, 0)
    if schedule in ("1f1b", "dualpipev") and micro < stages:
        return False
    return not (schedule == "interleaved-1f1b" and micro % max(1, micro // pp))


@settings(max_examples=40, deadline=None)
@given(schedules, st.integers(2, 4), st.integers(2, 12), st.lists(st.floats(0.5, 3), min_size=8,
                                                                   max_size=8))  # fmt: skip
def test_every_stage_runs_each_micro_batch_once_after_what_it_needs(schedule, pp, micro, costs):
    assume(_valid(schedule, pp, micro))
    per_rank = stages_per_rank(schedule, 0)
    orders = rank_orders(schedule, pp, per_rank, micro)
    stages = pp * per_rank
    actions = [a for order in orders.values() for a in order]
    forwards = sorted((a.stage, a.micro) for a in actions if a.kind == FORWARD)
    assert forwards == [(s, m) for s in range(stages) for m in range(micro)]
    for s in range(stages):  # each stage's backward once, whole or as input then weights
        for m in range(micro):
            kinds = sorted(a.kind for a in actions if (a.stage, a.micro) == (s, m))
            assert kinds in ([BACKWARD, FORWARD], [FORWARD, INPUT_GRAD, WEIGHT_GRAD]), kinds
    # a rank runs only its own stages, and the step is no shorter than its busiest rank
    sim = simulate(orders, lambda s: costs[s], lambda a, b: 0.25)
    for rank, order in orders.items():
        assert {a.stage for a in order} <= set(range(stages))
        assert sim.busy_s[rank] <= sim.step_s + 1e-9
        assert 0 <= sim.bubble(rank) < 1
        # a stage's parts make up its compute, the first stage's split backward included
        held = {a.stage for a in order}
        assert sim.busy_s[rank] == pytest.approx(micro * sum(costs[s] for s in held))


@settings(max_examples=40, deadline=None)
@given(schedules, st.integers(2, 4), st.integers(2, 12), st.floats(0.1, 20))
def test_a_split_backward_holds_what_its_input_half_recomputed_until_its_weight_half(
    schedule, pp, micro, recomputed
):
    """recompute_once's recomputation, made in a stage's I and read again in its W, is
    held between them on every stage but the first (whose I computes nothing): at most
    every micro-batch waiting for its W at once; never more when a rank holds nothing."""
    assume(_valid(schedule, pp, micro))
    orders = rank_orders(schedule, pp, stages_per_rank(schedule, 0), micro)
    plain = simulate(orders, lambda s: 1.0, lambda a, b: 0.0, lambda s: 1.0)
    split = simulate(orders, lambda s: 1.0, lambda a, b: 0.0, lambda s: 1.0,
                     recomputed_bytes=lambda s: recomputed)  # fmt: skip
    for rank, order in orders.items():
        halves = [(a.stage, a.micro) for a in order if a.kind == INPUT_GRAD and a.stage]
        if not halves:  # whole backwards, or only the first stage's split one
            assert split.peak_held[rank] == plain.peak_held[rank]
            continue
        # when an I ends, its micro-batch's forward is held too
        assert split.peak_held[rank] >= max(plain.peak_held[rank], 1 + recomputed) - 1e-9
        assert split.peak_held[rank] <= plain.peak_held[rank] + recomputed * len(halves) + 1e-9


def test_recomputation_under_zbv_plans_each_stages_recomputed_blocks_held_to_its_weights():
    """ZBV with every block recomputed against 1F1B's on the same ranks: the rank holding
    the last stage (rank 0) also holds that stage's recomputed activations from its I to
    its W, which a whole backward frees a block at a time."""
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session

    def device_activations(schedule: str) -> int:
        sets = [
            "parallel.pp=2",
            "training.grad_accum_steps=4",
            'activation_checkpointing.mode="full"',
            f'parallel.pp_schedule="{schedule}"',
        ]
        config, plugins = open_session("tiny", sets, [])
        plan = make_plan(config, plugins, load_profile("gh200-jupiter"), 2)
        return max(plan.rank_view(r)[0].device_terms["activations"] for r in (0, 1))

    assert device_activations("zbv") > device_activations("interleaved-1f1b")


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 8), st.integers(1, 24))
def test_1f1b_with_equal_stages_waits_its_textbook_bubble_and_holds_p_minus_r(pp, micro):
    micro = max(micro, pp)
    sim = simulate(rank_orders("1f1b", pp, 1, micro), lambda s: 3.0, lambda a, b: 0.0,
                   lambda s: 1.0)  # fmt: skip
    assert sim.step_s == pytest.approx(3.0 * (micro + pp - 1))
    for rank in range(pp):
        assert sim.bubble(rank) == pytest.approx((pp - 1) / (micro + pp - 1))
        assert sim.peak_held[rank] == min(micro, pp - rank)  # the first stage holds P


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.integers(0, 8), st.lists(st.floats(0.5, 3), min_size=8, max_size=8),
       st.floats(0, 1))  # fmt: skip
def test_paired_chunks_side_by_side_save_at_most_their_exchange(pp, extra, costs, exchange):
    """DualPipeV's paired chunks side by side: never slower than with no exchange to hide
    (both inputs awaited, then the parts' sum), never faster than that less every pair's
    exchange; in turn, as torch runs them, no slower than that either."""
    micro = 2 * pp + extra
    orders = rank_orders("dualpipev", pp, 2, micro)
    transfer = lambda a, b: 0.25  # noqa: E731
    in_turn = simulate(orders, lambda s: costs[s], transfer, lambda s: 1.0)
    nothing = simulate(orders, lambda s: costs[s], transfer, exchange_s=lambda s: 0.0)
    side = simulate(orders, lambda s: costs[s], transfer, lambda s: 1.0,
                    exchange_s=lambda s: exchange * costs[s])  # fmt: skip
    paired = [a for order in orders.values() for a in order if a.paired]
    assert paired  # dualpipev pairs chunks in its steady state
    hideable = sum(exchange * costs[a.stage] * (1 / 3 if a.kind == FORWARD else 2 / 3)
                   for a in paired)  # fmt: skip
    assert nothing.step_s - hideable - 1e-9 <= side.step_s <= nothing.step_s + 1e-9
    assert in_turn.step_s <= nothing.step_s + 1e-9
    assert side.peak_held == in_turn.peak_held  # what is held depends on the order alone


def test_a_pair_takes_the_longest_of_its_computes_its_exchanges_and_each_part():
    pair = {0: [Action(0, FORWARD, 1, paired=True), Action(1, BACKWARD, 0, paired=True)]}
    done_before = {0: [Action(0, FORWARD, 0), Action(1, FORWARD, 0)]}
    orders = {0: done_before[0] + pair[0]}
    cost = {0: 6.0, 1: 3.75}  # F: 2 (exchange 1), B: 2.5 (exchange 0.5)
    share = {0: 0.5, 1: 0.2}  # of each stage's time, its exchange
    side = simulate(orders, cost.__getitem__, lambda a, b: 0.0,
                    exchange_s=lambda s: share[s] * cost[s])  # fmt: skip
    in_turn = simulate(orders, cost.__getitem__, lambda a, b: 0.0)
    # before the pair: 2 + 1.25; the pair: max(1 + 2, 1 + 0.5, 2, 2.5) = 3, in turn 4.5
    assert side.step_s == pytest.approx(3.25 + 3.0)
    assert in_turn.step_s == pytest.approx(3.25 + 4.5)


def test_the_first_stage_computes_its_split_backward_in_the_weight_half():
    """Its input is tokens, with no gradient to compute: torch runs the whole backward
    when asked for the weights'."""
    first = [Action(0, FORWARD, 0), Action(0, INPUT_GRAD, 0), Action(0, WEIGHT_GRAD, 0)]
    later = [Action(1, FORWARD, 0), Action(1, INPUT_GRAD, 0), Action(1, WEIGHT_GRAD, 0)]
    assert [a.share for a in first] == pytest.approx([1 / 3, 0, 2 / 3])
    assert [a.share for a in later] == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    # rank 1's input gradient reaches rank 0, which then has its whole backward to do
    sim = simulate({0: [first[0], first[1], first[2]], 1: later}, lambda s: 3.0,
                   lambda a, b: 0.0)  # fmt: skip
    assert sim.finished_s == pytest.approx({0: 1 + 2 + 2, 1: 1 + 1 + 2})


def test_a_pipeline_rank_done_early_waits_out_the_pipelines_step():
    from europa.core.pipeline.runner import bubbles

    # rank 1 computed 0.9 s of its own 1.0 s run; the pipeline's step was rank 0's 1.2 s
    assert bubbles([1.1, 0.9], [1.2, 1.0]) == pytest.approx([1 - 1.1 / 1.2, 1 - 0.9 / 1.2])


def test_an_order_that_cannot_proceed_is_named():
    stuck = {0: [Action(0, BACKWARD, 0)], 1: [Action(1, FORWARD, 0)]}
    with pytest.raises(ValueError, match=r"ranks wait at \{0: '0B0', 1: '1F0'\}"):
        simulate(stuck, lambda s: 1.0, lambda a, b: 0.0)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_each_pipeline_rank_is_planned_over_its_own_layers_once(schedule):
    from europa.core.model import build_moe_model
    from europa.core.plan import load_profile, make_plan
    from europa.core.plan.shapes import ModelShapes
    from europa.core.session import open_session

    sets = ["parallel.pp=2", "training.grad_accum_steps=4", f'parallel.pp_schedule="{schedule}"']
    config, plugins = open_session("tiny", sets, ["flexshard"])
    shapes = ModelShapes.of(build_moe_model(config.model))
    plan = make_plan(config, plugins, load_profile("cpu"), 4, shapes=shapes)
    pipeline = plan.pipeline
    # every module on exactly one pipeline rank; stages cut once, in order
    held = [m for r in pipeline.ranks for m in r.modules]
    assert sorted(held) == sorted(m for stage in pipeline.stage_modules for m in stage)
    assert len(held) == len(set(held))
    layers = [m for stage in pipeline.stage_modules for m in stage if m.startswith("layers.")]
    assert layers == [f"layers.{k}" for k in shapes.layer_keys()]
    # each rank's parameters once: the ranks' parameter counts sum to the model's
    parts = [shapes.subset(r.modules).counts.total for r in pipeline.ranks]
    assert sum(parts) == shapes.counts.total
    # what flows between stages, each step: a hidden state per micro-batch and crossing
    t = config.training
    assert pipeline.hidden_bytes == t.batch_size * t.seq_len * config.model.dim * 4  # fp32
    assert all(r.send_bytes % pipeline.hidden_bytes == 0 and r.send_bytes for r in pipeline.ranks)
    # the heaviest rank's memory is the plan's, and every plan of it is the same
    assert plan.device_total == max(r.device_bytes for r in pipeline.ranks)
    again = make_plan(config, plugins, load_profile("cpu"), 4, shapes=shapes)
    assert again.pipeline == pipeline


def test_offloaded_activations_travel_once_a_micro_batch_whatever_a_rank_holds_at_once():
    """1F1B's first pipeline rank holds two micro-batches' offloaded activations at once,
    the last one: each sends and fetches every micro-batch's once, M a step."""
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session

    micro = 4
    sets = [
        "parallel.pp=2",
        f"training.grad_accum_steps={micro}",
        "offload.min_tensor_kib=1",
        "offload.keep_last_blocks=0",
    ]
    config, plugins = open_session("tiny", sets, ["offload"])
    plan = make_plan(config, plugins, load_profile("gh200-jupiter"), 2)
    held = [r.held_micro_batches for r in plan.pipeline.ranks]
    assert held == [2, 1]
    for rank in (0, 1):
        own, local = plan.rank_view(rank)
        traffic = own.traffic_of(local)
        copies = {t.link: t.bytes_per_step for t in traffic if t.kind == "host_copies"}
        held_host = own.host_terms["activations"]
        assert held_host > 0
        # what it holds at once is held[rank] micro-batches' worth; what travels, M of them
        assert copies["device_to_host"] == pytest.approx(held_host / held[rank] * micro)


def test_a_stage_gathers_its_root_parts_for_forward_and_again_for_backward():
    """Around a whole model the root (embedding, final norm, head) stays gathered from
    forward to backward; a stage gathers each part as a block of its own, twice a
    micro-batch (the seed's execution sent 1.35x the gathers planned before this)."""
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session
    from europa.spec.plan_layout import ROOT_UNIT

    micro = 4
    sets = ["parallel.pp=2", f"training.grad_accum_steps={micro}"]
    config, plugins = open_session("tiny", sets, ["flexshard"])
    plan = make_plan(config, plugins, load_profile("gh200-jupiter"), 4)
    for rank in (0, 3):  # the first pipeline rank (the embedding), the last (norm, head)
        own, local = plan.rank_view(rank)
        units = own.layout["gathered_unit_wire_elements"]
        assert ROOT_UNIT in units
        group = own.layout["gather_group_size"]
        itemsize = 2 if config.training.dtype == "bfloat16" else 4
        expected = sum(units.values()) * 2 * (group - 1) / group * itemsize * micro
        sent = [t for t in own.traffic_of(local) if t.kind == "parameter_gather"]
        assert sum(t.bytes_per_step for t in sent) == pytest.approx(expected, rel=1e-6)
