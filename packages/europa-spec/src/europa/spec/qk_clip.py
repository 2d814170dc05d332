"""QK-clip's arithmetic (Kimi-K2's MuonClip, arXiv 2507.20534, Algorithm 1), once for every
layout: which rows of MLA's query and key matrices belong to which head, how much each
is scaled, and the in-place scaling of the rows a rank holds.

After the optimizer step, a head whose largest pre-softmax logit of the step ``S_h``
exceeds ``tau`` is scaled by ``gamma_h = tau / S_h``: its own query and key parts
(``q^C``, ``k^C``: the no-position columns) by ``sqrt(gamma_h)``, its rotary query
``q^R`` by ``gamma_h``. The rotary key ``k^R`` is shared by every head and is left
alone; so are the values. Every logit of a clipped head is then ``gamma_h`` times what
it was. A head with ``S_h <= tau`` (a maximum of 0 or below included) keeps its weights
bit for bit.

Rows, in torchtitan's DeepSeek-V3 MLA (``wq`` or ``wq_b``: ``n_heads`` blocks of ``nope``
then ``rope`` rows; ``wkv_b``: ``n_heads`` blocks of ``nope`` key rows then ``v`` value
rows). A layout holds some contiguous global rows of such a matrix (all of them, a shard
of them, or none); ``scale_rows_`` scales the ones it holds, given their first global
row. The factors are computed in float64 from maxima every replica agrees on, so every
replica scales alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_TAU = 100.0
MAXIMA_TRAFFIC = "qk_clip_maxima"  # the kind of the maxima's MAX all-reduce (plans, counts)


def maxima_bytes(n_layers: int, n_heads: int) -> int:
    """The (layers, heads) float32 maxima every rank reduces once a step."""
    return n_layers * n_heads * 4


QUERY = "query"  # wq / wq_b: per head, nope rows by sqrt(gamma), rope rows by gamma
KEY_VALUE = "key_value"  # wkv_b: per head, nope key rows by sqrt(gamma), value rows kept


@dataclass(frozen=True)
class MLAHeads:
    n_heads: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    v: int  # v_head_dim

    def rows(self, matrix: str) -> int:
        width = self.nope + (self.rope if matrix == QUERY else self.v)
        return self.n_heads * width

    def row_exponents(self, matrix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(head of each row, exponent of gamma for each row) over the matrix's global rows."""
        if matrix == QUERY:
            per_head = [0.5] * self.nope + [1.0] * self.rope
        elif matrix == KEY_VALUE:
            per_head = [0.5] * self.nope + [0.0] * self.v
        else:
            raise ValueError(f"matrix = {matrix!r}: expected {QUERY!r} or {KEY_VALUE!r}")
        exponents = torch.tensor(per_head, dtype=torch.float64).repeat(self.n_heads)
        heads = torch.arange(self.n_heads).repeat_interleave(len(per_head))
        return heads, exponents


def clip_gammas(maxima: torch.Tensor, tau: float) -> torch.Tensor:
    """gamma per head, float64: ``tau / S`` where ``S > tau``, exactly 1 elsewhere."""
    if not tau > 0:
        raise ValueError(f"tau = {tau!r}: expected a number > 0")
    s = maxima.detach().to("cpu", torch.float64)
    return torch.where(s > tau, tau / s, torch.ones_like(s))


def row_factors(heads: MLAHeads, matrix: str, gammas: torch.Tensor) -> torch.Tensor:
    """One layer's factor for every global row of ``matrix`` (float64), from its heads'
    gammas: exactly 1 for the rows of unclipped heads and for the rows never scaled."""
    if gammas.shape != (heads.n_heads,):
        raise ValueError(f"gammas of shape {tuple(gammas.shape)}: expected ({heads.n_heads},)")
    head_of_row, exponents = heads.row_exponents(matrix)
    return gammas.to(torch.float64)[head_of_row].pow(exponents)


def scale_rows_(local: torch.Tensor, factors: torch.Tensor, first_row: int) -> int:
    """Scale, in place, the rows of ``local`` (global rows ``first_row`` onwards, 2-D) whose
    factor is not 1; the others are not touched. Returns how many rows were scaled."""
    held = factors[first_row : first_row + local.size(0)]
    if held.numel() != local.size(0):
        raise ValueError(
            f"local rows {first_row}..{first_row + local.size(0)} beyond the matrix's "
            f"{factors.numel()} rows"
        )
    rows = torch.nonzero(held != 1.0).flatten()
    if rows.numel() == 0:
        return 0
    scale = held[rows].to(local.dtype).to(local.device).unsqueeze(1)
    index = rows.to(local.device)
    local.index_copy_(0, index, local.index_select(0, index) * scale)
    return rows.numel()


__all__ = [
    "DEFAULT_TAU",
    "KEY_VALUE",
    "MAXIMA_TRAFFIC",
    "QUERY",
    "MLAHeads",
    "clip_gammas",
    "maxima_bytes",
    "row_factors",
    "scale_rows_",
]
