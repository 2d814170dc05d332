"""What ``europa.core.process_exit.exit_now`` saves: the seconds from the end of a process's
work to the end of the process, for a process that has imported what a worker of
``europa train`` imports (torch, torchtitan, europa's trainer), leaving by ``sys.exit`` (the
interpreter's teardown) and by ``exit_now``, alternately, in fresh processes. A
``europa train --nproc 2`` has three such processes: the two workers end side by side, the
launcher after them.

    python benchmarks/process_exit.py [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

WORK = "import europa.core.train.loop, europa.core.launch.worker, time, sys\n"
LEAVE = {
    "sys_exit": "print(time.time(), flush=True)\nsys.exit(0)\n",
    "exit_now": "from europa.core.process_exit import exit_now\n"
    "print(time.time(), flush=True)\nexit_now(0)\n",
}


def teardown_s(way: str) -> float:
    process = subprocess.run(
        [sys.executable, "-c", WORK + LEAVE[way]], capture_output=True, text=True, check=True
    )
    ended = time.time()
    return ended - float(process.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {way: [] for way in LEAVE}
    for _ in range(args.trials):
        for way in LEAVE:
            samples[way].append(teardown_s(way))
    median = {way: statistics.median(s) for way, s in samples.items()}
    print(json.dumps({
        "benchmark": "process_exit",
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "trials": args.trials,
        "teardown_s": {way: [round(s, 3) for s in ss] for way, ss in samples.items()},
        "median_teardown_s": median,
        "saved_s_per_process": median["sys_exit"] - median["exit_now"],
        "exit_now_over_sys_exit": median["exit_now"] / median["sys_exit"],
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
