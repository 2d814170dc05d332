"""The picture of benchmarks/published_runs.py: predicted against published step time,
one numbered point per run, on log axes, with the diagonal and its ±10 % and ±20 % bands,
and the runs listed by number beside it. Plain SVG, written by hand: the benchmark needs
nothing beyond the standard library."""

from __future__ import annotations

import math
from html import escape

SIZE, MARGIN, LEGEND = 640, 70, 420
NICE = (1, 2, 5)


def runs_svg(points: list[tuple[str, float, float]], title: str) -> str:
    """``points``: (label, published seconds, predicted seconds)."""
    values = [v for _, p, q in points for v in (p, q)]
    low, high = _nice(min(values), down=True), _nice(max(values), down=False)
    span = math.log10(high) - math.log10(low)
    inner = SIZE - 2 * MARGIN

    def x(v: float) -> float:
        return MARGIN + (math.log10(v) - math.log10(low)) / span * inner

    def y(v: float) -> float:
        return SIZE - MARGIN - (math.log10(v) - math.log10(low)) / span * inner

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{SIZE + LEGEND}" height="{SIZE}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{SIZE + LEGEND}" height="{SIZE}" fill="white"/>',
        f'<text x="{(SIZE + LEGEND) / 2}" y="24" text-anchor="middle" font-size="14">'
        f"{escape(title)}</text>",
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
    decade = 10 ** math.floor(math.log10(low))
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
    for number, (label, published, predicted) in enumerate(points, 1):
        px, py = x(published), y(predicted)
        out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#1f77b4"/>')
        out.append(f'<text x="{px + 5:.1f}" y="{py - 5:.1f}" font-size="10">{number}</text>')
        row = MARGIN + (number - 1) * 17
        text = f"{number}. {label}: {predicted / published:.2f}×"
        out.append(f'<text x="{SIZE + 10}" y="{row}">{escape(text)}</text>')
    out.append(
        f'<text x="{MARGIN}" y="{MARGIN - 10}" fill="#666">'
        "shaded: within 10 % and 20 % of the published step</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _nice(value: float, down: bool) -> float:
    """The nearest 1, 2 or 5 times a power of ten below (or above) ``value``."""
    decade = 10 ** math.floor(math.log10(value))
    steps = [decade * n for n in (*NICE, 10)]
    if down:
        return max(v for v in steps if v <= value)
    return min(v for v in steps if v >= value)
