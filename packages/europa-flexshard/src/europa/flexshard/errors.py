"""Errors a caller can cause: impossible layouts and requests, one line each."""

from europa.spec.errors import UserError


class FlexShardError(UserError):
    """``str(err)`` names the input, its value and what was expected, on one line."""


class PlanError(FlexShardError):
    """An ownership plan that cannot be made."""
