"""Sums of rows into other rows (``out[index[i]] += rows[i] * weights[i]``), as the
combine runs them: the expert rank weights each (row, slot) pair by its score and sums a
row's pairs, forwarders sum what comes back, the token's rank sums over its rows.

Design note. Written as ``zeros.index_add(0, index, rows.float() * weights)``, autograd
keeps the fp32 copy of ``rows`` (for the weights' gradient) and the fp32 products
(``index_add`` saves its source), 8 bytes a routed value beside the rows themselves, and
makes every fp32 temporary at once: at 128k tokens a rank that is several GiB, the largest
part of a block's backward (``europa plan --execute`` of the seed's 128k layout). Here one
autograd function saves the rows as they are (only when weighted: an unweighted sum's
backward needs the index alone) and works a slice of rows at a time
(``europa.flexshard.exchange.slices``). The arithmetic is the same, value for value: each
product in fp32, rounded to the sum's dtype, added as ``index_add`` adds.
"""

from __future__ import annotations

import torch

from europa.flexshard.exchange.slices import row_slices


def sum_rows(
    rows: torch.Tensor,
    index: torch.Tensor,
    size: int,
    weights: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[size, cols]`` of ``dtype``: row ``index[i]`` sums ``rows[i]`` (times
    ``weights[i]``, the product in fp32)."""
    return _SumRows.apply(rows, weights, index, size, dtype)


def _slices(shape: torch.Size) -> list[slice]:
    return row_slices(shape[0], 4 * shape[1])  # each row's fp32 values


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, index, size, dtype):
        out = rows.new_zeros(size, rows.shape[1], dtype=dtype)
        # A sum in fp32 adds slice after slice as one index_add would; a lower-precision
        # one accumulates within a call in more than its dtype (on CPUs), so its products
        # are made a slice at a time and added at once.
        products = None if dtype == torch.float32 else torch.empty_like(rows, dtype=dtype)
        for part in _slices(rows.shape):
            piece = rows[part].float()
            if weights is not None:
                piece = piece * weights[part, None].float()
            if products is None:
                out.index_add_(0, index[part], piece)
            else:
                products[part] = piece
        if products is not None:
            out.index_add_(0, index, products)
        ctx.save_for_backward(rows if weights is not None else None, weights, index)
        ctx.rows_like = (rows.shape, rows.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, weights, index = ctx.saved_tensors
        shape, dtype = ctx.rows_like
        wants_rows, wants_weights = ctx.needs_input_grad[:2]
        grad_rows = grad.new_empty(shape, dtype=dtype) if wants_rows else None
        grad_weights = torch.empty_like(weights) if wants_weights else None
        for part in _slices(shape):
            g = grad.index_select(0, index[part]).float()
            if grad_rows is not None:
                grad_rows[part] = g if weights is None else g * weights[part, None].float()
            if grad_weights is not None:
                grad_weights[part] = (g * rows[part].float()).sum(-1)
        return grad_rows, grad_weights, None, None, None
