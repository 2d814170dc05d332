"""Rows of a tensor as bytes on the wire, and back (the layout ``europa.flexshard.exchange.wire``
counts).

A codec turns a 2-D tensor into ``uint8`` rows (``encode``) and such rows into a
tensor of a given dtype (``decode``). Every collective of an expert exchange then
moves plain bytes, which every backend can send (gloo has no FP8 type).

FP8 (e4m3): each row is cut into blocks of ``FP8_BLOCK`` values; a block is divided
by its absolute maximum over 448 (e4m3's largest finite value), rounded to FP8, and
its fp32 scale travels after the row's values, so ``decode`` multiplies it back. An
all-zero block keeps scale 1. Both work through the rows a slice at a time
(``europa.flexshard.exchange.slices``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from europa.flexshard.exchange.slices import row_slices
from europa.flexshard.exchange.wire import FP8_BLOCK, row_bytes

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class Codec:
    """``wire``: "compute" (the tensor's own dtype), "bfloat16" or "float8_e4m3fn"."""

    wire: str = "compute"

    def row_bytes(self, cols: int, dtype: torch.dtype) -> int:
        return row_bytes(self.wire, cols, dtype.itemsize)

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        """``[rows, cols]`` -> ``[rows, row_bytes]`` uint8."""
        if t.numel() == 0:  # an empty tensor may have any strides, which a dtype view refuses
            width = self.row_bytes(t.shape[1], t.dtype)
            return torch.empty(t.shape[0], width, dtype=torch.uint8, device=t.device)
        if self.wire == "float8_e4m3fn":
            out = torch.empty(t.shape[0], self.row_bytes(t.shape[1], t.dtype), dtype=torch.uint8,
                              device=t.device)  # fmt: skip
            for rows in _slices(t.shape[0], t.shape[1]):
                out[rows] = _fp8_encode(t[rows])
            return out
        if self.wire == "bfloat16":
            t = t.to(torch.bfloat16)
        return t.contiguous().view(torch.uint8)  # [rows, cols * itemsize]

    def decode(self, b: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, row_bytes]`` uint8 -> ``[rows, cols]`` of ``dtype``."""
        if b.numel() == 0:
            return torch.empty(b.shape[0], cols, dtype=dtype, device=b.device)
        if self.wire == "float8_e4m3fn":
            out = torch.empty(b.shape[0], cols, dtype=dtype, device=b.device)
            for rows in _slices(b.shape[0], cols):
                out[rows] = _fp8_decode(b[rows], cols)
            return out
        wire = torch.bfloat16 if self.wire == "bfloat16" else dtype
        return _aligned(b).view(wire).to(dtype)  # [rows, cols]


def _aligned(b: torch.Tensor) -> torch.Tensor:
    """``b`` itself when a dtype view of it is valid (contiguous, aligned), else a copy: the
    columns of one part of a packed row start anywhere in the row. (One row of a wider
    tensor counts as contiguous but keeps the wider row's stride.)"""
    if b.is_contiguous() and b.stride(0) == b.shape[1] and b.storage_offset() % 16 == 0:
        return b
    return b.clone(memory_format=torch.contiguous_format)


def _slices(rows: int, cols: int) -> list[slice]:
    return row_slices(rows, 4 * _blocks(cols) * FP8_BLOCK)  # the padded fp32 values


def _blocks(cols: int) -> int:
    return -(-cols // FP8_BLOCK)


def _fp8_encode(t: torch.Tensor) -> torch.Tensor:
    rows, cols = t.shape
    blocks = _blocks(cols)
    padded = t.new_zeros(rows, blocks * FP8_BLOCK, dtype=torch.float32)
    padded[:, :cols] = t
    padded = padded.view(rows, blocks, FP8_BLOCK)
    amax = padded.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    values = (padded / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, -1)[:, :cols]
    return torch.cat([values.view(torch.uint8), scale.view(rows, blocks).view(torch.uint8)], 1)


def _fp8_decode(b: torch.Tensor, cols: int) -> torch.Tensor:
    rows, blocks = b.shape[0], _blocks(cols)
    values = _aligned(b[:, :cols]).view(FP8).float()
    scale = _aligned(b[:, cols:]).view(torch.float32).view(rows, blocks)
    padded = values.new_zeros(rows, blocks * FP8_BLOCK)
    padded[:, :cols] = values
    return (padded.view(rows, blocks, FP8_BLOCK) * scale[..., None]).view(rows, -1)[:, :cols]
