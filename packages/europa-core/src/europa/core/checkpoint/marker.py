"""The marker file that completes a checkpoint, and what it records.

Rank 0 writes ``europa-checkpoint.json`` once every rank's files are written, just
before the rename that makes the checkpoint complete. It records, beside the step and
the trainer's own checks (the global batch):

- ``files``: each file's size and crc32c, ``{"bytes": n, "crc32c": c}``;
- ``items``: each file's pieces as DCP indexes them, ``[[offset, length, crc32c], ...]``:
  a rank reading under resharding reads pieces of a file, not whole files, so each
  piece carries its own checksum to be checked as it is read.

Markers written before checksums recorded only ``{name: size}`` (or nothing, before
sizes); those files are checked by size alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "europa-checkpoint.json"


@dataclass(frozen=True)
class FileRecord:
    bytes: int | None  # None: not recorded (the oldest markers)
    crc32c: int | None = None


@dataclass(frozen=True)
class Piece:
    offset: int
    length: int
    crc32c: int


class UnreadableMarker(Exception):
    pass


@dataclass(frozen=True)
class Marker:
    files: dict[str, FileRecord]
    pieces: dict[str, tuple[Piece, ...]]
    fields: dict[str, Any]  # everything else the marker holds (the trainer's checks)

    def pieces_by_offset(self) -> dict[tuple[str, int], Piece]:
        return {(name, p.offset): p for name, pieces in self.pieces.items() for p in pieces}


def write_marker(
    checkpoint: Path,
    step: int,
    files: dict[str, FileRecord],
    pieces: dict[str, list[Piece]],
    record: dict[str, Any] | None = None,
) -> None:
    content = {
        "step": step,
        "files": {
            name: {"bytes": f.bytes, "crc32c": f.crc32c} for name, f in sorted(files.items())
        },
        "items": {
            name: [[p.offset, p.length, p.crc32c] for p in sorted(found, key=_by_offset)]
            for name, found in sorted(pieces.items())
        },
        **(record or {}),
    }
    (checkpoint / MARKER).write_text(json.dumps(content) + "\n")


def _by_offset(piece: Piece) -> int:
    return piece.offset


def read_marker(checkpoint: Path) -> Marker:
    """The marker of a complete checkpoint; UnreadableMarker when it cannot be parsed."""
    try:
        content = json.loads((checkpoint / MARKER).read_text())
        files = _files(content.get("files"))
        pieces = {
            name: tuple(Piece(int(o), int(n), int(c)) for o, n, c in found)
            for name, found in (content.get("items") or {}).items()
        }
    except (OSError, ValueError, AttributeError, TypeError) as err:
        raise UnreadableMarker(str(err)) from None
    fields = {k: v for k, v in content.items() if k not in ("step", "files", "items")}
    return Marker(files, pieces, fields)


def _files(recorded: Any) -> dict[str, FileRecord]:
    if recorded is None:  # written before the marker recorded sizes
        return {".metadata": FileRecord(None)}
    files = {}
    for name, entry in recorded.items():
        if isinstance(entry, dict):
            files[name] = FileRecord(int(entry["bytes"]), _optional_int(entry.get("crc32c")))
        else:
            files[name] = FileRecord(None if entry is None else int(entry))
    return files


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
