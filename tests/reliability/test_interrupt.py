"""Ctrl-C, as a terminal sends it (SIGINT to the launcher's process group): the first one
finishes the step, checkpoints and prints the resume command; a second one while that
happens stops every process at once, keeping the checkpoints there were."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from europa.core.train.checkpoint import complete_checkpoints
from europa.core.train.progress import read_progress

from .conftest import QUIET, europa_command, europa_env, last_line, records


def _wait_for(condition, launcher, seconds=120):
    deadline = time.monotonic() + seconds
    while not condition():
        assert launcher.poll() is None, launcher.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _ctrl_c(launcher):
    os.killpg(launcher.pid, signal.SIGINT)


def _start(env, *args):
    return subprocess.Popen(
        europa_command("train", *args, *QUIET),
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a job
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_first_ctrl_c_checkpoints_and_a_second_stops_at_once(tmp_path, fault_plugin_dir):
    env, run_dir = europa_env(fault_plugin_dir), tmp_path / "run"
    launcher = _start(env, "--nproc", "2", "-p", "faults", "--run-dir", str(run_dir),
                      "--set", "training.steps=100000")  # fmt: skip
    _wait_for(lambda: len(records(run_dir)) >= 2, launcher)
    _ctrl_c(launcher)
    _, err = launcher.communicate(timeout=120)
    done = len(records(run_dir))
    assert launcher.returncode == 0, err
    assert last_line(err) == (
        f"europa: stopped by SIGINT after step {done} of 100000, checkpoint saved; "
        f"continue with: europa train --resume --run-dir {run_dir}"
    )
    assert [step for step, _ in complete_checkpoints(run_dir)] == [done]

    launcher = _start(env, "--resume", "--run-dir", str(run_dir),
                      "--set", "faults.hold_saves=true")  # fmt: skip
    _wait_for(lambda: len(records(run_dir)) > done, launcher)
    _ctrl_c(launcher)
    _wait_for(lambda: any(run_dir.glob("holding-save-rank-*")), launcher)
    workers = [record["pid"] for record in read_progress(run_dir).values()]
    _ctrl_c(launcher)
    _, err = launcher.communicate(timeout=20)
    assert launcher.returncode == 130, err
    assert last_line(err) == (
        "europa: error: stopped at once by a second Ctrl-C (SIGINT); the newest complete "
        f"checkpoint is step-{done:08d}; continue with: europa train --resume --run-dir {run_dir}"
    )
    assert "Traceback" not in err
    assert [step for step, _ in complete_checkpoints(run_dir)] == [done]
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_in_one_process_a_second_ctrl_c_raises_keyboard_interrupt():
    from europa.core.train.stop import StopRequest

    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
