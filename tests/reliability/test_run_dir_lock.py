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

import pytest

from europa.core.launch.lock import RunDirLock
from europa.core.run_dir import LOCK_FILE

STEPS = 40
TRAIN = [sys.executable, "-m", "europa.cli", "train", "tiny", "--set", "metrics.progress=false"]


def _records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.distributed
def test_a_second_training_into_a_live_run_directory_is_refused_and_the_first_goes_on(tmp_path):
    run_dir = tmp_path / "live"
    first = subprocess.Popen(
        [*TRAIN, "--run-dir", str(run_dir), "--set", f"training.steps={STEPS}",
         "--set", "checkpoint.every=10"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
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
    finally:
        if first.poll() is None:
            first.kill()
    assert [r["step"] for r in _records(run_dir)] == list(range(1, STEPS + 1))
    assert (run_dir / "summary.json").is_file()


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
