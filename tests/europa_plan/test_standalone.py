"""europa-plan used alone: installed into an environment that has nothing else (no torch,
no other europa package), it plans a run from a TOML file through its command, and
planning never imports torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.europa_plan.runs_toml import valid_tables, write_runs
from tests.installs import PACKAGES


def test_installed_alone_it_plans_a_run_from_a_toml(tmp_path):
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    source = tmp_path / "europa-plan"  # pip builds in the source tree: keep ours clean
    shutil.copytree(
        PACKAGES / "europa-plan", source, ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    # the wheel is built here (this environment has setuptools), then installed there alone
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(source)],
        check=True,
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install",
         "--quiet", "--no-deps", "--no-index", *map(str, wheels.glob("*.whl"))],
        check=True,
    )  # fmt: skip
    runs = write_runs(tmp_path / "runs.toml", **valid_tables())
    planned = subprocess.run(
        [env / "bin" / "europa-plan", runs, "--json"], capture_output=True, text=True
    )
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["runs"][0]["id"] == "small-run"
    alone = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is importable'\n"
        "assert importlib.util.find_spec('europa.core') is None\n"
        "from europa.plan.cli import main\n"
        f"assert main([{str(runs)!r}]) == 0\n"
    )
    result = subprocess.run([env / "bin" / "python", "-c", alone], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_planning_a_run_never_imports_torch():
    """In this environment torch is installed: planning must still not load it."""
    published = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.toml"
    code = (
        "import sys\n"
        "from europa.plan.cli import main\n"
        f"assert main([{str(published)!r}, '--json']) == 0\n"
        "banned = ('torch', 'europa.core', 'europa.spec')\n"
        "loaded = sorted(m for m in sys.modules if m.partition('.')[0] == 'torch'\n"
        "                or m.startswith(banned))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
