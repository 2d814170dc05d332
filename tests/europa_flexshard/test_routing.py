"""The routing model that sizes an execution's expert exchange: every rank's expected
receives are what its senders expect to send, the pairs a source sends are all of its
pairs, and the uniform model's probabilities are the exact expectations."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.flexshard.exchange.nodes import ExpertNodes
from europa.flexshard.exchange.routing import routing_table
from europa.flexshard.exchange.two_level import TwoLevelDispatcher
from europa.spec.execution import RoutingModel, RoutingModelError


def _ranges(experts: int, ranks: int) -> list[tuple[int, int]]:
    bounds = [experts * r // ranks for r in range(ranks + 1)]
    return list(itertools.pairwise(bounds))


@st.composite
def groups(draw):
    local = draw(st.integers(1, 4))
    nodes = draw(st.integers(1, 4))
    ep = local * nodes
    experts = ep * draw(st.integers(2, 4))
    top_k = draw(st.integers(1, min(6, experts)))
    max_nodes = draw(st.integers(0, nodes))
    if max_nodes and top_k > max_nodes * experts // nodes:
        max_nodes = 0
    skew = draw(st.sampled_from([0.0, 1.1]))
    return experts, ep, local, top_k, max_nodes, RoutingModel(skew=skew)


@given(groups(), st.integers(0, 300), st.integers(1, 3))
def test_every_rank_receives_what_its_senders_send(group, tokens, chunks):
    experts, ep, local, top_k, max_nodes, model = group
    ranges = _ranges(experts, ep)
    dispatchers = [
        TwoLevelDispatcher(
            None, rank, ranges, top_k, nodes=ExpertNodes(local), routing=model, max_nodes=max_nodes
        )
        for rank in range(ep)
    ]
    sizes = [tokens * (c + 1) // chunks - tokens * c // chunks for c in range(chunks)]
    nodes = ep // local
    for d in dispatchers:
        received = d._from_nodes(sizes)  # [source node][chunk]
        for n in range(nodes):  # the source at this rank's position on node n
            source = dispatchers[n * local + d.position]
            assert received[n] == [source._to_nodes(size)[d.node] for size in sizes]
        for c in range(chunks):  # stage 2, chunk by chunk
            arrived = sum(received[n][c] for n in range(nodes))
            for j in range(local):  # what each forwarder of this node passes to this rank
                forwarder = dispatchers[d.node * local + j]
                forwarder_arrived = sum(forwarder._from_nodes(sizes)[n][c] for n in range(nodes))
                assert forwarder_arrived == arrived
                assert (
                    forwarder._to_ranks(forwarder_arrived)[d.position]
                    == (d._to_ranks(arrived)[d.position])
                )


@given(groups(), st.integers(0, 500))
def test_a_sources_pairs_are_all_sent_and_each_expert_gets_its_share(group, pairs):
    experts, ep, local, top_k, max_nodes, model = group
    table = routing_table(model, _ranges(experts, ep), local, top_k, max_nodes)
    for source in range(ep):
        counts = table.flat_pairs(source, pairs)
        assert sum(counts) == pairs and min(counts) >= 0
        for share, count in zip(table.expert_share, counts, strict=True):
            assert abs(count - pairs * share) < 1  # largest remainder: within one pair


@pytest.mark.parametrize(("experts", "ranks", "local", "top_k"), [(8, 4, 2, 3), (6, 3, 3, 2)])
def test_uniform_probabilities_are_the_exact_expectations(experts, ranks, local, top_k):
    ranges = _ranges(experts, ranks)
    table = routing_table(RoutingModel(), ranges, local, top_k)
    picks = list(itertools.combinations(range(experts), top_k))
    owner = [r for r, (a, b) in enumerate(ranges) for _ in range(a, b)]
    for r in range(ranks):
        hits = sum(any(owner[e] == r for e in p) for p in picks) / len(picks)
        on = sum(sum(owner[e] == r for e in p) for p in picks) / len(picks)
        assert table.rank_hit[r] == pytest.approx(hits)
        assert table.rank_picks[r] == pytest.approx(on)
    for n in range(ranks // local):
        hits = sum(any(owner[e] // local == n for e in p) for p in picks) / len(picks)
        assert table.node_hit[n] == pytest.approx(hits)
    assert math.fsum(table.expert_share) == pytest.approx(1.0)


def test_node_limited_uniform_routing_reaches_at_most_its_nodes():
    ranges = _ranges(384, 384)
    table = routing_table(RoutingModel(), ranges, 4, 8, max_nodes=4)
    reached = sum(table.node_hit)  # expected distinct nodes a token reaches
    assert 3.5 < reached <= 4.0
    unlimited = routing_table(RoutingModel(), ranges, 4, 8)
    assert sum(unlimited.node_hit) == pytest.approx(
        96 * (1 - math.comb(380, 8) / math.comb(384, 8))
    )


@pytest.mark.parametrize("text", ["", "zipf", "skew", "skew:", "skew:0", "skew:-1", "skew:x",
                                  "skew:nan", "skew:inf", "uniform:1"])  # fmt: skip
def test_a_malformed_routing_model_is_refused_in_one_line(text):
    with pytest.raises(RoutingModelError) as refused:
        RoutingModel.parse(text)
    assert "\n" not in str(refused.value) and "uniform" in str(refused.value)


def test_routing_models_read_back_as_given():
    assert RoutingModel.parse("uniform") == RoutingModel()
    assert RoutingModel.parse(" skew:1.5 ") == RoutingModel(skew=1.5)
    assert RoutingModel.parse(RoutingModel(skew=0.5).describe()) == RoutingModel(skew=0.5)


@given(
    st.integers(1, 4).flatmap(
        lambda experts: st.lists(st.lists(st.integers(0, 6), min_size=experts, max_size=experts))
    )
)
def test_received_rows_regroup_by_local_expert_with_each_row_once(counts):
    """Rows received source by source, each source's sorted by expert: the reorder lists
    every row once, each expert's rows together in expert order, sources in order within."""
    import torch

    from europa.flexshard.exchange.dispatcher import by_local_expert

    order = by_local_expert(counts, torch.device("cpu")).tolist()
    labels = []  # each received row's (expert, source, place), in received order
    for source, row in enumerate(counts):
        for expert, count in enumerate(row):
            labels += [(expert, source, place) for place in range(count)]
    assert sorted(order) == list(range(len(labels)))
    assert [labels[i] for i in order] == sorted(labels)
