"""Where each rank is, in a small file of its own: ``progress/rank-N.json`` in the run
directory holds the rank's pid, the step it is computing (1-based, as in
``metrics.jsonl``) and its phase. Written without a collective, so it is still right
after the rank died; the launcher reads it to say which rank died at which step.

Phases: ``starting``, ``step`` (computing ``step``), ``saving`` (writing the checkpoint
of ``step``), ``lost-contact`` (a collective failed here: another rank died or hung),
``failed`` (an exception on this rank), ``finished``. ``lost-contact`` is final: the
writer of a background checkpoint may be first to see another rank die, and the
training thread's next mark must not hide it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from europa.core.run_dir import PROGRESS, progress_file, write_replacing

LOST_CONTACT = "lost-contact"


class RankProgress:
    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = progress_file(Path(run_dir), rank)
        self.rank = rank
        self.step = 0
        self.phase = "starting"
        self._lock = threading.Lock()  # the training thread and a checkpoint writer mark

    def mark(self, phase: str, step: int | None = None) -> None:
        """Record ``phase`` (at ``step``, or the step last recorded); an atomic replace."""
        with self._lock:
            if self.phase == LOST_CONTACT:
                return
            self.phase = phase
            self.step = self.step if step is None else step
            record = {"rank": self.rank, "pid": os.getpid(), "step": self.step, "phase": phase}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_replacing(self.path, json.dumps(record) + "\n")


def read_progress(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's last record, by rank."""
    found = {}
    for path in sorted((run_dir / PROGRESS).glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # removed meanwhile (a new attempt starting), or not a record
        found[int(record["rank"])] = record
    return found
