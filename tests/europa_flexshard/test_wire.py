"""What the expert exchange puts on the wire: codecs, the uniform-routing byte model, and
the bytes of a given routing."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.flexshard.exchange import slices
from europa.flexshard.exchange.codec import FP8_MAX, Codec
from europa.flexshard.exchange.flat import chunk_bounds
from europa.flexshard.exchange.traffic import routed_bytes
from europa.flexshard.exchange.wire import (
    FP8_BLOCK,
    INTER,
    INTRA,
    ExpertGroup,
    RowBytes,
    Wire,
    expected_bytes_per_token,
    expected_count_bytes,
    row_bytes,
)

# -- codecs -------------------------------------------------------------------------------

rows_of = st.integers(0, 5)
cols_of = st.integers(1, 3 * FP8_BLOCK + 7)


def _tensor(rows: int, cols: int, seed: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.randn(rows, 1, generator=g) * spread)
    return torch.randn(rows, cols, generator=g) * magnitude


@settings(max_examples=40)
@given(rows=rows_of, cols=cols_of, seed=st.integers(0, 99), spread=st.floats(0, 4))
def test_each_codec_sends_the_bytes_the_wire_model_counts_and_decodes_its_rows(
    rows, cols, seed, spread
):
    x = _tensor(rows, cols, seed, spread)
    for wire in ("compute", "bfloat16", "float8_e4m3fn"):
        codec = Codec(wire)
        sent = codec.encode(x)
        assert sent.dtype == torch.uint8
        assert tuple(sent.shape) == (rows, row_bytes(wire, cols, 4))
        back = codec.decode(sent, cols, torch.float32)
        assert back.dtype == torch.float32 and back.shape == x.shape
        if wire == "compute":
            assert torch.equal(back, x)
        elif wire == "bfloat16":
            assert torch.equal(back, x.to(torch.bfloat16).float())
        else:  # e4m3: 3 mantissa bits, so half a step is 1/16 of a value; subnormals below
            blocks = -(-cols // FP8_BLOCK)
            padded = torch.zeros(rows, blocks * FP8_BLOCK)
            padded[:, :cols] = x
            scale = padded.view(rows, blocks, FP8_BLOCK).abs().amax(-1) / FP8_MAX
            scale = scale.repeat_interleave(FP8_BLOCK, dim=1)[:, :cols]
            bound = x.abs() / 16 + scale * 2**-9
            assert bool(((back - x).abs() <= bound * (1 + 1e-6)).all())


def test_integer_rows_travel_exactly_and_an_all_zero_block_stays_zero():
    ids = torch.tensor([[3, -1, 7], [-1, -1, 0]], dtype=torch.int32)
    assert torch.equal(Codec().decode(Codec().encode(ids), 3, torch.int32), ids)
    zeros = torch.zeros(2, FP8_BLOCK + 1)
    fp8 = Codec("float8_e4m3fn")
    assert torch.equal(fp8.decode(fp8.encode(zeros), FP8_BLOCK + 1, torch.float32), zeros)


@settings(max_examples=20)
@given(rows=st.integers(1, 9), cols=cols_of, seed=st.integers(0, 99), slice_rows=st.integers(1, 4))
def test_fp8_rows_a_slice_at_a_time_are_the_bytes_and_values_of_all_rows_at_once(
    rows, cols, seed, slice_rows
):
    x, fp8 = _tensor(rows, cols, seed, 2.0).to(torch.bfloat16), Codec("float8_e4m3fn")
    whole_sent, whole_back = fp8.encode(x), fp8.decode(fp8.encode(x), cols, torch.bfloat16)
    padded_row = 4 * FP8_BLOCK * -(-cols // FP8_BLOCK)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slices, "WORKING_BYTES", slice_rows * padded_row)
        sent = fp8.encode(x)
        back = fp8.decode(sent, cols, torch.bfloat16)
    assert torch.equal(sent, whole_sent) and torch.equal(back, whole_back)


def test_fp8_coding_keeps_a_bounded_fp32_working_set_whatever_the_rows():
    """The largest tensor made while encoding or decoding 64 rows a slice of 8 at a time is
    the uint8 rows or the decoded ones, never an fp32 copy of all of them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        fp32 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.fp32 = max(self.fp32, t.untyped_storage().nbytes())
            return out

    x, fp8 = torch.randn(64, FP8_BLOCK, dtype=torch.bfloat16), Codec("float8_e4m3fn")
    with pytest.MonkeyPatch.context() as patch, Largest() as seen:
        patch.setattr(slices, "WORKING_BYTES", 8 * 4 * FP8_BLOCK)
        fp8.decode(fp8.encode(x), FP8_BLOCK, torch.bfloat16)
    assert seen.fp32 <= 8 * 4 * FP8_BLOCK


def test_the_combine_direction_stays_at_least_bf16():
    assert Wire("compute", 4).combine == "compute"
    assert Wire("bfloat16", 4).combine == "bfloat16"
    assert Wire("float8_e4m3fn", 4).combine == "bfloat16"
    assert Wire("bfloat16", 2).combine == "compute"  # a bf16 run: the same two bytes
    assert Wire("float8_e4m3fn", 2).combine == "bfloat16"


