"""The combine's sums of rows: value for value what ``index_add`` of fp32 products gives,
forward and backward, however the rows are sliced, without keeping fp32 copies of them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.flexshard.exchange import slices
from europa.flexshard.exchange.summing import sum_rows


def _reference(rows, index, size, weights, dtype):
    """The combine as it was written before ``sum_rows``: autograd over ``index_add``."""
    product = rows.float() if weights is None else rows.float() * weights.float()[:, None]
    return rows.new_zeros(size, rows.shape[1], dtype=dtype).index_add(0, index, product.to(dtype))


def _leaves(seed, rows, cols, size, dtype, weighted):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g).to(dtype)
    w = torch.rand(rows, generator=g).to(dtype) if weighted else None
    index = torch.randint(0, size, (rows,), generator=g)
    grad = torch.randn(size, cols, generator=g)
    return x, w, index, grad


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 999),
    rows=st.integers(0, 12),
    cols=st.integers(1, 9),
    size=st.integers(1, 6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    sum_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    weighted=st.booleans(),
    slice_rows=st.integers(1, 5),
)
def test_sums_and_their_gradients_equal_index_add_of_fp32_products_bit_for_bit(
    seed, rows, cols, size, dtype, sum_dtype, weighted, slice_rows
):
    x, w, index, grad = _leaves(seed, rows, cols, size, dtype, weighted)
    results = []
    for summed in (_reference, sum_rows):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w)]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(slices, "WORKING_BYTES", slice_rows * 4 * cols)
            if summed is sum_rows:
                out = sum_rows(leaves[0], index, size, weights=leaves[1], dtype=sum_dtype)
            else:
                out = _reference(leaves[0], index, size, leaves[1], sum_dtype)
            out.backward(grad.to(sum_dtype))
        results.append([out.detach()] + [t.grad for t in leaves if t is not None])
    for ours, theirs in zip(results[1], results[0], strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_a_weighted_sum_keeps_the_rows_as_they_are_and_an_unweighted_one_keeps_none():
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(64, requires_grad=True)
    index = torch.randint(0, 8, (64,))
    saved: list[torch.Tensor] = []

    def keep(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        sum_rows(x, index, 8, weights=w)
        weighted = list(saved)
        saved.clear()
        sum_rows(x, index, 8)
    assert max(t.numel() * t.element_size() for t in weighted) == x.numel() * 2  # bf16 rows
    assert not any(t.dtype == torch.float32 and t.dim() == 2 for t in weighted)
    assert all(t.dim() == 1 for t in saved)  # the index only
