"""Where each rank's owned matrices of one gather unit sit in its flat segment.

A rank's segment is its owned matrices of the unit's parameters, one parameter
after another, flattened. The collectives move rows of a ``[ranks, width]``
buffer (width = the largest segment; shorter segments leave their tail unused):
the all-gather stacks every rank's segment, the reduce-scatter hands each rank
the sum of its row. This module is the data path around those two collectives
and nothing else (no process group), so the round trips are testable on their
own: ``unpack(stack(pack(r) for r))`` rebuilds the full parameters and
``split(r, scatter_rows(fulls)[r])`` is rank r's share of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from europa.flexshard.ownership import OwnershipPlan, ParameterSpec

# The padding of a unit's gathered rows that its parameters may keep alive as views: 1/8.
MAX_PADDING_SHARE_INVERSE = 8


class UnitSegments:
    def __init__(self, plan: OwnershipPlan, names: Sequence[str]) -> None:
        self.plan = plan
        self.names = list(names)
        self.specs: list[ParameterSpec] = [plan.spec(n) for n in self.names]
        self.ranks = plan.group_size
        self.counts = [plan.counts(n) for n in self.names]
        self.starts = [[start for start, _ in plan.ranges[n]] for n in self.names]
        self.offsets: list[list[int]] = []
        self.sizes: list[int] = []
        for rank in range(self.ranks):
            offset, row = 0, []
            for spec, counts in zip(self.specs, self.counts, strict=True):
                row.append(offset)
                offset += counts[rank] * spec.matrix_numel
            self.offsets.append(row)
            self.sizes.append(offset)
        self.width = max(self.sizes, default=0)
        # Rows shorter than the widest are padding; gathered parameters may view the rows
        # (no copy) only while that keeps at most 1/8 more than the parameters themselves.
        padding = self.ranks * self.width - sum(self.sizes)
        self.views_rows = padding * MAX_PADDING_SHARE_INVERSE <= sum(self.sizes)

    def local_shape(self, rank: int, slot: int) -> tuple[int, ...]:
        """Rank ``rank``'s storage of parameter ``slot``: ``[owned matrices, *matrix]``."""
        return (self.counts[slot][rank], *self.specs[slot].matrix_shape)

    def pack(
        self,
        rank: int,
        locals_: Sequence[torch.Tensor],
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rank ``rank``'s segment, ``[width]`` in ``dtype``, from its local parameters
        (into ``out`` when given)."""
        if out is None:
            device = locals_[0].device if locals_ else torch.device("cpu")
            out = torch.empty(self.width, dtype=dtype, device=device)
        offset = 0
        for local in locals_:
            n = local.numel()
            out[offset : offset + n].copy_(local.reshape(-1))
            offset += n
        if offset < self.width:
            out[offset:].zero_()
        return out

    def unpack(
        self, rows: torch.Tensor, own: tuple[int, Sequence[torch.Tensor]] | None = None
    ) -> list[torch.Tensor]:
        """Every parameter in full, from the gathered ``[ranks, width]`` rows: a view of
        ``rows`` where one rank owns all its matrices (whole-matrix ownership makes that
        the common case, and it costs no copy) and the rows are little padding
        (``views_rows``), else a new tensor of the ranks' pieces. ``own = (rank, locals)``:
        rank's pieces are its local tensors, not its row (which is then never read), and a
        parameter it owns whole is a view of its local tensor."""
        fulls = []
        for slot, spec in enumerate(self.specs):
            pieces = [
                self._piece(rows, rank, slot, own)
                for rank in range(self.ranks)
                if self.counts[slot][rank]
            ]
            owner_views = own is not None and self.counts[slot][own[0]] == spec.matrices
            if not pieces:  # a stack of zero experts
                fulls.append(rows.new_empty(spec.shape))
            elif len(pieces) == 1 and (self.views_rows or owner_views):
                fulls.append(pieces[0].view(spec.shape))
            else:
                fulls.append(torch.cat(pieces).view(spec.shape))
        return fulls

    def _piece(
        self,
        rows: torch.Tensor,
        rank: int,
        slot: int,
        own: tuple[int, Sequence[torch.Tensor]] | None,
    ) -> torch.Tensor:
        if own is not None and own[0] == rank:
            return own[1][slot].view(self.local_shape(rank, slot))
        return rows[rank, self._span(rank, slot)].view(self.local_shape(rank, slot))

    def scatter_rows(self, fulls: Sequence[torch.Tensor | None], out: torch.Tensor) -> torch.Tensor:
        """Fill ``out[rank]`` with rank's owned matrices of ``fulls`` (None counts as zeros)."""
        for slot, full in zip(range(len(self.specs)), fulls, strict=True):
            for rank in range(self.ranks):
                if not self.counts[slot][rank]:
                    continue
                target = out[rank, self._span(rank, slot)]
                if full is None:
                    target.zero_()
                else:
                    target.copy_(self._owned(slot, rank, full).reshape(-1))
        return out

    def owned_pieces(self, rank: int, fulls: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Rank's owned matrices of ``fulls``, ``[count, *matrix]`` views, for each
        parameter it owns any of (``owned_slots``), in slot order."""
        return [self._owned(slot, rank, fulls[slot]) for slot in self.owned_slots(rank)]

    def owned_spans(self, rank: int) -> list[slice]:
        """Where rank's pieces (``owned_slots``) sit in its row, in slot order."""
        return [self._span(rank, slot) for slot in self.owned_slots(rank)]

    def owned_slots(self, rank: int) -> list[int]:
        return [slot for slot, counts in enumerate(self.counts) if counts[rank]]

    def _owned(self, slot: int, rank: int, full: torch.Tensor) -> torch.Tensor:
        """Rank's owned matrices of parameter ``slot``'s full tensor, a view where it can be."""
        spec, start = self.specs[slot], self.starts[slot][rank]
        matrices = full.reshape(spec.matrices, *spec.matrix_shape)
        return matrices[start : start + self.counts[slot][rank]]

    def fills_row(self, rank: int) -> bool:
        """Rank's segment is as wide as the rows: views of its row waste nothing."""
        return self.sizes[rank] == self.width

    def split(self, rank: int, segment: torch.Tensor) -> list[torch.Tensor]:
        """Views of rank's segment shaped as its local parameters."""
        return [
            segment[self._span(rank, slot)].view(self.local_shape(rank, slot))
            for slot in range(len(self.specs))
        ]

    def _span(self, rank: int, slot: int) -> slice:
        start = self.offsets[rank][slot]
        return slice(start, start + self.counts[slot][rank] * self.specs[slot].matrix_numel)
