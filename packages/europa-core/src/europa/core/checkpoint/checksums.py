"""crc32c of every checkpoint byte, computed as it is written and checked as it is read.

Writing: ``ChecksummingWriter`` is DCP's file system writer whose streams checksum
the bytes on their way to the file (no second read). DCP writes each piece of a file
(one tensor shard, or one pickled value) between two ``tell()`` calls, which are where
a stream closes one piece's checksum and opens the next; every rank's pieces travel
with DCP's own write results to rank 0, which records them in the marker with each
file's size and whole-file checksum.

Reading: a rank checks each piece it reads (``check_piece``); ``verify_checkpoint``
reads every file whole, for ``europa checkpoint verify``.

crc32c (the ``crc32c`` package, hardware-accelerated, releases the GIL) runs at about
10 GB/s on one core, well above a file system's share per rank.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from europa.core.checkpoint.marker import FileRecord, Piece
from europa.core.errors import DamagedCheckpoint

_READ_CHUNK = 16 << 20


def checksum(data: Any, value: int = 0) -> int:
    return crc32c.crc32c(data, value)


class _Pace:
    """Holds a writer to ``bytes_per_s`` overall (0: no limit), sleeping after writes."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.started: float | None = None
        self.written = 0

    def wrote(self, count: int) -> None:
        if self.bytes_per_s <= 0:
            return
        now = time.perf_counter()
        if self.started is None:
            self.started = now
        self.written += count
        ahead = self.written / self.bytes_per_s - (now - self.started)
        if ahead > 0:
            time.sleep(ahead)


@dataclass(frozen=True)
class _Written:
    bytes: int
    crc32c: int
    pieces: dict[int, tuple[int, int]]  # offset -> (length, crc32c)


class _ChecksummingStream(io.RawIOBase):
    def __init__(self, raw: Any, pace: _Pace) -> None:
        self.raw = raw
        self.pace = pace
        self.position = 0
        self.crc = 0
        self.piece_start = 0
        self.piece_crc = 0
        self.pieces: dict[int, tuple[int, int]] = {}

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        if written != len(view):
            raise OSError(f"short write to a checkpoint file ({written} of {len(view)} bytes)")
        self.crc = checksum(view, self.crc)
        self.piece_crc = checksum(view, self.piece_crc)
        self.position += written
        self.pace.wrote(written)
        return written

    def tell(self) -> int:
        self._close_piece()
        return self.position

    def _close_piece(self) -> None:
        if self.position > self.piece_start:
            self.pieces[self.piece_start] = (self.position - self.piece_start, self.piece_crc)
        self.piece_start, self.piece_crc = self.position, 0

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self._close_piece()
            super().close()
            self.raw.close()

    def summary(self) -> _Written:
        return _Written(self.position, self.crc, dict(self.pieces))


class _ChecksummingFileSystem(FileSystem):
    """DCP's file system whose written files are checksummed, by file name."""

    def __init__(self, pace: _Pace) -> None:
        super().__init__()
        self.pace = pace
        self.written: dict[str, _Written] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _ChecksummingStream(raw, self.pace)
            yield stream
            stream.close()
        with self._lock:
            self.written[Path(path).name] = stream.summary()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.written:
                self.written[Path(new_path).name] = self.written.pop(Path(path).name)


@dataclass(frozen=True)
class _CheckedStorage:
    """A write result's storage info with its piece's and file's checksums, on its way
    from the rank that wrote it to rank 0's ``finish``."""

    info: Any  # DCP's _StorageInfo
    crc32c: int
    file: FileRecord


class ChecksummingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that checksums what it writes (see the module note).
    After ``dcp.save`` returns on rank 0, ``files`` and ``pieces`` hold every rank's."""

    def __init__(self, path: str | os.PathLike, *, max_bytes_per_s: float = 0) -> None:
        super().__init__(path)
        self.fs = _ChecksummingFileSystem(_Pace(max_bytes_per_s))
        self.files: dict[str, FileRecord] = {}
        self.pieces: dict[str, list[Piece]] = {}

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        checked: Future[list[WriteResult]] = Future()
        checked.set_result([self._checked(result) for result in results])
        return checked

    def _checked(self, result: WriteResult) -> WriteResult:
        info = result.storage_data
        written = self.fs.written[info.relative_path]
        if info.length == 0:
            crc = 0
        else:
            length, crc = written.pieces.get(info.offset, (None, None))
            if length != info.length:
                raise RuntimeError(
                    f"checkpoint writer: the piece of {info.relative_path} at byte "
                    f"{info.offset} was not written between two tell() calls; expected "
                    "torch.distributed.checkpoint to mark each piece's bounds"
                )
        storage = _CheckedStorage(info, crc, FileRecord(written.bytes, written.crc32c))
        return WriteResult(result.index, result.size_in_bytes, storage)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        plain = []
        for rank_results in results:
            plain.append([self._recorded(result) for result in rank_results])
        super().finish(metadata, plain)
        written = self.fs.written[".metadata"]
        self.files[".metadata"] = FileRecord(written.bytes, written.crc32c)

    def _recorded(self, result: WriteResult) -> WriteResult:
        storage: _CheckedStorage = result.storage_data
        name = storage.info.relative_path
        self.files[name] = storage.file
        self.pieces.setdefault(name, []).append(
            Piece(storage.info.offset, storage.info.length, storage.crc32c)
        )
        return WriteResult(result.index, result.size_in_bytes, storage.info)


def damaged_piece(
    file: Path, offset: int, length: int, found: int, saved: int
) -> DamagedCheckpoint:
    return DamagedCheckpoint(
        str(file),
        f"bytes {offset}..{offset + length} read with crc32c {found:#010x}, "
        f"{saved:#010x} when saved",
    )


def check_piece(file: Path, offset: int, data: bytes, piece: Piece) -> None:
    found = checksum(data)
    if len(data) != piece.length or found != piece.crc32c:
        raise damaged_piece(file, offset, piece.length, found, piece.crc32c)


def file_problem(
    file: Path,
    record: FileRecord,
    on_bytes: Callable[[int], None] = lambda n: None,
    *,
    read: bool = True,
) -> str | None:
    """Compare ``file`` with its record, by size, then (``read``) by reading it whole for
    its checksum; what is wrong, or None."""
    if not file.is_file():
        return f"its file {file.name} is missing"
    size = file.stat().st_size
    if record.bytes is not None and size != record.bytes:
        return f"its file {file.name} has {size} bytes, {record.bytes} when saved"
    if not read or record.crc32c is None:
        return None
    crc = 0
    with file.open("rb") as stream:
        while chunk := stream.read(_READ_CHUNK):
            crc = checksum(chunk, crc)
            on_bytes(len(chunk))
    if crc != record.crc32c:
        return f"its file {file.name} has crc32c {crc:#010x}, {record.crc32c:#010x} when saved"
    return None
