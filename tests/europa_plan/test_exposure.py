"""europa-plan's pricing of stated transfers (``europa.plan.exposure``), the step time
europa-core's plans take: what a step waits for of the transfers it states."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.plan.compute_time import ComputeTerms
from europa.plan.exposure import (
    Compute,
    StepTime,
    Transfer,
    flat_compute,
    kernel_compute,
    pipeline_step_time,
    step_time,
)

LINKS = ("intra_node", "inter_node", "device_to_host", "host_to_device")


@st.composite
def transfers(draw, overlapped=st.booleans()):
    n = draw(st.integers(0, 6))
    out = []
    for i in range(n):
        size = draw(st.floats(0, 1e10))
        out.append(
            Transfer(
                kind=f"kind{i}",
                link=draw(st.sampled_from(LINKS)),
                bytes=size,
                rate=draw(st.floats(1e8, 1e11)),
                overlapped=draw(overlapped),
                last_backward=draw(st.booleans()),
                tail_bytes=draw(st.floats(0, 1)) * size,
                budget=draw(st.sampled_from(("", "host"))),
                beside_s=draw(st.none() | st.floats(0, 10)),
            )
        )
    return out


def _step(items, compute_s=1.0, recompute=0.0, micro_batches=1) -> StepTime:
    compute = flat_compute(
        model_flops=compute_s,
        hardware_flops=compute_s * (1 + recompute),
        peak_flops=1.0,
        efficiency=1.0,
        micro_batches=micro_batches,
        priced_by="a test's rate",
    )
    return step_time(compute, items, model_flops=compute_s, peak_flops=1.0)


@given(transfers(), st.floats(0.01, 100), st.floats(0, 1 / 3), st.integers(1, 8))
def test_a_step_waits_between_none_and_all_of_its_transfers(items, compute, redo, micro):
    step = _step(items, compute, redo, micro)
    assert step.compute_s == pytest.approx(compute * (1 + redo))
    assert 0 <= step.exposed_s <= sum(t.seconds for t in items) * (1 + 1e-9) + 1e-12
    assert step.step_s == pytest.approx(step.compute_s + step.exposed_s)


@given(transfers(overlapped=st.just(False)))
def test_transfers_not_overlapped_add_their_seconds(items):
    assert _step(items).exposed_s == pytest.approx(sum(t.seconds for t in items))


@given(st.lists(st.floats(0, 1), max_size=4), st.sampled_from(LINKS))
def test_overlapped_transfers_within_the_compute_beside_them_cost_nothing(shares, link):
    """Transfers on one link adding up to no more than the compute hide entirely."""
    total = sum(shares) or 1.0
    items = [
        Transfer(f"k{i}", link, s / total * 0.99e9, 1e9, overlapped=True)
        for i, s in enumerate(shares)
    ]
    assert _step(items, compute_s=1.0).exposed_s == 0.0


@given(transfers(), st.data())
def test_more_bytes_never_make_a_step_shorter(items, data):
    if not items:
        return
    i = data.draw(st.integers(0, len(items) - 1))
    grown = list(items)
    grown[i] = dataclasses.replace(grown[i], bytes=grown[i].bytes * 2)
    assert _step(grown).step_s >= _step(items).step_s * (1 - 1e-12)


def test_what_starts_after_the_last_backward_is_exposed_whatever_the_compute():
    tail = Transfer("sums", "inter_node", 2e9, 1e9, True, last_backward=True, tail_bytes=1e9)
    assert _step([tail], compute_s=100.0).exposed_s == pytest.approx(1.0)


def test_sums_of_the_last_backward_hide_behind_that_backward_only():
    """Four micro-batches: the last one's backward is two thirds of a quarter of 12 s."""
    sums = Transfer("sums", "inter_node", 3e9, 1e9, True, last_backward=True)
    assert _step([sums], compute_s=12.0, micro_batches=4).exposed_s == pytest.approx(1.0)
    whole = Transfer("sums", "inter_node", 3e9, 1e9, True)
    assert _step([whole], compute_s=12.0, micro_batches=4).exposed_s == 0.0


