"""Errors a caller can cause: impossible layouts and requests, one line each."""


class FlexShardError(ValueError):
    """``str(err)`` names the input, its value and what was expected, on one line.

    ``europa_user_error`` tells europa's CLI and launcher to print it as such
    (one line, exit 2) without this package importing europa-core."""

    europa_user_error = True


class PlanError(FlexShardError):
    """An ownership plan that cannot be made."""
