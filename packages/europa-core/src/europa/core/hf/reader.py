"""A Hugging Face checkpoint folder, read lazily: headers first, then only the
slices a rank asks for (``safetensors``' ``get_slice``).

Block-quantised FP8 (DeepSeek-V3's published format: ``float8_e4m3fn``
weights, each with a ``<name>_scale_inv`` of one fp32 scale per 128 × 128
block) is dequantised on load: a slice reads its FP8 rows and columns and
the scale blocks that cover them, and multiplies them out in fp32. Any other
``quantization_config`` is refused in one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from europa.core.errors import CheckpointError
from europa.core.hf.config_map import read_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
}
Region = tuple[slice, ...]


@dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _block_size(config: dict[str, Any], source: str) -> tuple[int, int] | None:
    quant = config.get("quantization_config")
    if not quant:
        return None
    method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
    block = quant.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2):
        raise CheckpointError(
            f"{source}: quantization_config = {json.dumps(quant)}: expected none, or "
            'DeepSeek-V3\'s block FP8 ({"quant_method": "fp8", "fmt": "e4m3", '
            '"weight_block_size": [128, 128]})'
        )
    return int(block[0]), int(block[1])


class HFCheckpoint:
    """``config.json``, the index and every shard's header; tensors on request."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory)
        self.config = read_config(self.path)
        self.block = _block_size(self.config, str(self.path / "config.json"))
        self.files = self._weight_files()
        self.tensors: dict[str, TensorInfo] = {}
        for file in sorted(set(self.files.values())):
            self._read_header(file)
        missing = sorted(k for k, f in self.files.items() if k not in self.tensors)
        if missing:
            raise CheckpointError(
                f"{str(self.path / self.files[missing[0]])!r} has no tensor {missing[0]!r}, "
                f"which {INDEX} places there: expected a complete checkpoint"
            )
        self._open: dict[str, Any] = {}

    def _weight_files(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(
                    f"{str(index)!r}: expected JSON with a weight_map {{tensor: file}}"
                ) from None
            for file in sorted(set(weight_map.values())):
                if not (self.path / file).is_file():
                    raise CheckpointError(
                        f"shard {str(self.path / file)!r}, named in {INDEX}, is missing: "
                        "expected every shard of the checkpoint"
                    )
            return dict(weight_map)
        if (self.path / SINGLE).is_file():
            with safe_open(self.path / SINGLE, framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE)
        raise CheckpointError(
            f"{str(self.path)!r} has neither {INDEX} nor {SINGLE}: expected a Hugging Face "
            "checkpoint's safetensors weights"
        )

    def _read_header(self, file: str) -> None:
        try:
            with safe_open(self.path / file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    piece = f.get_slice(key)
                    dtype = _DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise CheckpointError(
                            f"{file}: tensor {key!r} has dtype {piece.get_dtype()}: expected "
                            f"one of {', '.join(_DTYPES)}"
                        )
                    self.tensors[key] = TensorInfo(file, tuple(piece.get_shape()), dtype)
        except CheckpointError:
            raise
        except Exception as err:  # safetensors raises its own error types for a bad header
            raise CheckpointError(
                f"{str(self.path / file)!r} is not a readable safetensors file ({err}); "
                "expected the checkpoint's shard"
            ) from None

    def quantised(self, key: str) -> bool:
        return self.tensors[key].dtype == torch.float8_e4m3fn

    def read_bytes(self, key: str, region: Region | None = None) -> int:
        """Bytes read from disk for ``key`` (restricted to ``region``), scales included."""
        info = self.tensors[key]
        shape = _region_shape(info.shape, region)
        total = math.prod(shape) * info.dtype.itemsize
        if self.quantised(key) and self.block is not None:
            blocks = [math.ceil(n / b) + 1 for n, b in zip(shape, self.block, strict=True)]
            total += math.prod(blocks) * 4  # at most one block row and column more
        return total

    def _handle(self, file: str):
        if file not in self._open:
            self._open[file] = safe_open(self.path / file, framework="pt")
        return self._open[file]

    def _slice(self, key: str, region: Region) -> torch.Tensor:
        info = self.tensors[key]
        return self._handle(info.file).get_slice(key)[region]

    def read(self, key: str, region: Region | None = None) -> torch.Tensor:
        """``key`` (or its ``region``), as stored, or dequantised to fp32 if FP8."""
        info = self.tensors[key]
        region = region or tuple(slice(0, n) for n in info.shape)
        if not self.quantised(key):
            return self._slice(key, region)
        scale_key = key + SCALE_SUFFIX
        if self.block is None or scale_key not in self.tensors:
            raise CheckpointError(
                f"{key!r} is float8_e4m3fn without {scale_key!r} and a block-FP8 "
                "quantization_config: expected both, as DeepSeek-V3 publishes them"
            )
        return self._dequantise(key, scale_key, region)

    def _dequantise(self, key: str, scale_key: str, region: Region) -> torch.Tensor:
        rows, cols = region
        (br, bc) = self.block
        blocks = (
            slice(rows.start // br, math.ceil(rows.stop / br)),
            slice(cols.start // bc, math.ceil(cols.stop / bc)),
        )
        scales = self._slice(scale_key, blocks).float()
        scales = scales.repeat_interleave(br, 0).repeat_interleave(bc, 1)
        first = (rows.start - blocks[0].start * br, cols.start - blocks[1].start * bc)
        scales = scales[
            first[0] : first[0] + rows.stop - rows.start,
            first[1] : first[1] + cols.stop - cols.start,
        ]
        return self._slice(key, region).float() * scales

    def close(self) -> None:
        self._open.clear()


def _region_shape(shape: tuple[int, ...], region: Region | None) -> tuple[int, ...]:
    if region is None:
        return shape
    return tuple(s.stop - s.start for s in region)
