"""Per-step cost of one-rank training, this tree against a git ref, in the same run.

Each trial is a fresh process that builds the Trainer of ``--preset`` in-process
(one rank, as ``europa train --nproc 1`` runs it), takes ``--warmup`` steps, then
times ``--steps`` steps: wall time and this process's CPU time (user + system).
The two sources (this working tree, and ``--base`` exported with ``git archive``
and put first on ``PYTHONPATH``) alternate trial by trial, so load from other
processes on the machine falls on both. CPU seconds per step are the figure to
trust on a busy machine (wall time counts time spent waiting for a core); with
``--threads 1`` they are also free of the thread pool's spinning.

    python benchmarks/step_cost.py --base main --trials 3 --threads 1

prints JSON: per source the median step wall and CPU seconds and tokens/s over its
trials, the ratios this tree / base (below 1: cheaper), and the largest relative
difference of the two loss curves (same seed, data and steps: fp32 noise when the
tree keeps the numerics; ``--warmup 46 --steps 4`` compares 50 steps).

The same code repeated gives the same curve bit for bit, so ``--control-threads N`` adds
what fp32 noise is: one more trial of ``--base`` on N threads, whose matrix products and
reductions split their sums differently, and its curve's largest relative difference from
the base's (``control_loss_curve_max_rel_diff``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _one_rank import trial_env

REPO = Path(__file__).resolve().parents[1]

TRIAL = r"""
import json, resource, sys, time, warnings
import torch
torch.set_num_threads(int(sys.argv[1]))
warnings.filterwarnings("ignore")
from _one_rank import one_rank_trainer
preset, warmup, steps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
overrides = ["metrics.progress=false", f"training.steps={warmup + steps}", *sys.argv[5:]]
trainer = one_rank_trainer(preset, overrides)
losses = [trainer.step(step)["loss"] for step in range(warmup)]
wall, cpu = [], []
for step in range(warmup, warmup + steps):
    usage, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    record = trainer.step(step)
    after = resource.getrusage(resource.RUSAGE_SELF)
    wall.append(time.perf_counter() - started)
    cpu.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
    losses.append(record["loss"])
print(json.dumps({"wall": wall, "cpu": cpu, "tokens_per_step": trainer.batches.tokens_per_step,
                  "losses": losses}))
"""


def export(ref: str, into: Path) -> list[str]:
    """The package sources of ``ref``, as PYTHONPATH entries."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "packages"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return sorted(str(src) for src in into.glob("packages/*/src"))


def trial(pythonpath: list[str], args: argparse.Namespace, script: str = TRIAL, **env: str) -> dict:
    """One fresh process running ``script`` (``TRIAL`` or a variant of it), with ``env``
    added to its environment."""
    env = {**trial_env(args.threads, pythonpath), **env}
    command = [sys.executable, "-c", script, str(args.threads), args.preset]
    command += [str(args.warmup), str(args.steps), *args.set]
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(trials: list[dict]) -> dict:
    wall = statistics.median(t for trial in trials for t in trial["wall"])
    cpu = statistics.median(t for trial in trials for t in trial["cpu"])
    return {
        "step_wall_s": round(wall, 4),
        "step_cpu_s": round(cpu, 4),
        "tokens_per_s": round(trials[0]["tokens_per_step"] / wall, 1),
        "cpu_s_per_1k_tokens": round(cpu / trials[0]["tokens_per_step"] * 1000, 4),
        "trial_step_cpu_s": [round(statistics.median(t["cpu"]), 4) for t in trials],
    }


def loss_curve_difference(base: list[dict], head: list[dict]) -> float:
    """Largest relative difference between the two sources' losses at the same step."""
    return max(
        abs(h - b) / abs(b)
        for trial_b, trial_h in zip(base, head, strict=True)
        for b, h in zip(trial_b["losses"], trial_h["losses"], strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="git ref to compare against")
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE override")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--control-threads", type=int, help="also run the base on N threads")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_path = export(args.base, Path(tmp))
        results: dict[str, list[dict]] = {"base": [], "head": []}
        for _ in range(args.trials):
            results["base"].append(trial(base_path, args))
            results["head"].append(trial([], args))
        control = None
        if args.control_threads:
            control_args = argparse.Namespace(**{**vars(args), "threads": args.control_threads})
            control = trial(base_path, control_args)
    curves = {"base": results["base"][0]["losses"], "head": results["head"][0]["losses"]}
    noise = {}
    if control is not None:
        curves["control"] = control["losses"]
        noise = {
            "control_threads": args.control_threads,
            "control_loss_curve_max_rel_diff": loss_curve_difference(
                results["base"][:1], [control]
            ),
        }
    base, head = summary(results["base"]), summary(results["head"])
    print(
        json.dumps(
            {
                "preset": args.preset,
                "overrides": args.set,
                "threads": args.threads,
                "steps_timed_per_trial": args.steps,
                "trials": args.trials,
                "base_ref": args.base,
                "base": base,
                "head": head,
                "loss_curve_max_rel_diff": loss_curve_difference(results["base"], results["head"]),
                "loss_curves": curves,
                "steps_per_loss_curve": args.warmup + args.steps,
                **noise,
                "head_over_base": {
                    "step_cpu_s": round(head["step_cpu_s"] / base["step_cpu_s"], 4),
                    "step_wall_s": round(head["step_wall_s"] / base["step_wall_s"], 4),
                    "tokens_per_s": round(head["tokens_per_s"] / base["tokens_per_s"], 4),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
