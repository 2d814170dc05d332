"""How a layout asks for initial values: one matrix at a time, whoever draws them (europa-core's
seeded initialiser, a Hugging Face checkpoint reader) and whatever layout places them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class InitMatrix(Protocol):
    def __call__(self, name: str, index: int, out: torch.Tensor) -> None:
        """Fill ``out`` with matrix ``index`` of parameter ``name`` (a stacked expert
        parameter ``[E, rows, cols]`` holds E matrices, any other parameter one)."""
        ...


@runtime_checkable
class RegionInitMatrix(InitMatrix, Protocol):
    """An initialiser that can fill part of a matrix without making the whole (a checkpoint
    reader reads only that region): what a layout holding row shards asks for."""

    def fill_region(
        self, name: str, index: int, out: torch.Tensor, region: tuple[slice, ...]
    ) -> None:
        """Fill ``out`` with ``region`` of matrix ``index`` of parameter ``name``."""
        ...


__all__ = ["InitMatrix", "RegionInitMatrix"]
