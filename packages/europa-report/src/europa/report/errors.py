"""The one error a user can cause: a path that holds no run to report."""

from europa.spec.errors import UserError


class ReportError(UserError):
    """europa prints it as one line and exits 2."""
