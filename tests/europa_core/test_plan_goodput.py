"""Goodput under failures (``europa.core.plan.goodput``): its bounds, the Young–Daly
interval against a numeric maximisation, fault tolerance against a full restart, one
example by hand; the profile keys it reads; and the figures a plan and ``europa plan``
carry."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from europa.core.errors import ConfigError
from europa.core.plan import load_profile, make_plan
from europa.core.plan.goodput import (
    LLAMA3_FAILURES_PER_GPU_HOUR,
    estimate,
    goodput_with_ft,
    goodput_without_ft,
    job_mtbf_s,
    optimum_interval,
    save_seconds,
    young_daly_interval,
)
from europa.core.plan.report import plan_json, plan_table
from europa.core.session import open_session
from tests.europa_core.test_plan import (
    PROFILE,  # a small CUDA profile, as the planner tests write it
)

seconds = st.floats(0, 1e4)
mtbfs = st.floats(1.0, 1e9)
intervals = st.floats(0, 1e7)


def _argmax(f, low: float, high: float, rounds: int = 300) -> float:
    """Golden-section search for the peak of a unimodal ``f`` on ``[low, high]``, over
    log(x), as the peak may sit anywhere from seconds to weeks."""
    a, b = math.log(low), math.log(high)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(rounds):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if f(math.exp(c)) < f(math.exp(d)):
            a = c
        else:
            b = d
    return math.exp((a + b) / 2)


@given(
    interval=intervals,
    save=seconds,
    recovery=seconds,
    mtbf=mtbfs,
    replicas=st.integers(2, 64),
    step=st.floats(0, 1e3),
)
def test_goodput_is_a_share_of_the_wall_time(interval, save, recovery, mtbf, replicas, step):
    for value in (
        goodput_without_ft(interval, save, recovery, mtbf),
        goodput_with_ft(interval, save, recovery, replicas, step, mtbf),
        goodput_without_ft(math.inf, save, recovery, mtbf),
        goodput_with_ft(math.inf, save, recovery, replicas, step, mtbf),
    ):
        assert 0.0 <= value <= 1.0
    assert goodput_without_ft(math.inf, save, recovery, mtbf) == 0.0  # no save to go back to


@given(save=st.floats(1e-3, 1e3), recovery=st.floats(0, 1e3), mtbf=st.floats(1e3, 1e9))
def test_the_closed_form_interval_is_where_goodput_peaks(save, recovery, mtbf):
    best = optimum_interval(save, recovery, mtbf)
    peak = goodput_without_ft(best, save, recovery, mtbf)
    assume(peak > 0.01)  # some interval trains at all
    found = _argmax(lambda t: goodput_without_ft(t, save, recovery, mtbf), 1e-6, 1e12)
    assert peak >= goodput_without_ft(found, save, recovery, mtbf) - 1e-12
    assert best == pytest.approx(found, rel=1e-3)
    for factor in (0.5, 0.9, 1.1, 2.0):  # and nowhere near it does better
        assert goodput_without_ft(best * factor, save, recovery, mtbf) <= peak


@given(save=st.floats(1e-2, 1e3), recovery=st.floats(0, 1e3), mtbf=st.floats(1e7, 1e9))
def test_youngs_square_root_is_the_optimum_when_saves_and_restarts_are_short(save, recovery, mtbf):
    assert optimum_interval(save, recovery, mtbf) == pytest.approx(
        math.sqrt(2 * save * mtbf), rel=0.01
    )


@given(
    write=st.floats(1e-2, 1e4),
    staging=st.floats(1e-3, 1e2),
    restart=st.floats(0, 1e3),
    mtbf=st.floats(1e4, 1e9),
)
def test_the_async_interval_is_where_its_goodput_peaks(write, staging, restart, mtbf):
    recovery = restart + write  # the save in flight is not on disk yet

    def at(interval):
        return goodput_without_ft(
            interval, save_seconds("async", write, staging, interval), recovery, mtbf
        )

    best = young_daly_interval("async", write, staging, recovery, mtbf)
    assume(at(best) > 0.01)
    found = _argmax(at, 1e-6, 1e12)
    assert at(best) >= at(found) - 1e-12
    assert best == pytest.approx(found, rel=1e-3)
    assert best >= write  # a shorter interval waits for the write anyway


@given(
    restart=seconds,
    read=seconds,
    heal_share=st.floats(0, 1),
    save=seconds,
    lag=seconds,
    step=st.floats(1e-3, 1e3),
    steps=st.integers(2, 10**5),
    replicas=st.integers(2, 64),
    mtbf=mtbfs,
)
def test_fault_tolerance_never_does_worse_when_a_heal_is_no_slower_than_a_read(
    restart, read, heal_share, save, lag, step, steps, replicas, mtbf
):
    heal = heal_share * (restart + read)
    interval = steps * step  # at least two steps between saves: the step in flight
    without = goodput_without_ft(interval, save, restart + read + lag, mtbf)
    tolerant = goodput_with_ft(interval, save, restart + heal, replicas, step, mtbf)
    assert tolerant >= without
    assert goodput_with_ft(math.inf, save, restart + heal, replicas, step, mtbf) >= without


@given(
    rates=st.lists(st.floats(1e-9, 1e-2), min_size=2, max_size=2),
    gpus=st.integers(1, 10**5),
    save=st.floats(1e-3, 1e3),
    recovery=seconds,
    interval=intervals,
    replicas=st.integers(2, 64),
    step=st.floats(0, 1e3),
)
def test_goodput_falls_as_failures_rise(rates, gpus, save, recovery, interval, replicas, step):
    low, high = (job_mtbf_s(rate, gpus) for rate in sorted(rates, reverse=True))
    assert goodput_without_ft(interval, save, recovery, high) >= goodput_without_ft(
        interval, save, recovery, low
    )
    assert goodput_with_ft(interval, save, recovery, replicas, step, high) >= goodput_with_ft(
        interval, save, recovery, replicas, step, low
    )
    best = {m: optimum_interval(save, recovery, m) for m in (low, high)}
    assert goodput_without_ft(best[high], save, recovery, high) >= goodput_without_ft(
        best[low], save, recovery, low
    )


def test_one_example_by_hand():
    # A save every 3,000 s of training, each losing 50 s; a failure every 100,000 s;
    # a restart of 120 s and a read of 80 s; 4 groups, each healing in 10 s; 5 s steps.
    # Without: 3000 / 3050 × (1 − (200 + 3050 / 2) / 100000) = 0.983607 × 0.98275
    assert goodput_without_ft(3000, 50, 200, 100_000) == pytest.approx(0.9666393, abs=1e-7)
    # With: 3000 / 3050 × (1 − ((120 + 10) / 4 + 5) / 100000) = 0.983607 × 0.999625
    assert goodput_with_ft(3000, 50, 130, 4, 5, 100_000) == pytest.approx(0.9832377, abs=1e-7)
    # Young–Daly: sqrt(2 × 50 × (100000 − 200)) − 50 = 3159.11 − 50
    assert optimum_interval(50, 200, 100_000) == pytest.approx(3109.11, abs=0.01)
    # Llama 3: 419 interruptions in 54 days on 16,384 GPUs; at 1,536 GPUs one every 33 h.
    assert pytest.approx(1.973e-5, rel=1e-3) == LLAMA3_FAILURES_PER_GPU_HOUR
    assert job_mtbf_s(LLAMA3_FAILURES_PER_GPU_HOUR, 1536) / 3600 == pytest.approx(33.0, abs=0.05)


def test_an_estimate_without_the_file_systems_rate_knows_what_it_can():
    common = dict(
        failures_per_gpu_hour=1e-4,
        gpus=1000,
        restart_s=120.0,
        heal_s=5.0,
        heal_link="inter_node",
        mode="sync",
        step_s=2.0,
        staging_s=0.1,
    )
    unknown = estimate(**common, read_s=None, replicas=4, every=100, write_s=None)
    assert unknown.mtbf_s == pytest.approx(36_000.0)  # 3600 / (1e-4 × 1000)
    assert unknown.without_ft is unknown.with_ft is unknown.young_daly_s is None
    at_end = estimate(**common, read_s=None, replicas=4, every=0, write_s=None)
    assert at_end.without_ft == 0.0 and at_end.interval_s is None
    assert at_end.with_ft == pytest.approx(1 - ((120 + 5) / 4 + 2) / 36_000)
    one = estimate(**common, read_s=10.0, replicas=1, every=100, write_s=20.0)
    assert one.with_ft is one.with_ft_at_young_daly is one.heal_s is None
    assert one.without_ft == pytest.approx(goodput_without_ft(200.0, 20.0, 130.0, 36_000))
    assert one.young_daly_steps == max(1, round(one.young_daly_s / 2.0))


def test_the_failure_rate_and_restart_default_and_can_be_set(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(PROFILE)
    mine = load_profile(str(path))
    assert (mine.failures_per_gpu_hour, mine.restart_s) == (LLAMA3_FAILURES_PER_GPU_HOUR, 120.0)
    path.write_text(PROFILE + "failures_per_gpu_hour = 1e-4\nrestart_s = 0\n")
    mine = load_profile(str(path))
    assert (mine.failures_per_gpu_hour, mine.restart_s) == (1e-4, 0)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("failures_per_gpu_hour = 0", "failures_per_gpu_hour = 0; expected a number > 0"),
        ("failures_per_gpu_hour = -1e-5", "failures_per_gpu_hour = -1e-05; expected a number"),
        ('failures_per_gpu_hour = "often"', "failures_per_gpu_hour = 'often'; expected a number"),
        ("restart_s = -1", "restart_s = -1; expected a number >= 0"),
        ("restart_s = true", "restart_s = True; expected a number >= 0"),
    ],
)
def test_a_bad_failure_rate_or_restart_is_one_line(tmp_path, line, words):
    path = tmp_path / "mine.toml"
    path.write_text(PROFILE + line + "\n")
    with pytest.raises(ConfigError) as err:
        load_profile(str(path))
    assert words in str(err.value) and "\n" not in str(err.value)


def _plan(sets, plugins=(), preset="debug", ranks=8, **profile):
    config, manager = open_session(preset, list(sets), list(plugins))
    hardware = dataclasses.replace(load_profile("gh200-jupiter"), **profile)
    return make_plan(config, manager, hardware, ranks)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_plan_carries_its_goodput(mode):
    sets = ["parallel.dp_replicate=2", "checkpoint.every=50", f'checkpoint.mode="{mode}"']
    plan = _plan(sets, filesystem_gbps=2.0)
    stage, jupiter = plan.checkpoint_stage_bytes, plan.hardware
    assert plan.checkpoint_read_s == pytest.approx(stage * 4 / 2e9)  # a node's 4 ranks read
    # the other group's same rank is 4 ranks on: another node
    assert plan.heal_link == "inter_node"
    assert plan.heal_s == pytest.approx(stage / jupiter.bandwidth("inter_node", "point_to_point"))
    g = plan.goodput
    assert g.mtbf_s == pytest.approx(3600 / (LLAMA3_FAILURES_PER_GPU_HOUR * 8))
    save = plan.checkpoint_lost_s[mode]
    lag = plan.checkpoint_write_s if mode == "async" else 0.0
    recovery = 120.0 + plan.checkpoint_read_s + lag
    interval = 50 * plan.step.step_s
    assert g.without_ft == pytest.approx(goodput_without_ft(interval, save, recovery, g.mtbf_s))
    group = 120.0 + plan.heal_s
    assert g.with_ft == pytest.approx(
        goodput_with_ft(interval, save, group, 2, plan.step.step_s, g.mtbf_s)
    )
    assert g.young_daly_s == young_daly_interval(
        mode, plan.checkpoint_write_s, plan.checkpoint_stage_s, recovery, g.mtbf_s
    )
    assert g.without_ft_at_young_daly >= g.without_ft and g.with_ft >= g.without_ft
    assert plan_json(plan)["goodput"] == g.as_dict()
    assert plan_json(plan)["checkpoint"]["read_s"] == plan.checkpoint_read_s
    text = plan_table(plan)
    assert "goodput (predicted)" in text and "with fault tolerance" in text
    assert f"{g.young_daly_steps:,}" in text


def test_one_group_has_no_fault_tolerance_and_no_rate_no_interval():
    plan = _plan(["checkpoint.every=0"])  # no filesystem_gbps, one group
    g = plan.goodput
    assert plan.checkpoint_read_s is None and g.young_daly_s is None
    assert g.without_ft == 0.0 and g.with_ft is None and g.replicas == 1
    text = plan_table(plan)
    assert "with fault tolerance  " not in text
    assert "fault tolerance needs replica groups" in text
    assert "unknown" in text.split("goodput (predicted)")[1]


def test_a_pipelined_plan_has_its_goodput_from_its_slowest_pipeline_rank():
    sets = ["parallel.pp=2", "parallel.dp_replicate=2", "training.grad_accum_steps=2"]
    plan = _plan([*sets, "checkpoint.every=5"], preset="tiny", filesystem_gbps=2.0)
    ranks = plan.pipeline_rank_plans
    assert plan.checkpoint_read_s == max(r.checkpoint_read_s for r in ranks) > 0
    assert plan.heal_s == max(r.heal_s for r in ranks) > 0
    g = plan.goodput
    assert g.replicas == 2 and g.gpus == 8 and g.with_ft is not None
    assert g.interval_s == pytest.approx(5 * plan.pipeline.step_s)
    assert "goodput (predicted)" in plan_table(plan)
