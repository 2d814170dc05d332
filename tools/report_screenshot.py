"""Take the README's picture of a report page with headless Chromium.

Usage (from the repository root):

    .venv/bin/europa report runs/tiny-<time>
    .venv/bin/python tools/report_screenshot.py runs/tiny-<time>/report.html docs/report.png

Opens the page from disk with the network off (as the browser test does), waits for
every chart, and saves the page at WIDTH down to the end of its expert-load section
(at most MAX_HEIGHT pixels), as an 8-bit palette PNG when Pillow is present (a
third of the size), else as Chromium wrote it.
"""

from __future__ import annotations

import argparse
import io
import shutil
from pathlib import Path

from playwright.sync_api import sync_playwright

WIDTH, MAX_HEIGHT = 1600, 2800
LAST_SECTION = "Expert load"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium)
        page = browser.new_context(offline=True, viewport={"width": WIDTH, "height": 900})
        tab = page.new_page()
        tab.goto(args.page.resolve().as_uri())
        tab.wait_for_function(
            "() => [...document.querySelectorAll('[data-chart]')]"
            ".every(chart => chart.querySelector('.main-svg'))"
        )
        bottom = tab.evaluate(
            "name => document.querySelector(`section[data-section='${name}']`)"
            ".getBoundingClientRect().bottom + window.scrollY",
            LAST_SECTION,
        )
        height = min(MAX_HEIGHT, int(bottom) + 16)
        png = tab.screenshot(
            full_page=True, clip={"x": 0, "y": 0, "width": WIDTH, "height": height}
        )
        browser.close()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    args.png.write_bytes(_smaller(png))
    print(f"{args.png}: {args.png.stat().st_size / 1e3:.0f} kB")


def _smaller(png: bytes) -> bytes:
    try:
        from PIL import Image
    except ImportError:
        return png
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


if __name__ == "__main__":
    main()
