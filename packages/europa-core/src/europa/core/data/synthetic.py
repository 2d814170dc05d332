"""A prepared corpus of random tokens, of any size, written without tokenising anything: for
benchmarks and memory tests of the read path at sizes where tokenising text would take hours."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from europa.core.data.shards import (
    shard_stem,
    token_dtype,
    write_atomically,
    write_manifest,
)

_BLOCK = 1 << 22  # tokens written per call


def write_synthetic_corpus(
    directory: str | os.PathLike[str],
    tokens: int,
    *,
    shard_tokens: int = 1 << 28,
    vocab_size: int = 2048,
    mean_document: int = 1000,
    seed: int = 0,
) -> dict:
    """About ``tokens`` random token ids (documents of random length, EOS = 0 after each) in
    shards of ``shard_tokens``; returns the manifest."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = token_dtype(vocab_size)
    block = rng.integers(1, vocab_size, size=_BLOCK, dtype=np.int64).astype(dtype)
    records = []
    for index, start in enumerate(range(0, tokens, shard_tokens)):
        size = min(shard_tokens, tokens - start)
        lengths = rng.integers(1, 2 * mean_document, size=size // mean_document + 2)
        ends = np.cumsum(lengths)
        ends = np.concatenate([ends[ends < size], [size]])
        offsets = np.concatenate([[0], ends]).astype(np.int64)
        stem = folder / shard_stem(index)
        with open(f"{stem}.bin.partial", "wb") as out:
            for at in range(0, size, _BLOCK):
                chunk = block[: min(_BLOCK, size - at)].copy()
                inside = ends[(ends > at) & (ends <= at + chunk.size)] - at - 1
                chunk[inside] = 0  # EOS closes each document
                chunk.tofile(out)
        hashes = rng.integers(0, 2**63, size=offsets.size - 1, dtype=np.int64).astype(np.uint64)
        for name, array in (("idx", offsets), ("hash", hashes)):
            with open(f"{stem}.{name}.npy.partial", "wb") as out:
                np.save(out, array)
            os.replace(f"{stem}.{name}.npy.partial", f"{stem}.{name}.npy")
        os.replace(f"{stem}.bin.partial", f"{stem}.bin")
        record = {"source": "synthetic", "documents": int(offsets.size - 1), "tokens": size}
        write_atomically(Path(f"{stem}.json"), json.dumps(record).encode())
        records.append(record)
    return write_manifest(
        folder, records, tokenizer_sha256="synthetic", vocab_size=vocab_size, eos_id=0
    )
