"""A stop signal (SLURM's SIGTERM / SIGUSR1) ends a run after a step, with a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from europa.cli.app import run
from europa.core.checkpoint.store import complete_checkpoints
from europa.core.train.stop import StopRequest
from tests.conftest import EuropaProcess


def _agree_after_one_rank_is_signalled(rank, world):
    import torch

    with StopRequest() as stop:
        before = stop.agreed(torch.device("cpu"))
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        after = stop.agreed(torch.device("cpu"))
        return before, after, stop.signal_name


@pytest.mark.distributed
def test_every_rank_stops_when_any_rank_is_signalled(ranks):
    assert ranks(_agree_after_one_rank_is_signalled, 2) == [
        (False, True, None),
        (False, True, "SIGUSR1"),
    ]


def _records(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    quiet = ["--set", "metrics.progress=false"]
    command = ["train", "--nproc", "2", "--run-dir", str(run_dir), "--set", "training.steps=100000",
               *quiet]  # fmt: skip
    launcher = EuropaProcess(command, stderr=tmp_path / "launcher.err")  # python -m europa.cli
    deadline = time.monotonic() + 120
    while len(_records(run_dir)) < 3:
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)

    assert launcher.returncode == 0, err
    done = len(_records(run_dir))
    assert [step for step, _ in complete_checkpoints(run_dir)] == [done]
    assert f"stopped by SIGTERM after step {done} of 100000, checkpoint saved" in err

    # resumed in this process (no signal to send it): no interpreter to start
    resume = ["train", "--resume", "--run-dir", str(run_dir), "--set", f"training.steps={done + 2}"]
    assert run([*resume, *quiet]) == 0
    assert [r["step"] for r in _records(run_dir)] == list(range(1, done + 3))
