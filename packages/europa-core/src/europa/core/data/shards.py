"""Prepared corpora on disk: token shards, their document index, and the manifest.

Design note: the on-disk format (``FORMAT`` = 1). A prepared directory holds, for input file i
(the inputs in the order ``europa data prepare`` lists them):

  shard-NNNNN.bin        the file's documents as token ids, each document followed by EOS,
                         concatenated: raw little-endian uint16 when every id fits, else uint32
  shard-NNNNN.idx.npy    int64 [documents + 1]: where each document starts in the .bin, in tokens,
                         then the total; document d is tokens [idx[d], idx[d + 1]), EOS last
  shard-NNNNN.hash.npy   uint64 [documents]: a stable hash of each document's text (8 bytes of
                         blake2b), which decides the held-out validation documents
  shard-NNNNN.json       written last, so its presence means complete: counts, tokenizer, source
  tokenizer.json         the tokenizer the ids come from
  manifest.json          written when every shard is: format, tokenizer hash and vocabulary size,
                         dtype, EOS id, each shard's counts and source file, totals

Every file is written under a ``.partial`` name and renamed when complete, so a killed prepare
never leaves a shard that looks complete, and a restart keeps the shards it finds complete. The
token stream of a corpus is its shards' .bin files in order: the stream ``PackedSequences`` builds
from the same text in memory, so training sequence i is stream tokens [i (L + 1), (i + 1)(L + 1))
either way.

Reading: the document index is memory-mapped (``numpy.load(mmap_mode="r")``), but token windows
are read with ``os.pread`` of exactly their bytes. Mapping the .bin files (``numpy.memmap``) was
measured first: on this kernel (6.18, large page-cache folios) every page fault mapped a whole
folio, about 1 MB, into the process, so a rank's resident memory grew by about 1 MB per sequence
read and, over a long run, towards the size of the corpus. A positioned read copies only the
window; the page cache stays shared kernel memory that the system reclaims.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from europa.core.data.documents import DataError

FORMAT = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
_FLUSH_TOKENS = 1 << 20


def shard_stem(index: int) -> str:
    return f"shard-{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical serialisation (the same for a file and its copy)."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def document_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def write_atomically(path: Path, data: bytes) -> None:
    staged = path.with_name(path.name + ".partial")
    staged.write_bytes(data)
    staged.replace(path)


def _save_npy(path: Path, array: np.ndarray) -> None:
    staged = path.with_name(path.name + ".partial")
    with open(staged, "wb") as file:
        np.save(file, array)
    staged.replace(path)


class ShardWriter:
    """Appends documents (ids with EOS) to one shard; ``finish`` makes it complete."""

    def __init__(self, directory: Path, index: int, dtype: np.dtype) -> None:
        self.directory, self.stem, self.dtype = directory, shard_stem(index), np.dtype(dtype)
        self._bin_path = directory / f"{self.stem}.bin"
        self._staged = directory / f"{self.stem}.bin.partial"
        self._file = open(self._staged, "wb")  # noqa: SIM115 (closed in finish)
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self.offsets: list[int] = [0]
        self.hashes: list[int] = []

    @property
    def tokens(self) -> int:
        return self.offsets[-1]

    def add(self, ids: Sequence[int] | np.ndarray, text_hash: int) -> None:
        array = np.asarray(ids, dtype=self.dtype)
        self._pending.append(array)
        self._pending_tokens += array.size
        self.offsets.append(self.offsets[-1] + array.size)
        self.hashes.append(text_hash)
        if self._pending_tokens >= _FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._file.write(np.concatenate(self._pending).tobytes())
        self._pending, self._pending_tokens = [], 0

    def finish(self, record: dict) -> dict:
        """Write the index and hashes, then the .bin, then the completion record; returns it."""
        self._flush()
        self._file.close()
        _save_npy(self.directory / f"{self.stem}.idx.npy", np.array(self.offsets, dtype=np.int64))
        _save_npy(self.directory / f"{self.stem}.hash.npy", np.array(self.hashes, dtype=np.uint64))
        self._staged.replace(self._bin_path)
        record = {**record, "documents": len(self.hashes), "tokens": self.tokens}
        write_atomically(self.directory / f"{self.stem}.json", json.dumps(record).encode())
        return record

    def abandon(self) -> None:
        self._file.close()
        self._staged.unlink(missing_ok=True)


def write_manifest(
    directory: Path,
    records: list[dict],
    *,
    tokenizer_sha256: str,
    vocab_size: int,
    eos_id: int,
    text_field: str = "text",
) -> dict:
    """The manifest of complete shards ``records`` (shard i's record at i), written last."""
    manifest = {
        "format": FORMAT,
        "tokenizer_sha256": tokenizer_sha256,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "dtype": token_dtype(vocab_size).str,
        "text_field": text_field,
        "documents": sum(record["documents"] for record in records),
        "tokens": sum(record["tokens"] for record in records),
        "shards": [{"name": shard_stem(i), **record} for i, record in enumerate(records)],
    }
    write_atomically(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def completed_shard(directory: Path, index: int) -> dict | None:
    """The completion record of shard ``index``, or None when it is missing or unreadable."""
    path = directory / f"{shard_stem(index)}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_prepared(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MANIFEST).is_file()


@dataclass(frozen=True)
class Shard:
    bin_path: Path
    tokens: int
    documents: int


class PreparedCorpus:
    """A prepared directory, checked on opening against its manifest (cost: one stat per shard).

    ``read(start, length)`` returns stream tokens [start, start + length) as int64, reading only
    those bytes of the shards (see the note on reading above)."""

    def __init__(self, path: str | os.PathLike[str], key: str) -> None:
        self.path, self.key = Path(path), key
        where = f"{key} = '{path}'"
        try:
            manifest = json.loads((self.path / MANIFEST).read_text())
            if manifest.get("format") != FORMAT:
                raise DataError(
                    f"{where}: manifest format {manifest.get('format')!r}; expected {FORMAT} "
                    "(prepare the corpus again with this version of europa)"
                )
            self.dtype = np.dtype(manifest["dtype"])
            self.vocab_size = int(manifest["vocab_size"])
            self.tokenizer_sha256 = str(manifest["tokenizer_sha256"])
            shards = manifest["shards"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            if isinstance(error, DataError):
                raise
            raise DataError(
                f"{where}: unreadable {MANIFEST} ({type(error).__name__}: {error}); "
                "expected a directory written by `europa data prepare`"
            ) from error
        self.manifest = manifest
        self.shards = [
            Shard(self.path / f"{s['name']}.bin", int(s["tokens"]), int(s["documents"]))
            for s in shards
        ]
        for shard in self.shards:
            self._check(shard, where)
        self.starts = np.cumsum([0] + [shard.tokens for shard in self.shards], dtype=np.int64)
        self._descriptors: dict[int, int] = {}

    def _check(self, shard: Shard, where: str) -> None:
        expected = shard.tokens * self.dtype.itemsize
        try:
            found = shard.bin_path.stat().st_size
        except OSError:
            found = None
        if found != expected:
            shown = "missing" if found is None else f"{found} bytes"
            raise DataError(
                f"{where}: shard '{shard.bin_path.name}' is truncated or damaged ({shown}); "
                f"expected {expected} bytes as its manifest says (prepare the corpus again)"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    @property
    def num_documents(self) -> int:
        return sum(shard.documents for shard in self.shards)

    @cached_property
    def identity(self) -> str:
        """A hash of the manifest: what caches derived from this corpus are keyed by."""
        return hashlib.sha256((self.path / MANIFEST).read_bytes()).hexdigest()

    def _descriptor(self, index: int) -> int:
        descriptor = self._descriptors.get(index)
        if descriptor is None:
            descriptor = os.open(self.shards[index].bin_path, os.O_RDONLY)
            self._descriptors[index] = descriptor
        return descriptor

    def _read_shard(self, index: int, offset: int, count: int) -> np.ndarray:
        size = self.dtype.itemsize
        data = os.pread(self._descriptor(index), count * size, offset * size)
        if len(data) != count * size:
            raise DataError(
                f"{self.key} = '{self.path}': shard '{self.shards[index].bin_path.name}' ended "
                f"early; expected {self.shards[index].tokens} tokens (prepare the corpus again)"
            )
        return np.frombuffer(data, dtype=self.dtype)

    def read(self, start: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        filled = 0
        index = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            offset = start + filled - int(self.starts[index])
            take = min(length - filled, self.shards[index].tokens - offset)
            if take > 0:
                out[filled : filled + take] = self._read_shard(index, offset, take)
                filled += take
            index += 1
        return out

    def close(self) -> None:
        for descriptor in getattr(self, "_descriptors", {}).values():
            os.close(descriptor)
        getattr(self, "_descriptors", {}).clear()

    def __del__(self) -> None:
        self.close()

    def document_index(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets [documents + 1], hashes [documents]) of shard ``index``, memory-mapped."""
        stem = self.shards[index].bin_path.with_suffix("")
        offsets = np.load(f"{stem}.idx.npy", mmap_mode="r")
        hashes = np.load(f"{stem}.hash.npy", mmap_mode="r")
        return offsets, hashes
