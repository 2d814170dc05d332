"""Registers ``europa report`` with the ``europa`` command (installed is enough:
commands come from every installed plugin, enabled or not)."""

from __future__ import annotations

import sys
import webbrowser
from pathlib import Path
from typing import Annotated, Any

import typer

from europa.spec.hookspecs import hookimpl


@hookimpl
def europa_register_commands(app: Any) -> None:
    app.command("report")(report_command)


def report_command(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(metavar="RUN_DIR", help="One run directory, or several to compare."),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", metavar="FILE.html", help="Default: report.html in the first RUN_DIR."
        ),
    ] = None,
    open_page: Annotated[
        bool, typer.Option("--open", help="Open the page in a web browser.")
    ] = False,
) -> None:
    """One self-contained HTML page of runs: loss, speed, expert load, memory, config."""
    from europa.report.page import write_report  # plotly: only when asked for

    written = write_report(run_dirs, out)
    size = written.stat().st_size / 1e6
    print(f"europa: report written to {written} ({size:.1f} MB)", file=sys.stderr)
    if open_page:
        webbrowser.open(written.resolve().as_uri())
