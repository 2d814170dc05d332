"""The HTML page: run tables, every chart, the resolved configs; plotly.js inlined,
so the file opens from disk with no network."""

from __future__ import annotations

import json
import time
from html import escape
from importlib import resources
from pathlib import Path
from typing import Any

from europa.report import series
from europa.report.charts import Chart, all_charts
from europa.report.errors import ReportError
from europa.report.runs import RunData, load_runs

DEFAULT_NAME = "report.html"
CHARTS_ID = "europa-charts"


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Read each run directory, write the page (``RUN_DIR/report.html`` by default)."""
    runs = load_runs(run_dirs)
    out = out if out is not None else run_dirs[0] / DEFAULT_NAME
    if out.is_dir():
        raise ReportError(f"--out = {str(out)!r}: is a directory; expected a file name")
    if not out.parent.is_dir():
        raise ReportError(f"--out = {str(out)!r}: no directory {str(out.parent)!r} to write in")
    staged = out.with_name(f".{out.name}.partial")  # a browser reloading never sees half
    staged.write_text(render(runs, all_charts(runs)))
    staged.replace(out)
    return out


def render(runs: list[RunData], charts: list[Chart]) -> str:
    from plotly.offline import get_plotlyjs  # the bundled plotly.js, about 4.8 MB

    sections: dict[str, list[Chart]] = {}
    for chart in charts:
        sections.setdefault(chart.section, []).append(chart)
    labels = ", ".join(run.label for run in runs)
    body = [
        f"<header><h1>europa report: {escape(labels)}</h1>"
        f"<p>written {time.strftime('%Y-%m-%d %H:%M:%S')} from what the run "
        "directories held then</p></header>",
        _overview(runs),
        *(_section(name, members) for name, members in sections.items()),
        _configs(runs),
    ]
    figures = {chart.id: chart.figure for chart in charts}
    return "\n".join(
        [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>europa report: {escape(labels)}</title>",
            f"<style>{_asset('page.css')}</style></head><body>",
            *body,
            f'<script type="application/json" id="{CHARTS_ID}">{_json(figures)}</script>',
            f"<script>{get_plotlyjs()}</script>",
            f"<script>{_asset('page.js')}</script>",
            "</body></html>",
        ]
    )


def _asset(name: str) -> str:
    return resources.files("europa.report").joinpath(name).read_text()


def _json(value: Any) -> str:
    # Strict JSON (series turned NaN into null); "</" escaped so no string ends the script.
    return json.dumps(value, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")


def _section(name: str, charts: list[Chart]) -> str:
    divs = "".join(f'<div class="chart" data-chart="{escape(c.id)}"></div>' for c in charts)
    return f'<section data-section="{escape(name)}"><h2>{escape(name)}</h2>' + (
        f'<div class="grid">{divs}</div></section>'
    )


def _overview(runs: list[RunData]) -> str:
    rows: dict[str, list[str]] = {}
    for index, run in enumerate(runs):
        for name, value in _facts(run).items():
            rows.setdefault(name, [""] * len(runs))[index] = value
    head = "".join(f"<th>{escape(run.label)}</th>" for run in runs)
    body = "".join(
        f"<tr><th>{escape(name)}</th>" + "".join(f"<td>{escape(v)}</td>" for v in values) + "</tr>"
        for name, values in rows.items()
    )
    return (
        f'<section id="runs"><h2>Runs</h2><table><tr><th></th>{head}</tr>{body}</table></section>'
    )


def _facts(run: RunData) -> dict[str, str]:
    job, summary = run.job or {}, run.summary or {}
    counts = job.get("parameters") or summary.get("parameters") or {}
    world = job.get("world_size", summary.get("world_size"))
    mesh = job.get("mesh") or {}
    losses = [v for v in series.column(run, "loss") if v is not None]
    facts = {
        "directory": str(run.path),
        "status": _status(run),
        "parameters": (
            f"{_millions(counts.get('total'))} total, "
            f"{_millions(counts.get('active_per_token'))} active per token, "
            f"{_millions(counts.get('routed_experts'))} in routed experts"
        ),
        "world size": "—" if world is None else str(world),
        "mesh": " × ".join(f"{axis}={size}" for axis, size in mesh.items()) or "—",
        "device": str(job.get("device", "—")),
        "plugins": ", ".join(run.enabled_plugins) or "none",
        "loss": f"{losses[0]:.4f} → {losses[-1]:.4f}" if losses else "—",
        "tokens seen": _millions(series.tokens_seen(run)[-1]),
        "last tokens/s": _number(run.records[-1].get("tokens_per_s"), "{:.0f}"),
        "training time": _number(summary.get("seconds"), "{:.0f} s"),
    }
    if run.notes:
        facts["notes"] = "; ".join(run.notes)
    return facts


def _status(run: RunData) -> str:
    logged, target = run.records[-1]["step"], run.target_steps
    of = f"{logged} of {target}" if target else str(logged)
    if run.summary is None:
        return f"no summary yet: step {of} logged (still going, or ended without a summary)"
    if run.summary.get("stopped_by"):
        return f"stopped by {run.summary['stopped_by']} at step {of}"
    return f"finished: step {of}"


def _millions(value: Any) -> str:
    return "—" if series.number(value) is None else f"{value / 1e6:.2f} M"


def _number(value: Any, fmt: str) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and series.number(value) is not None:
        return fmt.format(value)
    return str(value)


def _configs(runs: list[RunData]) -> str:
    """The resolved config.toml and summary.json of each run, as the files say."""
    blocks = []
    for run in runs:
        summary = json.dumps(run.summary, indent=2) if run.summary else "(no summary.json yet)"
        for name, text in (("summary.json", summary), ("config.toml", run.config_text)):
            blocks.append(
                f"<details open><summary>{escape(run.label)}: {name}</summary>"
                f"<pre>{escape(text or f'(no {name})')}</pre></details>"
            )
    return f'<section id="files"><h2>Summary and resolved config</h2>{"".join(blocks)}</section>'
