"""Reading a written page back: which charts it holds and what they draw."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

from europa.report.page import CHARTS_ID


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.chart_elements: list[str] = []
        self.external: list[str] = []  # anything the browser would fetch
        self.text: list[str] = []
        self._in_charts = False
        self._in_script = False
        self.charts_json = ""

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-chart" in attrs:
            self.chart_elements.append(attrs["data-chart"])
        for name in ("src", "href"):
            if attrs.get(name):
                self.external.append(f"<{tag} {name}={attrs[name]}>")
        self._in_script = tag in ("script", "style")
        self._in_charts = tag == "script" and attrs.get("id") == CHARTS_ID

    def handle_endtag(self, tag):
        self._in_charts = self._in_script = False

    def handle_data(self, data):
        if self._in_charts:
            self.charts_json += data
        elif data.strip() and not self._in_script:
            self.text.append(data.strip())


def _refuse(constant: str):
    raise AssertionError(f"{constant} in the charts' JSON: JSON.parse would reject it")


def read_page(path: Path) -> tuple[list[str], dict[str, dict], _Page]:
    """The chart elements in page order, the figures by id, and the parsed page."""
    page = _Page()
    page.feed(path.read_text())
    figures = json.loads(page.charts_json, parse_constant=_refuse)
    return page.chart_elements, figures, page
