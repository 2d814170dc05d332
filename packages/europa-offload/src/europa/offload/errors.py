"""Errors a caller can cause, one line each."""

from europa.spec.errors import UserError


class OffloadError(UserError):
    """``str(err)`` names the setting, its value and what was expected, on one line."""


class HostMemoryExceeded(OffloadError):
    """Offloading would take more host memory than the budget allows."""
