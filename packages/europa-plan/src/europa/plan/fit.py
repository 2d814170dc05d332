"""Fitting a GPU generation's efficiencies on published runs: one set for every run of the
generation, never a factor per run.

    python -m europa.plan.fit RUNS.toml [MORE.toml ...]

prints, for each generation the files' runs use, the ``[[generation]]`` table that
minimises the sum of squared log step-time ratios (predicted over published) over those
runs (``fits_on``: each with a published step and, with stages, its micro-batches and
virtual stages stated), each efficiency searched coordinate by coordinate over a grid
within physical bounds, and the median and worst |error| it reaches. Paste the tables into
``builtin.toml``. An efficiency no run of the generation exercises (a precision none of
them uses) keeps its starting value.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections.abc import Sequence
from types import MappingProxyType

from europa.plan import load_runs
from europa.plan.errors import PlanInputError
from europa.plan.flops import published_step
from europa.plan.record import PRECISION_PEAK, Efficiencies, Run
from europa.plan.step_time import predict_step

BOUNDS = {  # the shares of the peak a kernel or link can plausibly reach
    "gemm": (0.3, 0.95),
    "grouped_gemm": (0.3, 1.0),
    "attention": (0.2, 0.8),
    "memory": (0.3, 0.9),
    "nvlink": (0.3, 0.95),
    "network": (0.2, 0.95),
    "overlap": (0.0, 1.0),
}
SCALARS = ("grouped_gemm", "attention", "memory", "nvlink", "network", "overlap")
STEP = 0.01
SWEEPS = 4


def fits_on(run: Run) -> bool:
    """A run the fit learns from: it has a published step, and its source states the
    pipeline's micro-batches and virtual stages where it has stages (they set the
    bubble: a run that leaves them out is planned and shown, not fitted on)."""
    unstated = {"vp", "micro_batch"} & set(run.assumed)
    return published_step(run) is not None and not (run.layout.pp > 1 and unstated)


def with_efficiencies(run: Run, efficiencies: Efficiencies) -> Run:
    return dataclasses.replace(run, gpu=dataclasses.replace(run.gpu, efficiencies=efficiencies))


def log_errors(runs: Sequence[Run], efficiencies: Efficiencies) -> list[float]:
    errors = []
    for run in runs:
        step = predict_step(with_efficiencies(run, efficiencies)).total
        errors.append(math.log(step / published_step(run)))
    return errors


def _coordinates(runs: Sequence[Run], start: Efficiencies) -> list[tuple[str, str | None]]:
    """The efficiencies the runs exercise: (field, precision) for the tables by precision."""
    peaks = {PRECISION_PEAK[r.precision] for r in runs} | {"bfloat16"}
    coords: list[tuple[str, str | None]] = []
    coords += [("gemm", p) for p in sorted(peaks) if p in start.gemm]
    coords += [(name, None) for name in SCALARS]
    return coords


def _set(eff: Efficiencies, coord: tuple[str, str | None], value: float) -> Efficiencies:
    name, precision = coord
    if precision is None:
        return dataclasses.replace(eff, **{name: value})
    table = dict(getattr(eff, name)) | {precision: value}
    return dataclasses.replace(eff, **{name: MappingProxyType(table)})


def _get(eff: Efficiencies, coord: tuple[str, str | None]) -> float:
    name, precision = coord
    value = getattr(eff, name)
    return value if precision is None else value[precision]


def fit_generation(runs: Sequence[Run], start: Efficiencies) -> Efficiencies:
    """Coordinate descent on the sum of squared log errors over ``runs``."""
    best = start
    loss = sum(e * e for e in log_errors(runs, best))
    for _ in range(SWEEPS):
        improved = False
        for coord in _coordinates(runs, start):
            low, high = BOUNDS[coord[0]]
            steps = round((high - low) / STEP)
            for i in range(steps + 1):
                value = round(low + i * STEP, 4)
                trial = _set(best, coord, value)
                trial_loss = sum(e * e for e in log_errors(runs, trial))
                if trial_loss < loss - 1e-12:
                    best, loss, improved = trial, trial_loss, True
        if not improved:
            break
    return best


def generation_toml(eff: Efficiencies, command: str) -> str:
    table = lambda t: "{ " + ", ".join(f"{k} = {v:g}" for k, v in t.items()) + " }"  # noqa: E731
    lines = [
        "[[generation]]",
        f'id = "{eff.id}"',
        f"gemm = {table(eff.gemm)}",
    ]
    lines += [f"{name} = {getattr(eff, name):g}" for name in SCALARS]
    lines.append(f'fitted = "{command}"')
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m europa.plan.fit", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("runs", nargs="+", help="runs files whose published steps to fit")
    args = parser.parse_args(argv)
    try:
        files = [load_runs(path) for path in args.runs]
    except PlanInputError as err:
        print(f"europa.plan.fit: error: {err}", file=sys.stderr)
        return 2
    runs = [r for f in files for r in f.runs if fits_on(r)]
    shown = [r.id for f in files for r in f.runs if not fits_on(r)]
    command = "python -m europa.plan.fit " + " ".join(args.runs)
    if shown:
        print("# not fitted on (no published step, or stages the source leaves unstated):")
        print("".join(f"#   {run_id}\n" for run_id in shown))
    for generation in sorted({r.gpu.generation for r in runs}):
        own = [r for r in runs if r.gpu.generation == generation]
        fitted = fit_generation(own, own[0].gpu.efficiencies)
        ratios = [math.exp(e) for e in log_errors(own, fitted)]
        errors = [abs(r - 1) for r in ratios]
        print(generation_toml(fitted, command))
        for run, ratio in zip(own, ratios, strict=True):
            print(f"# {ratio:5.2f}  {run.id}")
        print(
            f"# {len(own)} runs: median |error| {statistics.median(errors):.1%}, "
            f"worst {max(errors):.1%}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
