"""The ownership plan: which rank of a group owns each whole matrix.

Pure Python: no torch, no process group. Every rank computes the same plan from
the same parameter names and shapes, so no rank has to tell another.

A parameter is a stack of matrices: a stacked expert tensor ``[E, rows, cols]``
holds E, any other tensor (a 2-D weight, a 1-D norm or bias) is one. Each
matrix gets exactly one owner; a matrix is never split, and nothing is padded.

Design note: how matrices are dealt out. Matrices are taken one gather unit (a
transformer block) at a time, largest first. Each goes to a rank whose total
bytes so far are at most the final mean (total / ranks); among those, to the one
holding the fewest bytes *of this unit* (so every rank sends a similar share
when the unit is gathered, which keeps padding in the all-gather small), then
the least Newton–Schulz work, then the fewest bytes, then the lowest rank.

The byte bound this gives: some rank always qualifies (the loads before an
item sum to at most total - item), and the last matrix placed on the most
loaded rank found it at most at the mean, so *the most loaded rank holds at
most the mean plus the largest matrix*, whatever the order. Newton–Schulz work
is balanced as a tie-breaker only (the plan reports its max / mean).

Finally each stacked parameter's experts are renumbered into contiguous runs in
rank order (rank 0 owns experts 0..c0-1, rank 1 the next c1, ...). Every rank
keeps the same count, so the balance is unchanged, and a gathered parameter is
the concatenation of the ranks' pieces in rank order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from europa.flexshard.errors import PlanError


def newton_schulz_flops(shape: tuple[int, ...], steps: int = 5) -> int:
    """Floating-point operations of ``steps`` quintic Newton–Schulz iterations on one matrix."""
    if len(shape) != 2:
        return 0
    short, long = sorted(shape)
    # Per step: X X^T (2 s s l), gram @ gram (2 s^3), (b gram + c gram^2) @ X (2 s s l).
    return steps * (4 * short * short * long + 2 * short**3)


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter as the plan sees it: name, full shape, bytes per element,
    the gather unit it belongs to, and whether an optimizer orthogonalises it."""

    name: str
    shape: tuple[int, ...]
    itemsize: int = 4
    unit: str = ""
    orthogonalised: bool = True

    @property
    def stacked(self) -> bool:
        return len(self.shape) == 3

    @property
    def matrices(self) -> int:
        return self.shape[0] if self.stacked else 1

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[1:]) if self.stacked else tuple(self.shape)

    @property
    def matrix_numel(self) -> int:
        return math.prod(self.matrix_shape)

    @property
    def matrix_bytes(self) -> int:
        return self.matrix_numel * self.itemsize

    @property
    def matrix_work(self) -> int:
        return newton_schulz_flops(self.matrix_shape) if self.orthogonalised else 0


