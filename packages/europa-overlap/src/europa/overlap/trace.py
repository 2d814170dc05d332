"""``europa trace RUN_DIR``: a run's timelines as a picture and as a Chrome trace.

Reads ``RUN_DIR/overlap/timeline-rank<r>.jsonl`` (one record per traced step,
times in seconds from that rank's step start; see ``StepTimeline.as_dict``)
and writes:

* ``trace.html``: a self-contained page with an SVG, one lane per rank; in each
  lane a row of compute (the training thread not waiting), a row per kind of
  communication (a collective from issue to completion; collectives in flight
  together are stacked), and a row of exposed communication (the training
  thread blocked on one). Steps are laid side by side, each rank's step drawn
  from its own start (clocks of different machines are not compared);
* ``trace.json``: the same intervals in the Chrome trace-event format, one
  process per rank and one thread per row, for https://ui.perfetto.dev or
  ``chrome://tracing``.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from europa.overlap.errors import OverlapError
from europa.overlap.timeline import TIMELINE_DIR

COLOURS = {
    "compute": "#4e79a7",
    "parameter_gather": "#59a14f",
    "gradient_reduce_scatter": "#edc948",
    "expert_all_to_all": "#f28e2b",
    "all_reduce": "#b07aa1",
    "exposed": "#e15759",
}
# A pipeline stage's chunks: forward, whole backward, a split backward's two halves.
STAGE_COLOURS = {"F": "#76b7b2", "B": "#9c755f", "I": "#bab0ac", "W": "#ff9da7"}
ROW_HEIGHT, ROW_GAP, LANE_GAP, LABEL_WIDTH, WIDTH = 12, 2, 18, 190, 1400


def load_timelines(run_dir: Path) -> list[dict[str, Any]]:
    folder = Path(run_dir) / TIMELINE_DIR
    files = sorted(folder.glob("timeline-rank*.jsonl"))
    if not files:
        raise OverlapError(
            f"run directory {run_dir}: no {TIMELINE_DIR}/timeline-rank*.jsonl; expected a run "
            "trained with -p overlap and overlap.timeline = true (overlap.trace_steps > 0)"
        )
    records = []
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line))
    return records


def _stack(intervals: list[list]) -> list[list[list]]:
    """Intervals into rows where none overlaps another (first fit, by start)."""
    rows: list[list[list]] = []
    ends: list[float] = []
    for item in sorted(intervals, key=lambda i: i[1]):
        for index, end in enumerate(ends):
            if item[1] >= end:
                rows[index].append(item)
                ends[index] = item[2]
                break
        else:
            rows.append([item])
            ends.append(item[2])
    return rows


def lanes(records: list[dict[str, Any]]) -> dict[int, list[tuple[str, list[list]]]]:
    """Per rank, its rows: (label, [[kind, start, end, step], ...]) with ``start``
    and ``end`` on one time axis where steps follow each other."""
    steps = sorted({r["step"] for r in records})
    offsets, cursor = {}, 0.0
    for step in steps:
        offsets[step] = cursor
        cursor += max(r["duration"] for r in records if r["step"] == step) * 1.02
    by_rank: dict[int, list[dict]] = {}
    for record in records:
        by_rank.setdefault(record["rank"], []).append(record)
    out = {}
    for rank, mine in sorted(by_rank.items()):

        def shifted(key, mine=mine):
            return [
                [kind, offsets[r["step"]] + s, offsets[r["step"]] + e, r["step"]]
                for r in mine
                for kind, s, e in r[key]
            ]

        rows = [("compute", shifted("compute"))]
        comm = shifted("comm")
        for kind in sorted({c[0] for c in comm}):
            for index, row in enumerate(_stack([c for c in comm if c[0] == kind])):
                rows.append((kind if index == 0 else f"{kind} ({index + 1})", row))
        rows.append(("exposed", [["exposed", *b[1:]] for b in shifted("blocked")]))
        rows += _stage_rows(mine, offsets)
        out[rank] = rows
    return out


def _stage_rows(mine: list[dict], offsets: dict[int, float]) -> list[tuple[str, list[list]]]:
    """A row per pipeline stage the rank ran: its spans, labelled action and micro-batch
    (``F3``: the forward of micro-batch 3)."""
    spans = [(r["step"], *span) for r in mine for span in r.get("stages", [])]
    rows = []
    for stage in sorted({s[1] for s in spans}):
        rows.append((f"stage {stage}", [
            [f"{action}{micro}", offsets[step] + start, offsets[step] + end, step]
            for step, index, action, micro, start, end in spans
            if index == stage
        ]))  # fmt: skip
    return rows


def svg(records: list[dict[str, Any]]) -> str:
    drawn = lanes(records)
    end = max((i[2] for rows in drawn.values() for _, row in rows for i in row), default=1.0)
    scale = (WIDTH - LABEL_WIDTH - 10) / max(end, 1e-9)
    parts, y = [], 10
    for rank, rows in drawn.items():
        parts.append(f'<g class="lane" data-rank="{rank}">')
        parts.append(f'<text x="4" y="{y + 10}" font-weight="bold">rank {rank}</text>')
        y += 16
        for label, row in rows:
            parts.append(f'<text x="14" y="{y + 10}" font-size="11">{html.escape(label)}</text>')
            for kind, start, stop, step in row:
                css = kind if kind in ("compute", "exposed") else f"comm {kind}"
                colour = COLOURS.get(kind, "#999")
                if label.startswith("stage "):  # a pipeline stage's chunk, by its action
                    css, colour = f"stage {kind[0]}", STAGE_COLOURS[kind[0]]
                width = max(0.5, (stop - start) * scale)
                tip = f"step {step} {kind}: {(stop - start) * 1e3:.2f} ms"
                parts.append(
                    f'<rect class="{css}" data-step="{step}" x="{LABEL_WIDTH + start * scale:.2f}"'
                    f' y="{y}" width="{width:.2f}" height="{ROW_HEIGHT}"'
                    f' fill="{colour}"><title>{tip}</title></rect>'
                )
            y += ROW_HEIGHT + ROW_GAP
        parts.append("</g>")
        y += LANE_GAP
    axis = _axis(end, scale, y)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y + 30}" '
        f'font-family="sans-serif">{"".join(parts)}{axis}</svg>'
    )


def _axis(end: float, scale: float, y: float) -> str:
    """About ten ticks, at 1, 2 or 5 times a power of ten seconds."""
    nice = [m * 10.0**e for e in range(-4, 4) for m in (1, 2, 5)]
    step = next((n for n in nice if end / n <= 12), nice[-1])
    ticks = []
    for index in range(int(end / step) + 1):
        t, x = index * step, LABEL_WIDTH + index * step * scale
        ticks.append(
            f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 5}" stroke="#333"/>'
            f'<text x="{x:.1f}" y="{y + 17}" font-size="10">{t:g} s</text>'
        )
    return "".join(ticks)


def _summary_rows(records: list[dict[str, Any]]) -> str:
    from europa.overlap.timeline import Interval, StageSpan, StepTimeline

    rows = []
    for record in sorted(records, key=lambda r: (r["step"], r["rank"])):
        timeline = StepTimeline(
            record["step"],
            record["rank"],
            record["duration"],
            [Interval(*c) for c in record["comm"]],
            [Interval(*b) for b in record["blocked"]],
            [StageSpan(*span) for span in record.get("stages", [])],
        )
        s = timeline.summary()
        bubble = s.get("pipeline_bubble_s")
        rows.append(
            f"<tr><td>{record['step'] + 1}</td><td>{record['rank']}</td>"
            f"<td>{s['step_s']:.3f}</td><td>{s['compute_s']:.3f}</td><td>{s['comm_s']:.3f}</td>"
            f"<td>{s['exposed_comm_s']:.3f}</td>"
            f"<td>{'' if bubble is None else f'{bubble:.3f}'}</td></tr>"
        )
    return "".join(rows)


def page(records: list[dict[str, Any]], title: str) -> str:
    names = {"F": "stage forward", "B": "stage backward", "I": "input gradient",
             "W": "weight gradient"}  # fmt: skip
    stages = any(r.get("stages") for r in records)
    shown = {**COLOURS, **({names[a]: c for a, c in STAGE_COLOURS.items()} if stages else {})}
    legend = "".join(
        f'<span><i style="background:{c}"></i>{k.replace("_", " ")}</span>'
        for k, c in shown.items()
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 16px; }}
.legend span {{ margin-right: 14px; }}
.legend i {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px; }}
table {{ border-collapse: collapse; margin-top: 12px; }}
td, th {{ border: 1px solid #ccc; padding: 2px 8px; text-align: right; }}
</style></head><body>
<h2>{html.escape(title)}</h2>
<p>One lane per rank. <b>compute</b>: the training thread not waiting for communication;
one row per kind of <b>communication</b>, from the call that issues a collective to its
completion (collectives in flight together are stacked); <b>exposed</b>: the training thread
blocked on a collective, i.e. communication no computation ran beside. Steps follow each other
left to right, each rank's step drawn from its own start. With pipeline stages, a row per
<b>stage</b> the rank runs: each chunk it computed (F: forward, B: backward, I and W: a split
backward's input and weight halves) and its micro-batch; the rank's bubble is the step
outside them. Hover a bar for its duration.</p>
<div class="legend">{legend}</div>
{svg(records)}
<table><tr><th>step</th><th>rank</th><th>step s</th><th>compute s</th>
<th>communication s</th><th>exposed s</th><th>pipeline bubble s</th></tr>
{_summary_rows(records)}</table>
</body></html>
"""


def chrome_trace(records: list[dict[str, Any]]) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    for rank, rows in lanes(records).items():
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            }
        )
        for tid, (label, row) in enumerate(rows):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}}
            )
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": rank,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
            for kind, start, stop, step in row:
                events.append(
                    {
                        "ph": "X",
                        "name": kind,
                        "cat": "compute" if kind == "compute" else "comm",
                        "pid": rank,
                        "tid": tid,
                        "ts": round(start * 1e6, 3),
                        "dur": round((stop - start) * 1e6, 3),
                        "args": {"step": step + 1},
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(run_dir: Path | str, out_dir: Path | str | None = None) -> list[Path]:
    """Write ``trace.html`` and ``trace.json`` for ``run_dir`` into ``out_dir`` (default:
    ``run_dir``); returns their paths."""
    run_dir = Path(run_dir)
    records = load_timelines(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    picture, events = out / "trace.html", out / "trace.json"
    picture.write_text(page(records, f"europa trace: {run_dir.name}"))
    events.write_text(json.dumps(chrome_trace(records)))
    return [picture, events]
