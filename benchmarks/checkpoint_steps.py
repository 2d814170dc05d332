"""Step time before and after a checkpoint save and load, one rank, in one process.

A run's steps should cost the same after it has saved or resumed a checkpoint. Each
trial is a fresh process that builds the ``--preset`` Trainer as ``europa train --nproc
1`` does (a one-rank gloo group, ``--threads`` threads), takes warm-up steps, times
``--steps`` steps, saves a checkpoint with ``europa.core.checkpoint.store`` and times
``--steps`` more, loads it back and times ``--steps`` more. Two variants alternate:

* ``alone``: as the trainer saves at one rank, DCP without collectives (``no_dist``);
* ``through_group``: DCP coordinating through the one-rank process group, as it did
  before: gloo copies DCP's plans on its own thread with an OpenMP team, and libgomp,
  managing more threads than CPUs, stops spinning between parallel regions.

    python benchmarks/checkpoint_steps.py [--preset debug] [--threads 2] [--trials 2]

prints JSON: per variant the median step seconds before, after the save and after the
load, the ratios after / before (1: no lasting cost), and the process's OS threads at
each point.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _one_rank import trial_env

TRIAL = r"""
import json, os, statistics, sys, time, warnings
import torch
torch.set_num_threads(int(sys.argv[1]))
warnings.filterwarnings("ignore")
from _one_rank import one_rank_trainer
from europa.core.checkpoint import store as checkpoint
preset, steps, variant = sys.argv[2], int(sys.argv[3]), sys.argv[4]
if variant == "through_group":
    checkpoint._alone = lambda: False
trainer = one_rank_trainer(preset, ["metrics.progress=false", "training.steps=1000"])
run_dir = trainer.job.run_dir
step = 0
def timed(n):
    global step
    times = []
    for _ in range(n):
        started = time.perf_counter()
        trainer.step(step)
        times.append(time.perf_counter() - started)
        step += 1
    return statistics.median(times)
def threads():
    return len(os.listdir("/proc/self/task"))
timed(2)
result = {"before": timed(steps), "threads_before": threads()}
path = checkpoint.save_checkpoint(run_dir, step, trainer.state, {"step": step})
result |= {"after_save": timed(steps), "threads_after_save": threads()}
checkpoint.load_checkpoint(path, trainer.state, {"step": 0})
result |= {"after_load": timed(steps), "threads_after_load": threads()}
print(json.dumps(result))
"""
VARIANTS = ("alone", "through_group")


def trial(variant: str, args: argparse.Namespace) -> dict:
    env = trial_env(args.threads)
    command = [sys.executable, "-c", TRIAL, str(args.threads), args.preset, str(args.steps)]
    done = subprocess.run([*command, variant], env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps in each window")
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.trials):
        for variant in VARIANTS:
            results[variant].append(trial(variant, args))
    report = {}
    for variant, trials in results.items():
        median = {
            key: statistics.median(t[key] for t in trials)
            for key in ("before", "after_save", "after_load")
        }
        report[variant] = {
            "step_s": {key: round(value, 4) for key, value in median.items()},
            "after_save_over_before": round(median["after_save"] / median["before"], 3),
            "after_load_over_before": round(median["after_load"] / median["before"], 3),
            "os_threads": {
                key: [t[f"threads_{key}"] for t in trials]
                for key in ("before", "after_save", "after_load")
            },
        }
    print(
        json.dumps(
            {
                "preset": args.preset,
                "threads": args.threads,
                "steps_per_window": args.steps,
                "trials": args.trials,
                "cpu_count": os.cpu_count(),
                "variants": report,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
