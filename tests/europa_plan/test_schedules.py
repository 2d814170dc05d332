"""The planner's pipeline orders, written without torch, are the trainer's: the same
per-rank orders as torch's schedules wherever torch builds them, the same refusals where
it does not; and every order runs each computation once (europa-core's planner and
trainer take their simulation from here)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.plan import simulate
from europa.plan.schedules import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    SCHEDULE_NAMES,
    WEIGHT_GRAD,
    Action,
    rank_orders,
    stages_of_rank,
)
from tests.europa_plan.torch_orders import torch_rank_orders

PER_RANK = {"1f1b": (1,), "interleaved-1f1b": (2, 3, 4), "zbv": (2,), "dualpipev": (2,)}


def _micro_counts(pp: int) -> list[int]:
    """From pp to 4 pp: the multiples and their neighbours (interleaved-1f1b refuses some
    of these, dualpipev those under 2 pp)."""
    return sorted({pp, pp + 1, 2 * pp - 1, 2 * pp, 2 * pp + 1, 3 * pp, 4 * pp - 1, 4 * pp})


def _plain(orders) -> dict[int, list[tuple[int, str, int, bool]]]:
    return {r: [(a.stage, a.kind, a.micro, a.paired) for a in o] for r, o in orders.items()}


def _torch_orders(schedule: str, pp: int, per_rank: int, micro: int):
    try:
        return _plain(torch_rank_orders(schedule, pp, per_rank, micro))
    except ValueError:
        return ValueError


def _our_orders(schedule: str, pp: int, per_rank: int, micro: int):
    try:
        return _plain(rank_orders(schedule, pp, per_rank, micro))
    except ValueError:
        return ValueError


@pytest.mark.parametrize("pp", range(2, 9))
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_each_rank_runs_torchs_order(schedule, pp):
    built = 0
    for per_rank in PER_RANK[schedule]:
        for micro in _micro_counts(pp):
            wanted = _torch_orders(schedule, pp, per_rank, micro)
            assert _our_orders(schedule, pp, per_rank, micro) == wanted, (per_rank, micro)
            if wanted is ValueError:
                continue
            built += 1
            for rank, order in wanted.items():  # the stages torch runs on each rank
                held = set(stages_of_rank(schedule, rank, pp, per_rank))
                assert {stage for stage, *_ in order} == held, (rank, per_rank, micro)
    assert built  # torch builds some of every schedule's shapes


def test_an_unknown_schedule_or_a_v_of_three_stages_is_refused():
    with pytest.raises(ValueError, match="unknown"):
        rank_orders("gpipe", 4, 1, 8)
    with pytest.raises(ValueError, match="2 stages"):
        rank_orders("zbv", 4, 3, 8)


def _stage_rank(schedule: str, pp: int, per_rank: int) -> dict[int, int]:
    return {s: r for r in range(pp) for s in stages_of_rank(schedule, r, pp, per_rank)}


def test_an_order_that_cannot_proceed_is_refused():
    stuck = {0: [Action(0, BACKWARD, 0), Action(0, FORWARD, 0)]}
    with pytest.raises(ValueError, match="cannot proceed"):
        simulate.simulate(stuck, lambda stage: 1.0, lambda a, b: 0.0)


@st.composite
def _shapes(draw) -> tuple[str, int, int, int]:
    schedule = draw(st.sampled_from(SCHEDULE_NAMES))
    pp = draw(st.integers(2, 8))
    per_rank = draw(st.integers(1, 4)) if schedule == "interleaved-1f1b" else PER_RANK[schedule][0]
    low = 2 * pp if schedule == "dualpipev" else 1
    micro = draw(st.integers(low, 4 * pp))
    if schedule == "interleaved-1f1b":  # whole rounds, as torch asks
        rounds = max(1, micro // pp)
        micro -= micro % rounds
    return schedule, pp, per_rank, micro


@given(_shapes())
def test_every_computation_runs_once_on_its_stages_rank_after_what_it_needs(shape):
    schedule, pp, per_rank, micro = shape
    orders = rank_orders(*shape)
    rank_of = _stage_rank(schedule, pp, per_rank)
    runs = Counter((a.stage, a.kind, a.micro) for order in orders.values() for a in order)
    assert max(runs.values()) == 1
    for stage in range(pp * per_rank):
        for m in range(micro):
            assert runs[stage, FORWARD, m] == 1
            split = runs[stage, INPUT_GRAD, m] + runs[stage, WEIGHT_GRAD, m]
            assert (runs[stage, BACKWARD, m], split) in ((1, 0), (0, 2))
    assert len(runs) == sum(len(order) for order in orders.values())
    for rank, order in orders.items():
        assert all(rank_of[a.stage] == rank for a in order)
        seen = set()
        for a in order:
            before = {FORWARD: None, BACKWARD: FORWARD, INPUT_GRAD: FORWARD}.get(a.kind, INPUT_GRAD)
            assert before is None or (a.stage, before, a.micro) in seen, a
            seen.add((a.stage, a.kind, a.micro))
    # and the step plays out: no rank waits for what another runs only later
    step = simulate.simulate(orders, lambda stage: 1.0, lambda a, b: 0.1)
    assert step.step_s >= max(step.busy_s.values())
