"""Held-out validation documents, chosen by a stable hash of each document's text.

Document d is held out when its hash (8 bytes of blake2b, stored by ``europa data prepare``) is
below fraction × 2^64: the choice does not depend on the document's position, the files or their
order, and identical documents always fall on the same side. The result is two lists of segments
(runs of consecutive documents, see ``windows``), computed once in O(documents) and cached.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np

from europa.core.data.shards import PreparedCorpus, write_atomically


def threshold(fraction: float) -> np.uint64:
    return np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))


def split_segments(corpus: PreparedCorpus, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training segments, held-out segments), each [k, 2] int64 of (stream start, length)."""
    starts, ends, held = [], [], []
    limit = threshold(fraction)
    for index in range(len(corpus.shards)):
        offsets, hashes = corpus.document_index(index)
        base = int(corpus.starts[index])
        starts.append(base + np.asarray(offsets[:-1], dtype=np.int64))
        ends.append(base + np.asarray(offsets[1:], dtype=np.int64))
        held.append(np.asarray(hashes) < limit)
    start, end, out = (np.concatenate(parts) for parts in (starts, ends, held))
    return _runs(start, end, ~out), _runs(start, end, out)


def _runs(start: np.ndarray, end: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Merge the chosen documents into runs of consecutive ones."""
    index = np.flatnonzero(chosen)
    if index.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    first = index[np.concatenate([[0], breaks])]
    last = index[np.concatenate([breaks - 1, [index.size - 1]])]
    return np.stack([start[first], end[last] - start[first]], axis=1).astype(np.int64)


def cached_split(
    corpus: PreparedCorpus, fraction: float, cache: Path | None, build: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``split_segments``, read from ``cache`` when a rank has already written it there."""
    if cache is None:
        return split_segments(corpus, fraction)
    key = hashlib.sha256(f"{corpus.identity}/{fraction!r}".encode()).hexdigest()[:16]
    folder = cache / f"split-{key}"
    paths = folder / "train.npy", folder / "validation.npy"
    if all(path.is_file() for path in paths):
        return tuple(np.load(path, mmap_mode="r") for path in paths)  # type: ignore[return-value]
    segments = split_segments(corpus, fraction)
    if build:
        folder.mkdir(parents=True, exist_ok=True)
        for path, array in zip(paths, segments, strict=True):
            buffer = io.BytesIO()
            np.save(buffer, array)
            write_atomically(path, buffer.getvalue())
    return segments