def test_chunks_cover_the_local_experts_in_order():
    assert chunk_bounds(5, 2) == [(0, 2), (2, 5)]
    assert chunk_bounds(2, 3) == [(0, 0), (0, 1), (1, 2)]


# -- the uniform-routing model, against every routing enumerated -------------------------


def _enumerated(group: ExpertGroup) -> tuple[float, float, float, float]:
    """Exact expectations by enumeration, for a token of rank 0: other nodes reached,
    other-position ranks reached, pairs off the node, pairs on the node off the rank."""
    per_node, per_rank = group.num_experts // group.nodes, group.num_experts // group.ep
    reach = group.max_nodes or group.nodes
    totals, count = [0.0, 0.0, 0.0, 0.0], 0
    for chosen in itertools.combinations(range(group.nodes), reach):
        experts = [e for n in chosen for e in range(n * per_node, (n + 1) * per_node)]
        for picks in itertools.combinations(experts, group.top_k):
            nodes = {e // per_node for e in picks}
            ranks = {e // per_rank for e in picks}
            totals[0] += len(nodes - {0})
            totals[1] += len({r for r in ranks if r % group.local != 0})
            totals[2] += sum(e // per_node != 0 for e in picks)
            totals[3] += sum(e // per_node == 0 and e // per_rank != 0 for e in picks)
            count += 1
    return tuple(t / count for t in totals)


GROUPS = [
    ExpertGroup(8, 4, 2, 3),  # the benchmark's: 2 nodes of 2, top-3 of 8
    ExpertGroup(8, 4, 2, 3, max_nodes=1),
    ExpertGroup(12, 6, 2, 2),
    ExpertGroup(12, 6, 2, 4, max_nodes=2),
    ExpertGroup(16, 8, 4, 3),
    ExpertGroup(6, 2, 2, 2),  # one node
]


@pytest.mark.parametrize("group", GROUPS, ids=str)
def test_closed_forms_equal_the_enumerated_expectations(group):
    nodes, ranks, off_node, on_node = _enumerated(group)
    assert group.other_nodes_per_token() == pytest.approx(nodes, rel=1e-12, abs=1e-12)
    assert group.other_local_ranks_per_token() == pytest.approx(ranks, rel=1e-12, abs=1e-12)
    inter, intra = group.pair_fractions()
    assert group.top_k * inter == pytest.approx(off_node, rel=1e-12, abs=1e-12)
    assert group.top_k * intra == pytest.approx(on_node, rel=1e-12, abs=1e-12)


def test_the_seed_scenarios_token_reaches_the_nodes_the_design_notes_give():
    kimi = ExpertGroup(384, 384, 4, 8)
    closed_form = 95 * (1 - math.comb(380, 8) / math.comb(384, 8))
    assert kimi.other_nodes_per_token() == pytest.approx(closed_form)
    assert kimi.other_nodes_per_token() == pytest.approx(7.70, abs=0.005)
    assert ExpertGroup(384, 384, 4, 8, max_nodes=4).other_nodes_per_token() < 4


def test_deduplication_alone_gives_0_62_of_flat_inter_node_rows_for_top_3_of_8_on_2_nodes():
    group, wire = ExpertGroup(8, 4, 2, 3), Wire()
    flat = expected_bytes_per_token(group, "flat", RowBytes.of("flat", wire, 256, 3))
    two = expected_bytes_per_token(group, "two_level", RowBytes.of("two_level", wire, 256, 3))
    rows = group.other_nodes_per_token() / (group.top_k * group.pair_fractions()[0])
    assert rows == pytest.approx(0.619, abs=0.001)
    assert two[INTER] / flat[INTER] <= 0.65  # with the routing slots each row carries


# -- the bytes of a routing, exactly, against the model on average -----------------------


def _uniform_routing(group: ExpertGroup, tokens: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    per_node = group.num_experts // group.nodes
    out = []
    for _ in range(group.ep):
        rank = []
        for _ in range(tokens):
            chosen = rng.sample(range(group.nodes), group.max_nodes or group.nodes)
            experts = [e for n in chosen for e in range(n * per_node, (n + 1) * per_node)]
            rank.append(rng.sample(experts, group.top_k))
        out.append(rank)
    return out


@pytest.mark.parametrize("dispatch", ["flat", "two_level"])
@pytest.mark.parametrize("group", [GROUPS[0], GROUPS[1], GROUPS[4]], ids=str)
def test_the_routings_bytes_average_to_the_uniform_model(dispatch, group):
    tokens, passes = 3000, 2
    per_rank = group.num_experts // group.ep
    ranges = [(r * per_rank, (r + 1) * per_rank) for r in range(group.ep)]
    rows = RowBytes.of(dispatch, Wire("float8_e4m3fn", 4), 64, group.top_k)
    sent = routed_bytes(
        _uniform_routing(group, tokens, 0),
        ranges,
        group.local,
        dispatch,
        rows,
        forward_passes=passes,
    )
    model = expected_bytes_per_token(group, dispatch, rows, forward_passes=passes)
    counts = expected_count_bytes(group, dispatch, calls=passes)
    for link in (INTER, INTRA):
        mean_rows = sum(s[link]["rows"] for s in sent) / group.ep
        assert mean_rows == pytest.approx(model[link] * tokens, rel=0.03), link
        assert all(s[link]["counts"] == counts[link] for s in sent), link
