"""``europa-plan RUNS.toml [--run ID] [--json]``: the plan of each run of a runs file,
as a table or JSON. A refused file is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from europa.plan import load_runs
from europa.plan.errors import PlanInputError
from europa.plan.plan import plan_run
from europa.plan.table import plans_table

USAGE_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="europa-plan",
        description="Plan each run of a runs file ([[gpu]], [[model]], [[run]] tables): "
        "FLOPs per token and memory per GPU.",
    )
    parser.add_argument("runs", help="the runs file (TOML)")
    parser.add_argument("--run", metavar="ID", help="plan only this run")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        runs_file = load_runs(args.runs)
        runs = [runs_file.run(args.run)] if args.run else list(runs_file.runs)
    except PlanInputError as err:
        print(f"europa-plan: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    plans = [plan_run(run) for run in runs]
    text = json.dumps({"runs": plans}, indent=2) if args.json else plans_table(plans)
    try:
        print(text)
    except BrokenPipeError:  # e.g. piped into head: the reader has what it wanted
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
