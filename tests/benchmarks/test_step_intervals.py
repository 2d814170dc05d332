"""The interval arithmetic behind benchmarks/e2e.py's exposed-communication figure."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _steps import difference, intersect, length, union

spans = st.lists(
    st.tuples(st.integers(0, 100), st.integers(1, 20)).map(lambda s: (s[0], s[0] + s[1])),
    max_size=8,
)


def _covered(intervals, point: float) -> bool:
    return any(start <= point < end for start, end in intervals)


@given(spans, spans)
def test_union_intersection_and_difference_agree_with_pointwise_membership(a, b):
    ua, ub = union(a), union(b)
    for point in [x + 0.5 for x in range(0, 125)]:
        assert _covered(ua, point) == _covered(a, point)
        assert _covered(intersect(ua, ub), point) == (_covered(a, point) and _covered(b, point))
        assert _covered(difference(ua, ub), point) == (
            _covered(a, point) and not _covered(b, point)
        )


@given(spans, spans)
def test_lengths_add_up(a, b):
    ua, ub = union(a), union(b)
    assert length(union(a + b)) == length(ua) + length(ub) - length(intersect(ua, ub))
    assert length(difference(ua, ub)) == length(ua) - length(intersect(ua, ub))


def test_copy_compute_overlap_counts_host_device_copies_beside_kernels():
    from _gpu_trace import copy_compute_overlap

    events = [
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "gemm", "ts": 20, "dur": 10},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 5, "dur": 10},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 28, "dur": 4},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 40, "dur": 50},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
    ]
    found = copy_compute_overlap(events)
    assert found["copies"] == 2  # device-to-device copies are not offload's
    assert found["copy_us"] == 14 and found["copy_beside_kernels_us"] == 5 + 2
    assert found["overlapped_fraction"] == 7 / 14
    assert copy_compute_overlap(events[:2])["overlapped_fraction"] is None
