"""``europa report``: a run's loss, speed, expert load and memory as one HTML page.

``write_report([run_dir, ...], out)`` is what the command calls; it reads only the
files a run directory holds, so it works on a run that is still going."""

from europa.report.errors import ReportError
from europa.report.page import write_report

__all__ = ["ReportError", "write_report"]