@dataclass(frozen=True)
class OwnershipPlan:
    """``ranges[name][rank]`` is the (start, stop) of the matrices ``rank`` owns."""

    group_size: int
    parameters: tuple[ParameterSpec, ...]
    ranges: Mapping[str, tuple[tuple[int, int], ...]]
    _specs: dict[str, ParameterSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_specs", {p.name: p for p in self.parameters})

    def spec(self, name: str) -> ParameterSpec:
        return self._specs[name]

    def owned(self, rank: int, name: str) -> range:
        start, stop = self.ranges[name][rank]
        return range(start, stop)

    def owner(self, name: str, index: int) -> int:
        for rank, (start, stop) in enumerate(self.ranges[name]):
            if start <= index < stop:
                return rank
        raise IndexError(f"{name} has no matrix {index}")

    def counts(self, name: str) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.ranges[name])

    def _per_rank(self, per_matrix: str) -> list[int]:
        totals = [0] * self.group_size
        for p in self.parameters:
            each = getattr(p, per_matrix)
            for rank, count in enumerate(self.counts(p.name)):
                totals[rank] += count * each
        return totals

    def rank_bytes(self) -> list[int]:
        return self._per_rank("matrix_bytes")

    def rank_work(self) -> list[int]:
        """Newton–Schulz FLOPs each rank runs per optimizer step."""
        return self._per_rank("matrix_work")

    def summary(self) -> dict[str, Any]:
        """Per-rank bytes and Newton–Schulz work, with max / mean, for logs and plans."""
        per_rank = self.rank_bytes()
        work = self.rank_work()
        mean = sum(per_rank) / self.group_size
        mean_work = sum(work) / self.group_size
        return {
            "ranks": self.group_size,
            "matrices": sum(p.matrices for p in self.parameters),
            "bytes_per_rank": per_rank,
            "bytes_max": max(per_rank, default=0),
            "bytes_mean": mean,
            "bytes_max_over_mean": max(per_rank, default=0) / mean if mean else 1.0,
            "largest_matrix_bytes": max((p.matrix_bytes for p in self.parameters), default=0),
            "newton_schulz_flops_per_rank": work,
            "newton_schulz_max_over_mean": max(work, default=0) / mean_work if mean_work else 1.0,
        }

    def describe(self) -> str:
        s = self.summary()
        return (
            f"flexshard: {s['matrices']} whole matrices over {s['ranks']} rank(s); parameter "
            f"bytes per rank max {_mib(s['bytes_max'])} / mean {_mib(s['bytes_mean'])} "
            f"({s['bytes_max_over_mean']:.3f}), Newton–Schulz work max / mean "
            f"{s['newton_schulz_max_over_mean']:.3f}"
        )


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _check(parameters: tuple[ParameterSpec, ...], group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise PlanError(f"group size = {group_size!r}: expected an integer >= 1")
    seen: set[str] = set()
    for p in parameters:
        if p.name in seen:
            raise PlanError(f"parameter {p.name!r} appears twice: expected unique names")
        seen.add(p.name)
        if any(d < 0 for d in p.shape) or p.itemsize < 1:
            raise PlanError(
                f"parameter {p.name!r} has shape {p.shape} and itemsize {p.itemsize}: "
                "expected sizes >= 0 and an itemsize >= 1"
            )


def plan_ownership(parameters: Iterable[ParameterSpec], group_size: int) -> OwnershipPlan:
    """Give every matrix of ``parameters`` one owner among ``group_size`` ranks.

    Deterministic: the same inputs give the same plan on every rank."""
    params = tuple(parameters)
    _check(params, group_size)
    total = sum(p.matrices * p.matrix_bytes for p in params)
    bytes_, work = [0] * group_size, [0] * group_size
    counts = {p.name: [0] * group_size for p in params}
    # Ranks above the mean never qualify again (loads only grow), so they leave for good.
    over_mean: set[int] = set()

    for unit_params in _by_unit(params):
        items = sorted(
            ((p.matrix_bytes, position, p) for position, p in enumerate(unit_params)),
            key=lambda item: (-item[0], item[1]),
        )
        unit_bytes = [0] * group_size
        heap = [(0, work[r], bytes_[r], r) for r in range(group_size) if r not in over_mean]
        heapq.heapify(heap)
        for size, _, p in items:
            for _ in range(p.matrices):
                rank = _take_qualified(heap, bytes_, total, group_size, over_mean)
                counts[p.name][rank] += 1
                bytes_[rank] += size
                work[rank] += p.matrix_work
                unit_bytes[rank] += size
                heapq.heappush(heap, (unit_bytes[rank], work[rank], bytes_[rank], rank))

    ranges = {p.name: _contiguous(counts[p.name]) for p in params}
    return OwnershipPlan(group_size, params, ranges)


def _take_qualified(heap, bytes_, total, group_size, over_mean) -> int:
    while True:
        _, _, _, rank = heapq.heappop(heap)
        if bytes_[rank] * group_size <= total:
            return rank
        over_mean.add(rank)


def _by_unit(params: tuple[ParameterSpec, ...]) -> list[list[ParameterSpec]]:
    units: dict[str, list[ParameterSpec]] = {}
    for p in params:
        units.setdefault(p.unit, []).append(p)
    return list(units.values())


def _contiguous(counts: list[int]) -> tuple[tuple[int, int], ...]:
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return tuple(ranges)
