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

from europa.cli.app import run
from europa.core.checkpoint.store import complete_checkpoints
from europa.core.launch.lock import RunDirLock
from europa.core.launch.progress import read_progress
from europa.core.run_dir import LOCK_FILE
from tests.conftest import EuropaProcess

from .conftest import europa_env

STEPS = 6
QUIET = ["--set", "metrics.progress=false"]
TRAIN = ["train", "tiny", *QUIET]  # started as python -m europa.cli (EuropaProcess)


def _records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.distributed
def test_a_second_training_into_a_live_run_directory_is_refused_and_the_first_goes_on(
    tmp_path, fault_plugin_dir, capsys
):
    """The first training is held inside its save of step 3 (the fault plugin waits there
    for a file) while the second ones are refused, so it is live whatever the machine's
    speed; released, it trains its last steps as the same training alone does."""
    run_dir, alone = tmp_path / "live", tmp_path / "alone"
    env = europa_env(fault_plugin_dir)
    same = ["-p", "faults", "--set", f"training.steps={STEPS}", "--set", "checkpoint.every=3"]
    held = ["--set", "faults.hold_saves=true"]
    first = EuropaProcess(
        [*TRAIN, "--run-dir", str(run_dir), *same, *held], env, stderr=tmp_path / "first.err"
    )
    # the same training in a directory of its own, beside it: what undisturbed looks like
    reference = EuropaProcess(
        [*TRAIN, "--run-dir", str(alone), *same], env, stderr=tmp_path / "reference.err"
    )
    try:
        deadline = time.monotonic() + 120
        while not any(run_dir.glob("holding-save-rank-*")):
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline, "the first training reached no save"
            time.sleep(0.1)
        assert _records(run_dir), "the first training logged no step"
        holder = f"pid {first.pid} on host {socket.gethostname()}"
        for extra in (["--resume"], []):  # continuing it, or starting over in it
            capsys.readouterr()
            assert run(["train", "tiny", "--run-dir", str(run_dir), *QUIET, *extra]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "Traceback" not in err, err
            assert "a training is using it" in err and holder in err
            assert first.poll() is None, "the first training stopped"
        (run_dir / "release").touch()
        assert first.wait(timeout=300) == 0, first.communicate()[1]
        assert reference.wait(timeout=300) == 0
    finally:
        if run_dir.is_dir():
            (run_dir / "release").touch()
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
    long_run = ["--set", "training.steps=100000", "--set", "checkpoint.every=3"]
    first = EuropaProcess(
        [*TRAIN, "--run-dir", str(run_dir), *long_run], stderr=tmp_path / "first.err"
    )
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
    resume = ["train", "tiny", "--resume", "--run-dir", str(run_dir), *QUIET]
    assert run([*resume, "--set", f"training.steps={newest + 2}"]) == 0
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
