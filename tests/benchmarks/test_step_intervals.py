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
