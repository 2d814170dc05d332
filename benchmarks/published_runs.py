"""Each published run of a runs file against europa-plan's plan of it: the source's FLOPs
per token (its TFLOP/s over its tokens/s, where it gives both), ours in its convention and
their ratio; the FLOPs the GPUs execute, by kind; memory per GPU, by part, against HBM.

    python benchmarks/published_runs.py [--runs FILE] [--json]

Runs in well under a second: the plan is arithmetic (europa-plan, the standard library
only). Every figure of ours is a prediction; the source's figure is the check. ``time``
holds the step's compute so far (a lower bound: communication and the pipeline's bubble
are not in it yet) beside the published step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from europa.plan import PlanInputError, load_runs
from europa.plan.plan import plan_run

DEFAULT_RUNS = Path(__file__).resolve().parent / "published_runs.toml"


def compare(runs_file: Path) -> dict:
    runs = []
    for run in load_runs(runs_file).runs:
        plan = plan_run(run)
        runs.append(
            {
                "id": run.id,
                "model": run.model.id,
                "gpu": run.gpu.id,
                "gpus": run.gpus,
                "layout": plan["layout"],
                "flops_per_token": plan["flops_per_token"],
                "executed_flops_per_token": plan["executed_flops_per_token"],
                "memory_gib": plan["memory_gib"],
                "fits": plan["fits"],
                "assumed": plan["assumed"],
                "published": {k: v for k, v in vars(run.published).items() if v is not None},
                "time": plan["time"],
            }
        )
    ratios = [r["flops_per_token"]["ratio"] for r in runs if r["flops_per_token"]["ratio"]]
    return {
        "runs_file": str(runs_file),
        "units": {"flops_per_token": "GFLOP", "memory_gib": "GiB"},
        "summary": {
            "runs": len(runs),
            "flops_checked": len(ratios),
            "worst_flops_ratio_off_1": max((abs(r - 1) for r in ratios), default=None),
            "all_fit": all(r["fits"] for r in runs),
        },
        "runs": runs,
    }


def _seconds(value: float | None) -> str:
    return f"{'-':>7}" if value is None else f"{value:>7.2f}"


def _table(result: dict) -> str:
    lines = [
        f"{'run':<50} {'src GF/tok':>10} {'ours':>8} {'ratio':>6} {'GiB':>7} {'HBM':>5}"
        f" {'step s':>7} {'compute':>7}"
    ]
    for r in result["runs"]:
        f, m = r["flops_per_token"], r["memory_gib"]
        source = "-" if f["source"] is None else f"{f['source']:.1f}"
        ratio = "-" if f["ratio"] is None else f"{f['ratio']:.3f}"
        lines.append(
            f"{r['id'][:50]:<50} {source:>10} {f['planned']:>8.1f} {ratio:>6} "
            f"{m['planned']:>7.1f} {m['hbm']:>5.0f} {_seconds(r['time']['published_step_s'])}"
            f" {_seconds(r['time']['compute_lower_bound_s'])}"
            + ("" if r["fits"] else "  DOES NOT FIT")
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help="a runs file")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    try:
        result = compare(args.runs)
    except PlanInputError as err:
        print(f"published_runs.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
