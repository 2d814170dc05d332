"""Training sequences read from a prepared corpus: windows of seq_len + 1 tokens packed over its
token stream, or over a selection of its documents (the training or the held-out part).

A selection is a list of segments, runs of consecutive documents as (stream start, length);
the selection's own stream is their concatenation and window i is its tokens
[i (L + 1), (i + 1)(L + 1)), exactly as ``PackedSequences`` cuts the in-memory stream. Reading a
window costs a binary search in the segments and a copy from the memory-mapped shards.
"""

from __future__ import annotations

import numpy as np
import torch

from europa.core.data.documents import DataError
from europa.core.data.shards import PreparedCorpus


class TokenWindows:
    def __init__(
        self,
        corpus: PreparedCorpus,
        seq_len: int,
        segments: np.ndarray | None = None,
        key: str = "data.path",
    ) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(f"training.seq_len = {seq_len!r}: expected a positive integer")
        if segments is None:
            segments = np.array([[0, corpus.num_tokens]], dtype=np.int64)
        self.corpus, self.seq_len, self.segments = corpus, seq_len, segments
        self.ends = np.cumsum(segments[:, 1], dtype=np.int64)  # selection offset after segment j
        self.num_tokens = int(self.ends[-1]) if len(self.ends) else 0
        window = seq_len + 1
        self._count = self.num_tokens // window
        if self._count == 0:
            raise DataError(
                f"{key} / training.seq_len = {seq_len}: the text has {self.num_tokens} tokens "
                f"(EOS included) but one sequence needs seq_len + 1 = {window}; "
                "expected more text or a smaller training.seq_len"
            )

    @property
    def num_sequences(self) -> int:
        return self._count

    def __len__(self) -> int:
        return self._count

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the selection's stream, as int64."""
        out = np.empty(length, dtype=np.int64)
        segment = int(np.searchsorted(self.ends, start, side="right"))
        filled = 0
        while filled < length:
            seg_start, seg_length = (int(v) for v in self.segments[segment])
            offset = start + filled - (int(self.ends[segment]) - seg_length)
            take = min(length - filled, seg_length - offset)
            out[filled : filled + take] = self.corpus.read(seg_start + offset, take)
            filled += take
            segment += 1
        return out

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        window = self.seq_len + 1
        rows = np.stack([self.read(int(i) * window, window) for i in indices.tolist()])
        return torch.from_numpy(rows)
