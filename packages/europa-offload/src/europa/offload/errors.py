"""Errors a caller can cause, one line each."""


class OffloadError(ValueError):
    """``str(err)`` names the setting, its value and what was expected, on one line.

    ``europa_user_error`` tells europa's CLI and launcher to print it as such
    (one line, exit 2) without this package importing europa-core."""

    europa_user_error = True


class HostMemoryExceeded(OffloadError):
    """Offloading would take more host memory than the budget allows."""
