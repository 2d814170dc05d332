"""One training per run directory: a second ``europa train`` (fresh or ``--resume``) into a
directory a live training uses is refused in one line naming that training's host and pid,
and the first goes on undisturbed; a holder that dies leaves no stale lock."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from europa.core.checkpoint.store import complete_checkpoints
from europa.core.launch.lock import RunDirLock
from europa.core.launch.progress import read_progress
from europa.core.run_dir import LOCK_FILE

STEPS = 40
TRAIN = [sys.executable, "-m", "europa.cli", "train", "tiny", "--set", "metrics.progress=false"]


def _records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.distributed
def test_a_second_training_into_a_live_run_directory_is_refused_and_the_first_goes_on(tmp_path):
    run_dir, alone = tmp_path / "live", tmp_path / "alone"
    run = ["--set", f"training.steps={STEPS}", "--set", "checkpoint.every=10"]
    first = subprocess.Popen(
        [*TRAIN, "--run-dir", str(run_dir), *run],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # the same training in a directory of its own, beside it: what undisturbed looks like
    reference = subprocess.Popen(
        [*TRAIN, "--run-dir", str(alone), *run],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not _records(run_dir):
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first training logged no step"
            time.sleep(0.2)
        holder = f"pid {first.pid} on host {socket.gethostname()}"
        for extra in (["--resume"], []):  # continuing it, or starting over in it
            second = subprocess.run([*TRAIN, "--run-dir", str(run_dir), *extra],
                                    capture_output=True, text=True, timeout=120)  # fmt: skip
            assert second.returncode == 2, second.stderr
            assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
            assert "a training is using it" in second.stderr and holder in second.stderr
            assert first.poll() is None, "the first training stopped"
        assert first.wait(timeout=300) == 0, first.stderr.read()
        assert reference.wait(timeout=300) == 0
    finally:
        for process in (first, reference):
            if process.poll() is None:
                process.kill()
    assert [r["step"] for r in _records(run_dir)] == list(range(1, STEPS + 1))
    assert (run_dir / "summary.json").is_file()
    assert [r["loss"] for r in _records(run_dir)] == [r["loss"] for r in _records(alone)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.distributed
def test_a_training_killed_with_sigkill_can_be_resumed_at_once(tmp_path):
    """The launcher holds the lock; killed, its workers follow it (they would otherwise
    train on as orphans in the directory the resume takes), and --resume needs nothing."""
    run_dir = tmp_path / "killed"
    first = subprocess.Popen([*TRAIN, "--run-dir", str(run_dir), "--set", "training.steps=100000",
                              "--set", "checkpoint.every=3"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(_records(run_dir)) < 4:
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        workers = [record["pid"] for record in read_progress(run_dir).values()]
    finally:
        first.kill()
        first.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "the workers outlived their launcher"
        time.sleep(0.1)
    newest = complete_checkpoints(run_dir)[-1][0]
    resumed = subprocess.run([*TRAIN, "--resume", "--run-dir", str(run_dir),
                              "--set", f"training.steps={newest + 2}"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in _records(run_dir)] == list(range(1, newest + 3))


def test_a_holder_that_dies_leaves_no_stale_lock(tmp_path):
    run_dir = tmp_path / "crashed"
    holding = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from europa.core.launch.lock import RunDirLock\n"
        f"RunDirLock.hold(Path({str(run_dir)!r}))\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", holding], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(Exception, match=f"pid {holder.pid} on host"):
        RunDirLock.hold(run_dir)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with RunDirLock.hold(run_dir) as lock:  # the kernel released it with the process
        assert f"pid {os.getpid()} on host" in (run_dir / LOCK_FILE).read_text()
        assert lock.created is None
