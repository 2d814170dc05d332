"""Errors a caller can cause, one line each."""

from europa.spec.errors import UserError


class OverlapError(UserError):
    """``str(err)`` names the input, its value and what was expected, on one line."""
