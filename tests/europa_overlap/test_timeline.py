"""The timeline's arithmetic: compute is the step minus the blocked time; exposed
communication is the blocked time; the rest of the communication was hidden."""

from __future__ import annotations

import pytest

from europa.overlap.timeline import Interval, StepTimeline, subtract, union_seconds


def test_union_counts_overlapping_intervals_once():
    assert union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == 3.0
    assert union_seconds([]) == 0.0


def test_subtract_leaves_the_gaps():
    assert subtract([(0.0, 10.0)], [(2.0, 3.0), (2.5, 4.0), (9.0, 12.0)]) == [
        (0.0, 2.0),
        (4.0, 9.0),
    ]


def test_a_wait_beside_another_threads_compute_is_hidden():
    """DualPipeV's pair side by side: the training thread's forward (0-4) and a backward
    thread (1-6). A wait is exposed only where no thread computes: the training thread's
    wait 1-2 is hidden by the backward computing, and of its wait 3-4 only 3.5-4, where
    the backward waits too; the backward's wait 5-6 is exposed (the training thread, its
    forward done, idles)."""
    from europa.overlap.timeline import StageSpan, _exposed

    main, side = 1, 2
    stages = [(main, StageSpan(0, "F", 1, 0.0, 4.0)), (side, StageSpan(3, "B", 0, 1.0, 6.0))]
    blocked = [
        (main, Interval("expert_all_to_all", 1.0, 2.0)),
        (main, Interval("expert_all_to_all", 3.0, 4.0)),
        (side, Interval("expert_all_to_all", 3.5, 4.0)),
        (side, Interval("expert_all_to_all", 5.0, 6.0)),
    ]
    exposed = _exposed(main, blocked, stages)
    assert union_seconds(exposed) == pytest.approx(0.5 + 1.0)
    assert sorted((i.start, i.end) for i in exposed) == [(3.5, 4.0), (5.0, 6.0)]
    # one thread: every wait is exposed, as before
    assert _exposed(main, blocked[:2], stages[:1]) == [i for _, i in blocked[:2]]


def test_a_step_splits_into_compute_exposed_and_hidden_communication():
    step = StepTimeline(
        step=3,
        rank=1,
        duration=10.0,
        comm=[
            Interval("parameter_gather", 0.0, 4.0),  # waited for during its last second
            Interval("expert_all_to_all", 5.0, 6.0),  # entirely beside compute
        ],
        blocked=[Interval("parameter_gather", 3.0, 4.0)],
    )
    summary = step.summary()
    assert summary["compute_s"] == 9.0
    assert summary["comm_s"] == 5.0
    assert summary["exposed_comm_s"] == 1.0
    assert summary["hidden_comm_s"] == 4.0
    assert summary["parameter_gather_exposed_s"] == 1.0
    assert summary["expert_all_to_all_exposed_s"] == 0.0
    assert [(i.start, i.end) for i in step.compute()] == [(0.0, 3.0), (4.0, 10.0)]
    record = step.as_dict()
    assert record["compute"] == [["compute", 0.0, 3.0], ["compute", 4.0, 10.0]]
    assert record["blocked"] == [["parameter_gather", 3.0, 4.0]]


@pytest.mark.parametrize("policy", ["all", "all_but_last", "none"])
def test_reshard_policies(policy):
    from europa.overlap.prefetch import reshards

    expected = {"all": [True] * 3, "all_but_last": [True, True, False], "none": [False] * 3}
    assert [reshards(policy, i, 3) for i in range(3)] == expected[policy]


def test_a_transfer_standing_for_a_collective_is_filed_as_one():
    import torch

    from europa.overlap.timeline import _kind_of
    from europa.spec.tags import mark_traffic

    rows = torch.zeros(2, 3)
    assert _kind_of("all_reduce", {"tensor": rows}) == "all_reduce"
    assert _kind_of(None, {"tensor": rows}) is None  # an untagged isend/irecv is not filed
    mark_traffic(rows, "gradient_reduce_scatter")
    assert _kind_of(None, {"tensor": rows}) == "gradient_reduce_scatter"
    assert _kind_of("all_reduce", {"tensor": rows}) == "gradient_reduce_scatter"
    assert _kind_of("parameter_gather", {"tensor": rows}) == "parameter_gather"
    assert _kind_of("all_reduce", {}) == "all_reduce"
