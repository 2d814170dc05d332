"""Packing documents into fixed-length training sequences, and per-rank batches of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from tokenizers import Tokenizer

from europa.core.data.documents import DataError
from europa.core.data.permutation import permute
from europa.core.data.tokenizer import EOS_TOKEN
from europa.core.seeds import MAX_SEED

_ENCODE_CHUNK = 1024  # documents per encode_batch call, to bound the memory of Encoding objects


class Sequences(Protocol):
    """What RankBatches reads: packed windows of seq_len + 1 tokens, in memory or memory-mapped."""

    seq_len: int

    @property
    def num_sequences(self) -> int: ...

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """[len(indices), seq_len + 1] int64: the windows at these indices."""
        ...


class PackedSequences:
    """All documents tokenized, each followed by EOS, concatenated into one 1-D int64 token stream,
    cut into non-overlapping windows of seq_len + 1 tokens (the trailing remainder is dropped).
    Window i gives inputs = w[:-1], labels = w[1:].

    Attributes: `tokens` is the whole stream (num_tokens long, remainder included), `windows` the
    [num_sequences, seq_len + 1] view of its first num_sequences * (seq_len + 1) tokens.
    """

    def __init__(self, documents: Sequence[str], tokenizer: Tokenizer, seq_len: int) -> None:
        eos_id = tokenizer.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise DataError(
                f"data.tokenizer: the tokenizer has no {EOS_TOKEN} token; "
                "expected one to separate documents"
            )
        self._pack(_token_stream(documents, tokenizer, eos_id), seq_len)

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, seq_len: int) -> PackedSequences:
        """Pack an already tokenized 1-D stream (EOS tokens, if wanted, included by the caller)."""
        packed = cls.__new__(cls)
        packed._pack(tokens, seq_len)
        return packed

    def _pack(self, tokens: torch.Tensor, seq_len: int) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(f"training.seq_len = {seq_len!r}: expected a positive integer")
        self.tokens = tokens.to(torch.int64).reshape(-1)
        self.seq_len = seq_len
        window = seq_len + 1
        count = self.tokens.numel() // window
        if count == 0:
            raise DataError(
                f"data.path / training.seq_len = {seq_len}: the text has {self.tokens.numel()} "
                f"tokens (EOS included) but one sequence needs seq_len + 1 = {window}; "
                "expected more text or a smaller training.seq_len"
            )
        self.windows = self.tokens[: count * window].view(count, window)

    @property
    def num_sequences(self) -> int:
        return self.windows.shape[0]

    @property
    def num_tokens(self) -> int:
        """Length of the whole token stream, including the remainder no window uses."""
        return self.tokens.numel()

    def __len__(self) -> int:
        return self.num_sequences

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        return self.windows[indices]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.num_sequences <= index < self.num_sequences:
            raise IndexError(f"sequence {index} out of range for {self.num_sequences} sequences")
        window = self.windows[index]
        return window[:-1].clone(), window[1:].clone()


class RankBatches:
    """Deterministic, stateless batch source: the batch for (step, micro) on a data-parallel rank
    is a pure function of (seed, step, micro, dp_rank, dp_world). Resume therefore needs only the
    step counter.

    The sequence indices form an endless stream of epochs; epoch e is the order
    ``permutation.permute(·, num_sequences, seed, e)``, computed only at the positions a batch
    needs, so no rank ever holds a whole epoch's order (see ``permutation``). Micro-batch
    g = step * grad_accum_steps + micro takes the stream positions [g * G, (g + 1) * G), where
    G = batch_size * dp_world, and rank r takes [r * batch_size, (r + 1) * batch_size) of those.
    Every sequence is therefore used once per epoch, and no two ranks or micro-batches share a
    sequence within an epoch. A micro-batch that straddles an epoch boundary takes the last
    sequences of one epoch and the first of the next, so it may hold one sequence twice.
    """

    def __init__(
        self,
        sequences: Sequences,
        *,
        batch_size: int,
        dp_rank: int,
        dp_world: int,
        grad_accum_steps: int = 1,
        seed: int = 0,
    ) -> None:
        _require(batch_size >= 1, f"batch_size must be >= 1, got {batch_size}")
        _require(dp_world >= 1, f"dp_world must be >= 1, got {dp_world}")
        _require(0 <= dp_rank < dp_world, f"dp_rank must be in [0, {dp_world}), got {dp_rank}")
        _require(grad_accum_steps >= 1, f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
        global_batch = batch_size * dp_world
        if sequences.num_sequences < global_batch:
            raise DataError(
                f"data.path: the text gives {sequences.num_sequences} sequences of "
                f"training.seq_len = {sequences.seq_len} tokens, but each micro-batch needs "
                f"{global_batch} (batch_size {batch_size} × {dp_world} data-parallel ranks); "
                "expected more text, a smaller training.seq_len or a smaller training.batch_size"
            )
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed = {seed}: expected an integer between 0 and {MAX_SEED}")
        self.sequences = sequences
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.grad_accum_steps = grad_accum_steps
        self.seed = seed

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of this rank for micro-batch `micro` of `step`, each [batch_size,
        seq_len] int64."""
        rows = self.sequences.rows(self.sequence_indices(step, micro))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def sequence_indices(self, step: int, micro: int = 0) -> torch.Tensor:
        """Indices into `sequences` of this rank's batch for (step, micro), in batch order."""
        _require(step >= 0, f"step must be >= 0, got {step}")
        _require(
            0 <= micro < self.grad_accum_steps,
            f"micro must be in [0, {self.grad_accum_steps}), got {micro}",
        )
        micro_batch = step * self.grad_accum_steps + micro
        start = (micro_batch * self.dp_world + self.dp_rank) * self.batch_size
        positions = np.arange(start, start + self.batch_size, dtype=np.int64)
        count = self.sequences.num_sequences
        epochs, offsets = positions // count, positions % count
        indices = np.empty(self.batch_size, dtype=np.int64)
        # batch_size <= num_sequences, so at most two epochs are involved.
        for epoch in np.unique(epochs).tolist():
            in_epoch = epochs == epoch
            indices[in_epoch] = permute(offsets[in_epoch], count, self.seed, epoch)
        return torch.from_numpy(indices)


def _token_stream(documents: Sequence[str], tokenizer: Tokenizer, eos_id: int) -> torch.Tensor:
    stream: list[int] = []
    for start in range(0, len(documents), _ENCODE_CHUNK):
        chunk = list(documents[start : start + _ENCODE_CHUNK])
        for encoding in tokenizer.encode_batch(chunk, add_special_tokens=False):
            stream.extend(encoding.ids)
            stream.append(eos_id)
    return torch.tensor(stream, dtype=torch.int64)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
