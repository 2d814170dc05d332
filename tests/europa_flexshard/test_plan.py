"""The ownership plan and the segment data path, as properties over random models."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from europa.flexshard import ParameterSpec, PlanError, plan_ownership
from europa.flexshard.ownership import newton_schulz_flops
from europa.flexshard.segments import UnitSegments

dims = st.integers(1, 12)


@st.composite
def parameter_specs(draw) -> list[ParameterSpec]:
    """A model: a few units, each with stacked experts, matrices and vectors."""
    specs = []
    for unit in range(draw(st.integers(1, 4))):
        for i in range(draw(st.integers(1, 5))):
            kind = draw(st.sampled_from(["stacked", "matrix", "vector"]))
            if kind == "stacked":
                shape = (draw(st.integers(0, 40)), draw(dims), draw(dims))
            elif kind == "matrix":
                shape = (draw(dims), draw(dims))
            else:
                shape = (draw(dims),)
            itemsize = draw(st.sampled_from([2, 4]))
            specs.append(ParameterSpec(f"layers.{unit}.p{i}", shape, itemsize, f"layers.{unit}"))
    return specs


world_sizes = st.integers(1, 64)


@given(specs=parameter_specs(), world=world_sizes)
def test_every_matrix_has_exactly_one_owner_and_is_never_split(specs, world):
    plan = plan_ownership(specs, world)
    for spec in specs:
        ranges = plan.ranges[spec.name]
        assert len(ranges) == world
        covered = [i for start, stop in ranges for i in range(start, stop)]
        assert covered == list(range(spec.matrices))  # each matrix once, in rank order
        for index in range(spec.matrices):
            assert index in plan.owned(plan.owner(spec.name, index), spec.name)


@given(specs=parameter_specs(), world=world_sizes)
def test_the_most_loaded_rank_holds_at_most_the_mean_plus_the_largest_matrix(specs, world):
    plan = plan_ownership(specs, world)
    per_rank = plan.rank_bytes()
    total = sum(s.matrices * s.matrix_bytes for s in specs)
    assert sum(per_rank) == total
    largest = max((s.matrix_bytes for s in specs if s.matrices), default=0)
    assert max(per_rank) <= total / world + largest


@given(specs=parameter_specs(), world=world_sizes)
def test_the_plan_is_a_function_of_its_inputs_alone(specs, world):
    # No rank, clock or process-group state enters it: recomputing (as every rank
    # does) from copies of the inputs gives the same plan.
    again = [ParameterSpec(s.name, tuple(s.shape), s.itemsize, s.unit) for s in specs]
    assert plan_ownership(specs, world).ranges == plan_ownership(again, world).ranges


@given(specs=parameter_specs(), world=world_sizes, seed=st.integers(0, 2**16))
def test_shard_then_gather_round_trips_exactly(specs, world, seed):
    plan = plan_ownership(specs, world)
    generator = torch.Generator().manual_seed(seed)
    for unit in dict.fromkeys(s.unit for s in specs):
        names = [s.name for s in specs if s.unit == unit]
        segments = UnitSegments(plan, names)
        fulls = [torch.randn(plan.spec(n).shape, generator=generator) for n in names]
        locals_by_rank = [
            [_owned_slice(plan, n, full, rank) for n, full in zip(names, fulls, strict=True)]
            for rank in range(world)
        ]
        packed = [segments.pack(r, locals_by_rank[r], torch.float32) for r in range(world)]
        rows = torch.stack(packed)
        assert all(torch.equal(a, b) for a, b in zip(segments.unpack(rows), fulls, strict=True))

        # Gloo's direct gather: a rank's pieces come from its local tensors, never its row
        # (left as garbage here), and a parameter it owns whole is a view of its local one.
        for rank in range(world):
            garbage = rows.clone()
            garbage[rank].fill_(float("nan"))
            mine = locals_by_rank[rank]
            own = segments.unpack(garbage, own=(rank, mine))
            assert all(torch.equal(a, b) for a, b in zip(own, fulls, strict=True))
            for slot, (full, local) in enumerate(zip(own, mine, strict=True)):
                if not full.numel():
                    continue
                whole = segments.counts[slot][rank] == plan.spec(names[slot]).matrices
                shares = full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
                assert shares == whole
            # what it sends, and where each piece lands in its row on the other ranks
            for piece, span in zip(
                [mine[s] for s in segments.owned_slots(rank)],
                segments.owned_spans(rank),
                strict=True,
            ):
                assert torch.equal(rows[rank, span], piece.reshape(-1))

        # The gradient direction: each rank's row of the scattered fulls is its own share.
        scattered = segments.scatter_rows(fulls, torch.empty(world, segments.width))
        for rank in range(world):
            pieces = segments.split(rank, scattered[rank])
            for piece, expected in zip(pieces, locals_by_rank[rank], strict=True):
                assert torch.equal(piece, expected)
            # Gloo's direct reduce-scatter sends the owned pieces straight from the fulls:
            # exactly the non-empty shares, in slot order, as views (nothing packed).
            owned = segments.owned_pieces(rank, fulls)
            shares = [share for share in locals_by_rank[rank] if share.numel()]
            assert len(owned) == len(shares)
            assert all(torch.equal(a, b) for a, b in zip(owned, shares, strict=True))
            assert all(piece._base is not None for piece in owned)


@given(specs=parameter_specs(), world=world_sizes)
def test_a_parameter_one_rank_owns_is_gathered_without_a_copy_unless_the_rows_are_padding(
    specs, world
):
    # Its full tensor is a view of the gathered rows while they are at most 1/8 padding; one
    # split between ranks is a new tensor, so freeing the rows never takes it with them.
    plan = plan_ownership(specs, world)
    for unit in dict.fromkeys(s.unit for s in specs):
        names = [s.name for s in specs if s.unit == unit]
        segments = UnitSegments(plan, names)
        padding = world * segments.width - sum(segments.sizes)
        assert segments.views_rows == (8 * padding <= sum(segments.sizes))
        rows = torch.zeros(world, segments.width)
        for name, full in zip(names, segments.unpack(rows), strict=True):
            if not full.numel():
                continue
            owners = sum(1 for start, stop in plan.ranges[name] if stop > start)
            shares_rows = full.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
            assert shares_rows == (owners == 1 and segments.views_rows), (name, plan.ranges[name])


def _owned_slice(plan, name, full, rank):
    spec = plan.spec(name)
    stacked = full if spec.stacked else full.unsqueeze(0)
    owned = plan.owned(rank, name)
    return stacked[owned.start : owned.stop]


def test_balance_on_a_debug_model_shape():
    # The debug preset's block at 4 ranks: 24 experts and 12 dense matrices.
    specs = [
        ParameterSpec("layers.1.w1", (8, 256, 256), 4, "layers.1"),
        ParameterSpec("layers.1.w2", (8, 256, 256), 4, "layers.1"),
        ParameterSpec("layers.1.w3", (8, 256, 256), 4, "layers.1"),
        ParameterSpec("layers.1.wq", (3072, 256), 4, "layers.1"),
        ParameterSpec("layers.1.wo", (256, 2048), 4, "layers.1"),
        ParameterSpec("layers.1.norm", (256,), 4, "layers.1", orthogonalised=False),
    ]
    summary = plan_ownership(specs, 4).summary()
    assert summary["bytes_max_over_mean"] < 1.15
    assert summary["newton_schulz_max_over_mean"] < 1.5
    assert summary["matrices"] == 27


def test_newton_schulz_work_counts_the_short_side_squared():
    assert newton_schulz_flops((4, 8)) == newton_schulz_flops((8, 4)) == 5 * (4 * 16 * 8 + 2 * 64)
    assert newton_schulz_flops((7,)) == 0


@pytest.mark.parametrize(
    ("specs", "world", "message"),
    [
        ([], 0, "group size = 0: expected an integer >= 1"),
        ([], True, "group size = True: expected an integer >= 1"),
        (
            [ParameterSpec("a", (2, 2)), ParameterSpec("a", (3,))],
            2,
            "parameter 'a' appears twice: expected unique names",
        ),
    ],
)
def test_an_impossible_request_is_one_line(specs, world, message):
    with pytest.raises(PlanError) as err:
        plan_ownership(specs, world)
    assert str(err.value) == message


def test_more_ranks_than_matrices_leaves_ranks_empty_not_an_error():
    plan = plan_ownership([ParameterSpec("experts", (3, 2, 2))], 8)
    assert plan.counts("experts") == (1, 1, 1, 0, 0, 0, 0, 0)
    assert math.isclose(plan.summary()["bytes_max_over_mean"], 8 / 3)
