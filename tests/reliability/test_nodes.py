"""Several nodes (two launchers on this machine joined by a c10d rendezvous), and an
elastic restart that resumes from the last checkpoint by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from europa.cli.app import run
from europa.core.launch.distributed import free_port
from tests.conftest import EuropaProcess

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TINY = ["--set", "training.seq_len=32", "--set", "training.batch_size=2"]
QUIET = ["--set", "metrics.progress=false"]


def _steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


class Started:
    """A command running in the background, its output in a file (a pipe nobody reads
    would fill and stop it). ``python -m europa.cli ARGS`` is forked from the fork server
    that has imported what it needs (``EuropaProcess``); anything else is a new process."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.log = log
        if command[:3] == [sys.executable, "-m", "europa.cli"]:
            self.process = EuropaProcess(command[3:], stderr=log)  # stdout: log + ".out"
            return
        with log.open("w") as output:
            self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        code = self.process.wait(timeout=timeout)
        return code, self.log.read_text()[-4000:]


def _start(command: list[str], log: Path, node: int = 0) -> Started:
    """``command`` in the background, with ``NODE`` replaced by ``node``."""
    return Started([str(node) if arg == "NODE" else arg for arg in command], log)


def test_two_launchers_train_together_and_torchrun_nodes_continue(tmp_path):
    run_dir = tmp_path / "run"
    train = [
        "train", "--run-dir", str(run_dir), "--nproc", "1", "--nnodes", "2",
        "--node-rank", "NODE", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--set", "training.steps=2", *TINY, *QUIET,
    ]  # fmt: skip
    node_1 = _start([sys.executable, "-m", "europa.cli", *train], tmp_path / "node-1.log", 1)
    assert run([str(0) if arg == "NODE" else arg for arg in train]) == 0  # node 0, here
    code, output = node_1.finish()
    assert code == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (2, 2)
    assert json.loads((run_dir / "job.json").read_text())["mesh"]["dp_shard"] == 2

    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "NODE",
        "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "continued",
        "-m", "europa.cli", "train", "--run-dir", str(run_dir), "--resume",
        "--set", "training.steps=4", *QUIET,
    ]  # fmt: skip
    nodes = [_start(torchrun, tmp_path / f"torchrun-{node}.log", node) for node in (1, 0)]
    for node in nodes:
        code, output = node.finish()
        assert code == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["resumed_from"], summary["steps"]) == (2, 2, 4)
    assert _steps(run_dir) == [1, 2, 3, 4]


def _workers(launcher: subprocess.Popen) -> dict[int, int]:
    """The launcher's worker processes: pid by LOCAL_RANK (Linux)."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    found = {}
    for pid in map(int, children):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        for entry in environ:
            if entry.startswith(b"LOCAL_RANK="):
                found[int(entry.split(b"=", 1)[1])] = pid
    return found


def test_a_killed_worker_group_restarts_and_resumes_by_itself(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "europa.cli", "train", "--run-dir", str(run_dir), "--nproc", "2",
        "--max-restarts", "1", "--set", "training.steps=8", "--set", "checkpoint.every=2",
        *TINY, *QUIET,
    ]  # fmt: skip
    launcher = _start(command, tmp_path / "launcher.log")
    first_checkpoint = run_dir / "checkpoints" / "step-00000002"
    deadline = time.monotonic() + 120
    while not first_checkpoint.is_dir() and launcher.process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.05)
    os.kill(_workers(launcher.process)[1], signal.SIGKILL)
    code, output = launcher.finish()
    assert code == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8
    assert 2 <= summary["resumed_from"] < 8  # the restarted group resumed, not started over
    assert _steps(run_dir) == list(range(1, 9))


def test_a_node_that_never_comes_is_one_line_and_the_command_can_be_retried(tmp_path, capsys):
    run_dir, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    alone = [
        "train", "--run-dir", str(run_dir), "--nproc", "1", "--nnodes", "2", "--node-rank", "0",
        "--rdzv-endpoint", endpoint, "--rdzv-timeout", "1", *TINY, *QUIET,
    ]  # fmt: skip
    assert run(alone) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"europa: error: --rdzv-endpoint = {endpoint!r}: not every one of the 2 nodes joined "
        "within 1 s; expected `europa train` on each node with the same --nnodes, "
        "--rdzv-endpoint and --run-dir"
    ]
    assert not (run_dir / "config.toml").exists()  # so the same command can run again
