"""A technique package installed into a fresh environment beside torch, pluggy and the
contract package (europa-spec) only."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
CONTRACT = "europa-spec"  # what every technique package depends on, and nothing else


def python_with_only(tmp_path: Path, distribution: str) -> Path:
    """A new environment with ``distribution`` and europa-spec installed, torch and
    pluggy importable from this one. This environment's site-packages is added as a plain
    path, so the editable-install hooks there (europa-core's among them) are not
    processed: europa-core is absent. The packages build with this environment's
    setuptools (no isolated build environment to set up: seconds a package)."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([python, "-c", purelib], text=True).strip())
    (site / "shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    sources = []
    for name in (CONTRACT, distribution):  # pip builds in the source tree: keep ours clean
        sources.append(tmp_path / name)
        shutil.copytree(
            PACKAGES / name, sources[-1], ignore=shutil.ignore_patterns("build", "*.egg-info")
        )
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-build-isolation", *map(str, sources)],
        check=True,
    )  # fmt: skip
    return python


def run_without_core(python: Path, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` there, first checking that europa-core cannot be imported, and
    after it that no europa.core module was loaded."""
    guarded = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('europa.core') is None, 'europa-core is importable'\n"
        f"{code}\n"
        "assert not any(m.startswith('europa.core') for m in sys.modules)\n"
    )
    return subprocess.run([python, "-c", guarded], capture_output=True, text=True)


def run_each_without_core(python: Path, codes: Sequence[str]) -> list[subprocess.CompletedProcess]:
    """``run_without_core`` for each of ``codes``, side by side: each is a one-core process
    that spends its first seconds importing torch (and torchtitan)."""
    with ThreadPoolExecutor(len(codes)) as pool:
        return list(pool.map(lambda code: run_without_core(python, code), codes))
