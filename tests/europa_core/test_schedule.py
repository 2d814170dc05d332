"""Warm-up plus cosine learning-rate schedule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.core.config.schema import LRScheduleConfig
from europa.core.train.schedule import lr_factor


@given(
    total=st.integers(1, 500),
    warmup=st.integers(0, 100),
    floor=st.floats(0.0, 1.0),
)
def test_schedule_shape(total, warmup, floor):
    schedule = LRScheduleConfig(warmup_steps=warmup, min_lr_ratio=floor)
    factors = [lr_factor(step, total, schedule) for step in range(total)]
    assert all(0.0 < f <= 1.0 + 1e-12 for f in factors[:warmup])
    assert all(floor - 1e-12 <= f <= 1.0 + 1e-12 for f in factors[warmup:])
    ramp = factors[: min(warmup, total)]
    assert ramp == sorted(ramp)
    decay = factors[warmup:]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(decay))
    if warmup < total:
        assert factors[warmup] == pytest.approx(1.0)
        assert lr_factor(total, total, schedule) == pytest.approx(floor)


def test_warmup_is_linear_from_the_first_step():
    schedule = LRScheduleConfig(warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_factor(s, 100, schedule) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
