"""The zig-zag cut of a sequence over a context-parallel group of ``cp`` ranks.

The sequence is cut into 2·cp equal chunks; rank r holds chunks r and 2·cp−1−r, in that
order. Causal attention costs a query its position's worth of keys, so each rank gets one
cheap and one dear chunk and every rank the same work (Megatron's and torch's
``context_parallel`` load balancing).

Notation: B batch, L the whole sequence, c = L / (2·cp) one chunk, F features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ZigZag:
    cp: int  # ranks sharing one sequence
    rank: int  # this rank's place among them

    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.cp - 1 - self.rank

    def chunk_len(self, local_len: int) -> int:
        if local_len % 2:
            raise ValueError(f"zig-zag: a rank's {local_len} rows are not two equal chunks")
        return local_len // 2

    def segments(self, local_len: int) -> list[tuple[int, int, int]]:
        """(first local row, first position, rows) of each chunk this rank holds."""
        c = self.chunk_len(local_len)
        return [(i * c, chunk * c, c) for i, chunk in enumerate(self.chunks())]

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """Each local row's position in the whole sequence, (local_len,)."""
        c = self.chunk_len(local_len)
        return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in self.chunks()])

    def cut(self, whole: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's rows of a whole sequence (its two chunks along ``dim``, joined)."""
        pieces = whole.chunk(2 * self.cp, dim=dim)
        if whole.size(dim) % (2 * self.cp):
            raise ValueError(
                f"zig-zag: a sequence of {whole.size(dim)} is not {2 * self.cp} equal chunks"
            )
        return torch.cat([pieces[k] for k in self.chunks()], dim=dim)


def whole_from_gathered(gathered_KBlF: torch.Tensor) -> torch.Tensor:
    """(cp, B, 2c, F) rows of every rank, rank by rank, to (B, L, F) in sequence order."""
    cp, batch, local_len, features = gathered_KBlF.shape
    halves = gathered_KBlF.view(cp, batch, 2, local_len // 2, features)
    # chunks 0..cp-1 are the ranks' first halves in rank order, chunks cp..2cp-1 their
    # second halves in reverse rank order
    chunks = torch.cat([halves[:, :, 0], halves.flip(0)[:, :, 1]])  # (2cp, B, c, F)
    return chunks.permute(1, 0, 2, 3).reshape(batch, cp * local_len, features)


def gathered_from_whole(whole_BLF: torch.Tensor, cp: int) -> torch.Tensor:
    """``whole_from_gathered``'s inverse: (B, L, F) to (cp, B, 2c, F), rank by rank."""
    batch, seq_len, features = whole_BLF.shape
    chunks = whole_BLF.view(batch, 2 * cp, seq_len // (2 * cp), features).transpose(0, 1)
    firsts, seconds = chunks[:cp], chunks[cp:].flip(0)
    return torch.stack([firsts, seconds], dim=2).reshape(cp, batch, seq_len // cp, features)
