"""After a local worker failed: which rank died first, at which step, and what to type.

torch's elastic agent reports every worker that exited non-zero, with timestamps in
whole seconds, so it cannot tell the rank that died from the ranks that then lost
contact with it. Each rank's progress file can: a rank that lost contact says so.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from europa.core.checkpoint.store import latest_checkpoint
from europa.core.launch.progress import LOST_CONTACT, read_progress

WORKER_MODULE = "europa.core.launch.worker"


def _how(exit_code: int) -> str:
    if exit_code < 0:
        try:
            return f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"was killed by signal {-exit_code}"
    return f"exited with code {exit_code} (its error is printed above)"


def _where(record: dict | None) -> str:
    if record is None or record["phase"] == "starting":
        return "before its first step"
    if record["phase"] == "saving":
        return f"while saving the checkpoint of step {record['step']}"
    return f"at step {record['step']}"


def next_step(run_dir: Path) -> str:
    found = latest_checkpoint(run_dir)
    if found is None:
        return f"no checkpoint was saved: start again ({run_dir} keeps the logs)"
    return (
        f"the newest complete checkpoint is {found[1].name}; continue with: "
        f"europa train --resume --run-dir {run_dir}"
    )


def describe_failure(run_dir: Path, exit_codes: dict[int, int]) -> tuple[str, int]:
    """One line naming the rank that died first and the step, and its exit code (> 0)."""
    records = read_progress(run_dir)
    culprits = [
        rank for rank in sorted(exit_codes) if records.get(rank, {}).get("phase") != LOST_CONTACT
    ]
    # torch's agent stops the survivors of a failure with SIGTERM, sometimes before they
    # note the lost contact: a rank that ended any other way failed first.
    first_hand = [rank for rank in culprits if exit_codes[rank] != -signal.SIGTERM]
    rank = (first_hand or culprits or [min(exit_codes)])[0]
    code = exit_codes[rank]
    line = f"worker rank {rank} {_how(code)} {_where(records.get(rank))}; {next_step(run_dir)}"
    return line, code if code > 0 else 128 - code  # killed by signal N: 128 + N


def live_workers(run_dir: Path) -> list[int]:
    """The pids of this run directory's local workers still running (by their progress
    files, checked against each process's command line: a pid may have been reused)."""
    pids = []
    for record in read_progress(run_dir).values():
        pid = int(record["pid"])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()  # empty for a zombie
        except OSError:
            continue
        if WORKER_MODULE.encode() in cmdline and str(run_dir).encode() in cmdline:
            pids.append(pid)
    return pids


def kill_workers(run_dir: Path) -> None:
    """SIGKILL the live local workers (each leads a session and process group of its own)."""
    for pid in live_workers(run_dir):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
