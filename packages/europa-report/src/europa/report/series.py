"""Columns of numbers out of metrics records, thinned to what a page can draw."""

from __future__ import annotations

import math
from typing import Any

from europa.report.runs import RunData
from europa.spec.metrics import CORE_KEYS  # every other numeric key is a plugin's

MAX_LINE_POINTS = 4000  # beyond this a line is drawn from means of consecutive records
MAX_HEATMAP_COLUMNS = 400


def number(value: Any) -> float | None:
    """A value plotly can draw; NaN, infinities and non-numbers become gaps."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def buckets(n: int, limit: int) -> list[range]:
    """Consecutive index ranges, at most ``limit`` of them, covering ``range(n)``."""
    size = max(1, math.ceil(n / limit))
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def steps(run: RunData) -> list[int]:
    return [record["step"] for record in run.records]


def tokens_seen(run: RunData) -> list[float | None]:
    """``tokens_seen`` where recorded; for older runs, tokens per step × step."""
    out = []
    for record in run.records:
        seen = number(record.get("tokens_seen"))
        if seen is None:
            rate, seconds = number(record.get("tokens_per_s")), number(record.get("step_time_s"))
            if rate is not None and seconds is not None:
                seen = round(rate * seconds) * record["step"]
        out.append(seen)
    return out


def column(run: RunData, key: str, sub: str | None = None) -> list[float | None]:
    """``record[key]`` (or ``record[key][sub]``) for every record, gaps where absent."""
    out = []
    for record in run.records:
        value = record.get(key)
        if sub is not None:
            value = value.get(sub) if isinstance(value, dict) else None
        out.append(number(value))
    return out


def thin(x: list[Any], y: list[float | None]) -> tuple[list[Any], list[float | None]]:
    """At most MAX_LINE_POINTS points: the last x and the mean y of each bucket."""
    if len(x) <= MAX_LINE_POINTS:
        return x, y
    parts = buckets(len(x), MAX_LINE_POINTS)
    return [x[p[-1]] for p in parts], [_mean([y[i] for i in p]) for p in parts]


def layers(run: RunData, key: str) -> list[str]:
    """Layer names of a per-layer mapping, in the order the run first recorded them."""
    seen: dict[str, None] = {}
    for record in run.records:
        value = record.get(key)
        if isinstance(value, dict):
            seen.update(dict.fromkeys(value))
    return list(seen)


def expert_load(run: RunData, layer: str) -> tuple[list[int], list[list[float | None]]]:
    """Steps (the last of each column) and shares as rows of experts × columns of steps."""
    rows = [
        (record["step"], record["expert_load"][layer])
        for record in run.records
        if isinstance(record.get("expert_load"), dict) and layer in record["expert_load"]
    ]
    experts = max((len(shares) for _, shares in rows), default=0)
    parts = buckets(len(rows), MAX_HEATMAP_COLUMNS)
    x = [rows[p[-1]][0] for p in parts]
    z = [
        [_mean([number(rows[i][1][e]) if e < len(rows[i][1]) else None for i in p]) for p in parts]
        for e in range(experts)
    ]
    return x, z


def plugin_keys(run: RunData) -> dict[str, list[str]]:
    """Numeric (or per-name numeric) keys outside core's, grouped by the plugin they
    start with: an enabled plugin's name, else the word before the first ``_``."""
    names = sorted(run.enabled_plugins, key=len, reverse=True)
    found: dict[str, dict[str, None]] = {}
    for record in run.records:
        for key, value in record.items():
            if key in CORE_KEYS or not _drawable(value):
                continue
            owner = next((n for n in names if key.startswith(f"{n}_")), key.split("_")[0])
            found.setdefault(owner, {})[key] = None
    return {owner: list(keys) for owner, keys in found.items()}


def _drawable(value: Any) -> bool:
    if isinstance(value, dict):
        return any(number(v) is not None for v in value.values())
    return number(value) is not None
