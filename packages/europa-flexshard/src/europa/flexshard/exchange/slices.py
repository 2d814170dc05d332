"""Rows a slice at a time: an exchange's fp32 temporaries (the FP8 codec's, the weighted
sums') are then a slice's, not several fp32 copies of every row, GiB at long context.
Each row is worked on by itself, so the result is the same however the rows are cut."""

from __future__ import annotations

WORKING_BYTES = 256 << 20  # fp32 bytes of the rows worked on at a time


def row_slices(rows: int, fp32_row_bytes: int) -> list[slice]:
    """Slices of ``rows`` rows of ``fp32_row_bytes`` each, ``WORKING_BYTES`` at most a
    slice (one row at least)."""
    step = max(1, WORKING_BYTES // max(1, fp32_row_bytes))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]
