"""Each published run of a runs file against europa-plan's plan of it: the source's FLOPs
per token (its TFLOP/s over its tokens/s, where it gives both), ours in its convention and
their ratio; the FLOPs the GPUs execute, by kind; memory per GPU, by part, against HBM.

    python benchmarks/published_runs.py [--runs FILE ...] [--json] [--svg PICTURE]

Runs in well under a second: the plan is arithmetic (europa-plan, the standard library
only). Every figure of ours is a prediction; the source's figure is the check. ``time``
holds the predicted step and its terms beside the published one (or, where the source
gives only TFLOP/s, its TFLOP/s against ours), and ``error`` the median and worst
|predicted / published − 1| of the step over the file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _runs_svg import runs_svg

from europa.plan import PlanInputError, load_runs
from europa.plan.plan import plan_run

DEFAULT_RUNS = Path(__file__).resolve().parent / "published_runs.toml"


def compare(runs_files: list[Path]) -> dict:
    runs = []
    for run in (run for path in runs_files for run in load_runs(path).runs):
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
    errors = sorted(abs(r["time"]["ratio"] - 1) for r in runs if r["time"]["ratio"])
    return {
        "runs_files": [str(path) for path in runs_files],
        "units": {"flops_per_token": "GFLOP", "memory_gib": "GiB"},
        "summary": {
            "runs": len(runs),
            "flops_checked": len(ratios),
            "worst_flops_ratio_off_1": max((abs(r - 1) for r in ratios), default=None),
            "all_fit": all(r["fits"] for r in runs),
        },
        "error": {
            "median": statistics.median(errors) if errors else None,
            "worst": max(errors, default=None),
            "runs": len(errors),
        },
        "runs": runs,
    }


def _seconds(value: float | None) -> str:
    return f"{'-':>7}" if value is None else f"{value:>7.2f}"


def _published_step(time: dict) -> float | None:
    if "published_step_s" in time:
        return time["published_step_s"]
    if "published_tflops_per_gpu" in time:  # the step the source's TFLOP/s imply
        return time["predicted_step_s"] / time["ratio"]
    return None


def _ratio(value: float | None) -> str:
    return f"{'-':>5}" if value is None else f"{value:>5.2f}"


def _table(result: dict) -> str:
    lines = [
        f"{'run':<50} {'src GF/tok':>10} {'ours':>8} {'ratio':>6} {'GiB':>7} {'HBM':>5}"
        f" {'step s':>7} {'planned':>7} {'ratio':>5}"
    ]
    for r in result["runs"]:
        f, m = r["flops_per_token"], r["memory_gib"]
        source = "-" if f["source"] is None else f"{f['source']:.1f}"
        ratio = "-" if f["ratio"] is None else f"{f['ratio']:.3f}"
        lines.append(
            f"{r['id'][:50]:<50} {source:>10} {f['planned']:>8.1f} {ratio:>6} "
            f"{m['planned']:>7.1f} {m['hbm']:>5.0f} {_seconds(_published_step(r['time']))}"
            f" {_seconds(r['time']['predicted_step_s'])} {_ratio(r['time']['ratio'])}"
            + ("" if r["fits"] else "  DOES NOT FIT")
        )
    error = result["error"]
    if error["runs"]:
        lines.append(
            f"step time |error| over {error['runs']} runs: median {error['median']:.1%}, "
            f"worst {error['worst']:.1%}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=Path, action="append", help="a runs file (repeat for more; default: "
        "the open set, benchmarks/published_runs.toml)"
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--svg", type=Path, help="also draw predicted against published here")
    args = parser.parse_args()
    try:
        result = compare(args.runs or [DEFAULT_RUNS])
    except PlanInputError as err:
        print(f"published_runs.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else _table(result))
    if args.svg:
        points = [
            (
                f"{r['id'].split('-')[0]}: {r['model']} {r['gpus']}×{r['gpu']}",
                _published_step(r["time"]),
                r["time"]["predicted_step_s"],
            )
            for r in result["runs"]
            if r["time"]["ratio"]
        ]
        error = result["error"]
        title = (
            f"europa-plan: step time, {error['runs']} published runs "
            f"(median |error| {error['median']:.0%}, worst {error['worst']:.0%})"
        )
        args.svg.write_text(runs_svg(points, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
