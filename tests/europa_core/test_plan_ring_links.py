"""A ring collective's bytes by link: within a node all on NVLink; across nodes, with a
network link a GPU (NCCL's ring a rail), europa-plan's share of them on the network and
the rest on NVLink; with one ring (gloo, CPU ranks), all of them across."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.core.plan.traffic import INTER, INTRA, ring_links


@given(st.integers(1, 512), st.integers(1, 64), st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_every_byte_goes_on_one_link_or_the_other(size, stride, per_node, rails):
    shares = ring_links(size, stride, per_node, rails)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(0 < share <= 1 for share in shares.values())
    if (size - 1) * stride < per_node:
        assert shares == {INTRA: 1.0}
    elif not rails:
        assert shares == {INTER: 1.0}


@pytest.mark.parametrize(
    ("size", "stride", "per_node", "expected"),
    [
        (16, 1, 8, {INTRA: 7 / 8, INTER: 1 / 8}),  # 8 members a node: a rail each
        (8, 2, 4, {INTRA: 1 / 2, INTER: 1 / 2}),  # 2 members a node
        (4, 384, 4, {INTER: 1.0}),  # one member a node: all of it across
    ],
)
def test_nccl_sends_a_rails_share_across(size, stride, per_node, expected):
    assert ring_links(size, stride, per_node, rails=True) == pytest.approx(expected)