def test_a_transfer_beside_part_of_the_compute_exposes_what_exceeds_that_part():
    """Context parallelism's gather beside the query projection (0.25 s of a 10 s step):
    1 s of it waits 0.75 s however long the step; its hidden part still takes its link's
    time from the rest, which the step's compute covers."""
    gather = Transfer("context_gather", "inter_node", 1e9, 1e9, True, beside_s=0.25)
    assert _step([gather], compute_s=10.0).exposed_s == pytest.approx(0.75)
    short = dataclasses.replace(gather, bytes=2e8)
    assert _step([short], compute_s=10.0).exposed_s == 0.0
    experts = Transfer("expert_all_to_all", "inter_node", 9.9e9, 1e9, True)
    assert _step([gather, experts], compute_s=10.0).exposed_s == pytest.approx(0.75 + 0.15)


def test_links_sharing_a_budget_add_up_and_others_do_not():
    out = Transfer("copies", "device_to_host", 1e9, 1e9, True, budget="host")
    back = Transfer("copies", "host_to_device", 1e9, 4e9, True, budget="host")
    assert _step([out, back], compute_s=1.0).exposed_s == pytest.approx(0.25)
    alone = [out, Transfer("copies", "host_to_device", 1e9, 4e9, True)]
    assert _step(alone, compute_s=1.0).exposed_s == 0.0


def test_a_pipeline_step_is_its_busiest_rank_and_what_it_waits_for():
    rank = _step([Transfer("gather", "inter_node", 1e9, 1e9, True)], compute_s=2.0)
    send = Transfer("stage_send", "inter_node", 5e8, 1e9, False)
    step = pipeline_step_time(rank, busy_s=2.0, step_s=3.0, extra=[send], model_flops=4.0,
                              peak_flops=2.0)  # fmt: skip
    assert (step.compute_s, step.exposed_s, step.step_s) == (2.0, 1.0, 3.0)
    assert step.mfu == pytest.approx(4.0 / (3.0 * 2.0))
    assert step.link_s == {("gather", "inter_node"): 1.0, ("stage_send", "inter_node"): 0.5}


@given(st.lists(st.floats(0, 10), min_size=4, max_size=4), st.floats(0, 1), st.integers(1, 8))
def test_kernel_priced_compute_hides_the_last_backwards_sums_as_flat_priced_does(
    terms, redo, micro
):
    """The same seconds priced kernel by kernel or at one rate leave the same last
    backward: all of the last micro-batch but the forward's third of what is not redone."""
    dense, expert, attention, memory = terms
    once = dense + expert + attention + memory
    kernels = ComputeTerms(dense, expert, attention, memory, recompute=once / 3 * redo)
    by_kernel = kernel_compute(kernels, micro, "kernels")
    flat = flat_compute(model_flops=once * micro, hardware_flops=kernels.total * micro,
                        peak_flops=1.0, efficiency=1.0, micro_batches=micro,
                        priced_by="flat")  # fmt: skip
    assert by_kernel.seconds == pytest.approx(flat.seconds)
    if once:
        assert by_kernel.last_backward_s == pytest.approx(flat.last_backward_s)


def test_the_optimizer_step_follows_the_compute_and_hides_no_transfer():
    """A transfer longer than the compute is exposed by the difference, however long the
    optimizer step after it: nothing runs beside the optimizer step."""
    gather = Transfer("gather", "inter_node", 3e9, 1e9, True)
    compute = Compute(2.0, 2.0 * 2 / 3, "a test's", optimizer_s=5.0)
    step = step_time(compute, [gather], model_flops=2.0, peak_flops=1.0)
    assert (step.exposed_s, step.optimizer_s, step.step_s) == (1.0, 5.0, 8.0)
