"""The picture of benchmarks/published_runs.py: predicted against published step time,
one labelled point per run, on log axes, with the diagonal and its ±10 % and ±20 % bands.
Plain SVG, written by hand: the benchmark needs nothing beyond the standard library."""

from __future__ import annotations

import math
from html import escape

SIZE, MARGIN = 640, 70


def runs_svg(points: list[tuple[str, float, float]], title: str) -> str:
    """``points``: (label, published seconds, predicted seconds)."""
    values = [v for _, p, q in points for v in (p, q)]
    low = 10 ** math.floor(math.log10(min(values)))
    high = 10 ** math.ceil(math.log10(max(values)))
    span = math.log10(high) - math.log10(low)
    inner = SIZE - 2 * MARGIN

    def x(v: float) -> float:
        return MARGIN + (math.log10(v) - math.log10(low)) / span * inner

    def y(v: float) -> float:
        return SIZE - MARGIN - (math.log10(v) - math.log10(low)) / span * inner

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{SIZE}" height="{SIZE}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{SIZE}" height="{SIZE}" fill="white"/>',
        f'<text x="{SIZE / 2}" y="24" text-anchor="middle" font-size="14">{escape(title)}</text>',
    ]
    for band, shade in ((0.2, "#eeeeee"), (0.1, "#dddddd")):
        corners = [(low, low * (1 + band)), (high / (1 + band), high), (high, high),
                   (high, high * (1 - band)), (low / (1 - band), low), (low, low)]  # fmt: skip
        path = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in corners)
        out.append(f'<polygon points="{path}" fill="{shade}"/>')
    out.append(
        f'<line x1="{x(low):.1f}" y1="{y(low):.1f}" x2="{x(high):.1f}" y2="{y(high):.1f}" '
        'stroke="#888" stroke-dasharray="4 3"/>'
    )
    decade = low
    while decade <= high:
        for v in (decade, 2 * decade, 5 * decade):
            if low <= v <= high:
                out.append(
                    f'<text x="{x(v):.1f}" y="{SIZE - MARGIN + 16}" '
                    f'text-anchor="middle">{v:g}</text>'
                )
                out.append(
                    f'<text x="{MARGIN - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>'
                )
        decade *= 10
    out.append(
        f'<text x="{SIZE / 2}" y="{SIZE - 24}" text-anchor="middle">published step (s)</text>'
    )
    out.append(
        f'<text x="18" y="{SIZE / 2}" text-anchor="middle" '
        f'transform="rotate(-90 18 {SIZE / 2})">predicted step (s)</text>'
    )
    for label, published, predicted in points:
        px, py = x(published), y(predicted)
        out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#1f77b4"/>')
        out.append(f'<text x="{px + 6:.1f}" y="{py - 6:.1f}">{escape(label)}</text>')
    out.append(
        f'<text x="{MARGIN}" y="{MARGIN - 10}" fill="#666">'
        "shaded: within 10 % and 20 % of the published step</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"
