"""The page in a real browser: headless Chromium opens it from disk with the network
off, logs no error, and draws every chart at a visible size."""

from __future__ import annotations

import os
import shutil

import pytest

from europa.report import write_report
from tests.europa_report.pages import read_page

CHROMIUM_ENV = "EUROPA_CHROMIUM"


@pytest.fixture
def chromium() -> str:
    """The browser's path; asked for before the shared run, so a skip costs nothing."""
    found = (
        os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    if found:
        return found
    reason = (
        f"no Chromium found (PATH has no chromium or chromium-browser, {CHROMIUM_ENV} unset); "
        "on Debian: apt-get install chromium"
    )
    if os.environ.get("CI") == "true":  # .ci/run installs it: a skip there would hide a gap
        pytest.fail(reason)
    pytest.skip(reason)


def test_the_page_draws_every_chart_in_chromium_with_no_network(chromium, tiny_run, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    out = write_report([tiny_run], tmp_path / "report.html")
    chart_ids, _, _ = read_page(out)

    errors: list[str] = []
    fetched: list[str] = []

    def refuse_network(route):
        if not route.request.url.startswith("file://"):
            fetched.append(route.request.url)
            return route.abort()
        return route.continue_()

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            context = browser.new_context(offline=True, viewport={"width": 1400, "height": 900})
            context.route("**/*", refuse_network)
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(out.as_uri())
            try:
                page.wait_for_function(
                    "n => document.querySelectorAll('[data-chart] .main-svg').length >= n",
                    arg=len(chart_ids),
                    timeout=20_000,
                )
            except sync_api.TimeoutError:
                pytest.fail(f"charts not drawn within 20 s; errors in the page: {errors}")
            drawn = page.evaluate(
                """() => [...document.querySelectorAll('[data-chart]')].map(chart => {
                    const box = chart.querySelector('.main-svg').getBoundingClientRect();
                    return {id: chart.dataset.chart, width: box.width, height: box.height,
                            traces: chart.querySelectorAll('.trace, .hm, image').length};
                })"""
            )
        finally:
            browser.close()

    assert errors == []
    assert fetched == []
    assert [chart["id"] for chart in drawn] == chart_ids
    for chart in drawn:
        assert chart["width"] > 100 and chart["height"] > 100, chart
        assert chart["traces"] > 0, chart
