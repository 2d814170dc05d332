"""How long the ``europa`` command takes to answer and to train one step, this tree against
a git ref, in the same run: ``europa --help``, and ``europa train tiny --nproc 2`` of one
step (the launcher's checks, two workers, one step, the final checkpoint, the exit), each
timed from the command's start to its exit.

The two sources (this working tree, and ``--base`` exported with ``git archive`` and put
first on ``PYTHONPATH``, which the workers inherit) alternate trial by trial, so load from
other processes on the machine falls on both.

    python benchmarks/startup.py --base main --trials 3

prints JSON: per source and command the seconds of each trial and their median, and the
ratios this tree / base (below 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step_cost import export

COMMANDS = {
    "help": ["--help"],
    "train_one_step": ["train", "tiny", "--nproc", "2", "--set", "training.steps=1",
                       "--set", "metrics.progress=false"],
}  # fmt: skip


def timed(pythonpath: list[str], command: list[str], run_dir: Path | None) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    where = ["--run-dir", str(run_dir)] if run_dir else []
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "europa.cli", *command, *where], env=env,
                   check=True, capture_output=True)  # fmt: skip
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git ref to compare with")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    seconds: dict[str, dict[str, list[float]]] = {"tree": {}, "base": {}}
    with tempfile.TemporaryDirectory(prefix="startup-") as root:
        # the tree: the packages as installed (editable), as step_cost's head runs them
        sources = {"tree": [], "base": export(args.base, Path(root))}
        for trial in range(args.trials):
            for source, pythonpath in sources.items():
                for name, command in COMMANDS.items():
                    run_dir = Path(root) / f"{source}-{name}-{trial}" if name != "help" else None
                    took = timed(pythonpath, command, run_dir)
                    seconds[source].setdefault(name, []).append(round(took, 3))
    median = {s: {n: statistics.median(t) for n, t in by.items()} for s, by in seconds.items()}
    print(json.dumps({
        "benchmark": "startup",
        "base": args.base,
        "cpu_count": os.cpu_count(),
        "trials": args.trials,
        "seconds": seconds,
        "median_s": median,
        "tree_over_base": {n: median["tree"][n] / median["base"][n] for n in COMMANDS},
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
