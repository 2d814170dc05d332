"""``torch.compile`` on parts of each transformer block against eager, one rank, same run.

The issue asks to try ``torch.compile`` per block and keep it only where it is
measured faster. Each trial is a fresh process that builds the ``--preset``
Trainer as ``benchmarks/step_cost.py`` does, compiles the chosen parts of every
block, takes ``--warmup`` steps (compilation happens there) and times ``--steps``:

* ``eager``: nothing compiled (the baseline);
* ``attention``: each block's attention module;
* ``dense``: attention, both norms, the router and the shared experts (or the
  dense feed-forward): everything but the routed experts;
* ``block``: the whole block, tried once: dynamo cannot trace the routed experts'
  fp32 ``torch._grouped_mm`` (its fake kernel accepts bf16 only), so this records
  the error instead of a time.

Variants alternate trial by trial, so machine noise falls on all of them.

    python benchmarks/compile.py [--preset debug] [--trials 3] [--threads 2]

prints JSON: per variant the median step wall and CPU seconds, the ratio of its step
wall to eager's (below 1: faster), the warm-up seconds (compile included) and the
largest relative loss difference from eager.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch
from step_cost import TRIAL, loss_curve_difference, summary, trial

VARIANTS = ("eager", "attention", "dense")
BUILT = "trainer = one_rank_trainer(preset, overrides)\n"
COMPILE = r"""
import os
variant = os.environ.get("EUROPA_BENCH_COMPILE", "eager")
for block in trainer.model.layers.values():
    if variant == "block":
        block.compile()
    if variant in ("attention", "dense"):
        block.attention.compile()
    if variant == "dense":
        block.attention_norm.compile()
        block.ffn_norm.compile()
        moe = getattr(block, "moe", None)
        for part in (moe.router, moe.shared_experts) if moe else (block.feed_forward,):
            part.compile()
warmup_started = time.perf_counter()
"""
TIMED = "wall, cpu = [], []\n"
WARMUP_SECONDS = "warmup_s = time.perf_counter() - warmup_started\nwall, cpu = [], []\n"
REPORT = '"losses": losses}'
SCRIPT = (
    TRIAL.replace(BUILT, BUILT + COMPILE)
    .replace(TIMED, WARMUP_SECONDS)
    .replace(REPORT, '"losses": losses, "warmup_s": warmup_s}')
)


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    return trial([], args, SCRIPT, EUROPA_BENCH_COMPILE=variant)


def whole_block_error(args: argparse.Namespace) -> str | None:
    """The first RuntimeError of one whole-block attempt (its root cause), or None when it
    trains."""
    try:
        run_variant("block", argparse.Namespace(**{**vars(args), "warmup": 1, "steps": 1}))
    except subprocess.CalledProcessError as failed:
        lines = [line for line in failed.stderr.splitlines() if "RuntimeError: " in line]
        return lines[0].split("RuntimeError: ", 1)[1][:300] if lines else failed.stderr[-300:]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE override")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.trials):
        for variant in VARIANTS:
            results[variant].append(run_variant(variant, args))
    eager = summary(results["eager"])
    report = {}
    for variant, trials in results.items():
        figures = summary(trials)
        report[variant] = {
            **figures,
            "step_wall_over_eager": round(figures["step_wall_s"] / eager["step_wall_s"], 4),
            "warmup_s": round(statistics.median(t["warmup_s"] for t in trials), 2),
            "loss_max_rel_diff_from_eager": loss_curve_difference(results["eager"], trials),
        }
    print(
        json.dumps(
            {
                "preset": args.preset,
                "overrides": args.set,
                "threads": args.threads,
                "trials": args.trials,
                "steps_timed_per_trial": args.steps,
                "variants": report,
                "whole_block_error": whole_block_error(args),
                "torch": torch.__version__,
                "python": sys.version.split()[0],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
