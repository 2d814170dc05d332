"""Errors a caller can cause, one line each."""


class OverlapError(ValueError):
    """``str(err)`` names the input, its value and what was expected, on one line.

    ``europa_user_error`` tells europa's CLI and launcher to print it as such
    (one line, exit 2) without this package importing europa-core."""

    europa_user_error = True
