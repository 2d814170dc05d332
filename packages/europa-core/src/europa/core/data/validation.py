"""This rank's share of the validation sequences, the same at every evaluation.

The first ``count`` sequences of the held-out stream, in order, split like training batches:
evaluation batch b gives rank r the positions [(b W + r) B, (b W + r + 1) B). Every rank runs the
same number of batches (sharded models need every rank in every forward), so the last batches are
padded with sequence 0 at weight 0; the weighted token sums over all ranks give the exact mean
loss over the count sequences, for any world size.
"""

from __future__ import annotations

import math

import torch

from europa.core.data.packing import Sequences


class ValidationBatches:
    def __init__(
        self, sequences: Sequences, *, batch_size: int, dp_rank: int, dp_world: int, count: int
    ) -> None:
        self.sequences = sequences
        self.batch_size, self.dp_rank, self.dp_world = batch_size, dp_rank, dp_world
        self.count = min(count, sequences.num_sequences)
        self.num_batches = math.ceil(self.count / (batch_size * dp_world))

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, labels, weights): [B, L] int64 twice, and [B] float, 0 for padding rows."""
        start = (index * self.dp_world + self.dp_rank) * self.batch_size
        positions = torch.arange(start, start + self.batch_size)
        real = positions < self.count
        rows = self.sequences.rows(torch.where(real, positions, 0))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), real.float()
