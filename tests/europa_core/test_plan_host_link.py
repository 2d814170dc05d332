"""The host-device link planned one direction at a time: offload's copies out of the GPU
and back in, and an async checkpoint's staging (out), each at its own rate; a profile with
one figure for both ways plans as before."""

from __future__ import annotations

import dataclasses

import pytest

from europa.core.plan import load_profile, make_plan
from europa.core.plan.hardware import DEVICE_TO_HOST, HOST_TO_DEVICE
from europa.core.plan.report import plan_json, plan_table
from europa.core.plan.timing import transfers
from europa.core.plan.traffic import Traffic
from europa.core.session import open_session
from europa.plan.exposure import Compute, step_time

OFFLOAD = ["offload.optimizer_state=true", "training.grad_accum_steps=3"]


def _plan(hardware, overrides=OFFLOAD, plugins=("offload",), ranks=8):
    config, manager = open_session("debug", list(overrides), list(plugins))
    return make_plan(config, manager, hardware, ranks)


def _cuda(**figures):
    """A GPU profile whose host link is ``figures``; nothing else in the way."""
    base = dataclasses.replace(load_profile("h100-sxm"), host_device_efficiency=None)
    return dataclasses.replace(base, **figures)


def _copies(plan) -> dict[str, tuple[int, float]]:
    return {
        t.link: (t.bytes_per_step, plan.without_overlap.link_s[t.kind, t.link])
        for t in plan.traffic
        if t.kind == "host_copies"
    }


def test_the_shipped_gh200_profile_rates_each_direction_as_measured():
    jupiter = load_profile("gh200-jupiter")
    assert jupiter.bandwidth(HOST_TO_DEVICE) == pytest.approx(420e9)  # Megatron-LM #6491
    assert jupiter.bandwidth(DEVICE_TO_HOST) == pytest.approx(170e9)
    for name in ("h100-sxm", "h200", "cpu"):  # one figure both ways, as before
        profile = load_profile(name)
        both = profile.bandwidth("host_device")
        assert profile.bandwidth(HOST_TO_DEVICE) == profile.bandwidth(DEVICE_TO_HOST) == both


def test_a_direction_takes_its_own_figures_else_the_links():
    plain = _cuda(host_device_gbps=100.0, link_efficiency=0.5)
    assert plain.bandwidth(DEVICE_TO_HOST) == plain.bandwidth(HOST_TO_DEVICE) == 50e9
    own = dataclasses.replace(plain, device_to_host_gbps=10.0)
    assert own.bandwidth(DEVICE_TO_HOST) == 5e9  # its rate, the link's efficiency
    assert own.bandwidth(HOST_TO_DEVICE) == 50e9
    linked = dataclasses.replace(own, host_device_efficiency=0.8)
    assert linked.bandwidth(DEVICE_TO_HOST) == pytest.approx(8e9)
    measured = dataclasses.replace(linked, device_to_host_efficiency=1.0)
    assert measured.bandwidth(DEVICE_TO_HOST) == 10e9
    assert measured.bandwidth(HOST_TO_DEVICE) == pytest.approx(80e9)


def test_each_direction_of_the_host_copies_is_timed_at_its_own_rate():
    even = _plan(_cuda(host_device_gbps=100.0, link_efficiency=0.5))
    slow_out = _plan(_cuda(host_device_gbps=100.0, link_efficiency=0.5, device_to_host_gbps=10.0))
    copies = _copies(slow_out)
    assert set(copies) == {DEVICE_TO_HOST, HOST_TO_DEVICE}
    # Activations out and back once a micro-batch, optimizer state once each way a step.
    micro_batches = slow_out.config.training.grad_accum_steps
    each_way = slow_out.activations.host * micro_batches + slow_out.host_terms["optimizer_state"]
    assert each_way > 0 and copies[DEVICE_TO_HOST][0] == copies[HOST_TO_DEVICE][0] == each_way
    assert copies[DEVICE_TO_HOST][1] == pytest.approx(each_way / 5e9)
    assert copies[HOST_TO_DEVICE][1] == pytest.approx(each_way / 50e9)
    assert _copies(even)[DEVICE_TO_HOST][1] == pytest.approx(each_way / 50e9)
    # Without overlap the copies wait: the step grows by the slower way out, and only that.
    grown = slow_out.without_overlap.exposed_s - even.without_overlap.exposed_s
    assert grown == pytest.approx(each_way / 5e9 - each_way / 50e9)
    # An async save's staging is a copy out.
    stage = slow_out.checkpoint_stage_bytes
    assert slow_out.checkpoint_stage_s == pytest.approx(stage / 5e9)
    assert even.checkpoint_stage_s == pytest.approx(stage / 50e9)
    rows = plan_json(slow_out)["communication_per_step"]
    assert {r["link"] for r in rows if r["kind"] == "host_copies"} == set(copies)
    table = plan_table(slow_out)
    assert "device_to_host" in table and "host_to_device" in table


def test_a_profile_with_one_figure_plans_the_copies_as_before():
    """Before the two ways were split: 2 × the bytes at the one-way rate."""
    plan = _plan(_cuda(host_device_gbps=100.0, link_efficiency=0.5))
    copies = _copies(plan)
    bytes_, seconds = (sum(v[i] for v in copies.values()) for i in (0, 1))
    assert seconds == pytest.approx(bytes_ / 50e9)


def test_the_two_directions_hide_behind_compute_as_one_link():
    """Offload copies out in forward and back in backward: the plan does not count on both
    at once, so their seconds add up against the compute beside them."""
    traffic = [
        Traffic("host_copies", link, 10**9, True) for link in (DEVICE_TO_HOST, HOST_TO_DEVICE)
    ]
    rates = dict(device_to_host_gbps=1.0, host_to_device_gbps=4.0)  # 1 s and 0.25 s
    exact = dict(device_to_host_efficiency=1.0, host_to_device_efficiency=1.0)
    priced = transfers(traffic, _cuda(**rates, **exact), ("host_copies",))

    def exposed(compute_s):
        compute = Compute(compute_s, compute_s * 2 / 3, priced_by="a test's")
        return step_time(compute, priced, model_flops=compute_s, peak_flops=1.0).exposed_s

    assert exposed(1.0) == pytest.approx(0.25)  # each alone would hide behind 1 s
    assert exposed(1.25) == pytest.approx(0.0)
    assert exposed(0.5) == pytest.approx(0.75)
