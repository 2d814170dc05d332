"""``europa checkpoint verify``: read every byte of a checkpoint and compare each file
with the size and crc32c its marker recorded when it was written, without training."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from europa.core.checkpoint.checksums import file_problem
from europa.core.checkpoint.marker import MARKER, UnreadableMarker, read_marker
from europa.core.checkpoint.reader import read_metadata
from europa.core.checkpoint.store import find_checkpoint
from europa.core.errors import CheckpointError


@dataclass(frozen=True)
class Verified:
    step: int
    path: Path
    files: int
    bytes: int
    seconds: float
    problem: str | None  # None: intact
    checksummed: bool  # False: a checkpoint from before checksums, checked by size


def verify_checkpoint(run_dir: Path, step: int | None = None, *, progress: bool = True) -> Verified:
    """Check checkpoint ``step`` of ``run_dir`` (None: the newest complete one)."""
    done, path = find_checkpoint(run_dir, step)
    started = time.perf_counter()
    try:
        marker = read_marker(path)
    except UnreadableMarker:
        return Verified(done, path, 0, 0, 0.0, f"its marker file {MARKER} is unreadable", False)
    total = sum(record.bytes or 0 for record in marker.files.values())
    checksummed = all(record.crc32c is not None for record in marker.files.values())
    problem = None
    with tqdm(total=total, unit="B", unit_scale=True, desc=path.name, disable=not progress) as bar:
        for name, record in sorted(marker.files.items()):
            problem = file_problem(path / name, record, bar.update)
            if problem is not None:
                break
    if problem is None:
        try:
            read_metadata(path)  # safe to load, too (its checksum was checked above)
        except CheckpointError as err:
            problem = str(err)
    return Verified(
        done, path, len(marker.files), total, time.perf_counter() - started, problem, checksummed
    )
