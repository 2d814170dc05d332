"""The fault-injecting plugin, installed for these tests only, and helpers to run
``europa`` as a user would."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import EuropaProcess

HERE = Path(__file__).parent
QUIET = ["--set", "metrics.progress=false"]


@pytest.fixture(scope="session")
def fault_plugin_dir(tmp_path_factory) -> Path:
    """A folder that, on the path, installs ``fault_plugin`` as europa plugin ``faults``."""
    root = tmp_path_factory.mktemp("fault-plugin")
    shutil.copy(HERE / "fault_plugin.py", root / "europa_test_faults.py")
    info = root / "europa_test_faults-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: europa-test-faults\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[europa]\nfaults = europa_test_faults\n")
    return root


@pytest.fixture
def on_path(fault_plugin_dir):
    """The plugin importable here and in processes spawned from here."""
    sys.path.insert(0, str(fault_plugin_dir))
    yield fault_plugin_dir
    sys.path.remove(str(fault_plugin_dir))


@pytest.fixture
def faults_here(on_path, monkeypatch) -> Path:
    """``europa train -p faults`` in the test process (``run_here``): the plugin importable
    here and in the workers the launcher starts."""
    monkeypatch.setenv("PYTHONPATH", europa_env(on_path)["PYTHONPATH"])
    return on_path


def europa_env(fault_plugin_dir: Path) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(fault_plugin_dir), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def europa_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "europa.cli", *args]


def run_europa(env, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        europa_command(*args), env=env, capture_output=True, text=True, timeout=timeout
    )


def run_here(capfd, *args: str) -> tuple[int, str]:
    """(exit code, stderr) of ``europa *args`` run in this process, as the console script
    runs it (``europa.cli.app.run``), without an interpreter's start and imports; the
    workers it launches write to the same file descriptor. For commands the test sends no
    signal to."""
    from europa.cli.app import run

    capfd.readouterr()
    code = run(list(args))
    return code, capfd.readouterr().err


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def start_training(env, *args: str) -> EuropaProcess:
    """``europa train`` in a process group of its own, as a shell starts a job (forked
    from the fork server, without a new interpreter's imports: ``EuropaProcess``)."""
    return EuropaProcess(["train", *args, *QUIET], env, stderr=log_file("train"))


def log_file(name: str) -> Path:
    """A new file for a started command's output, in a folder removed at exit."""
    if not _LOGS:
        _LOGS.append(Path(tempfile.mkdtemp(prefix="europa-test-logs-")))
        atexit.register(shutil.rmtree, _LOGS[0], ignore_errors=True)
    fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".err", dir=_LOGS[0])
    os.close(fd)
    return Path(path)


_LOGS: list[Path] = []


def ctrl_c(launcher: subprocess.Popen) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the foreground process group."""
    os.killpg(launcher.pid, signal.SIGINT)


def wait_for(condition, launcher: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert launcher.poll() is None, launcher.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.1)
