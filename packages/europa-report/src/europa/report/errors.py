"""The one error a user can cause: a path that holds no run to report."""


class ReportError(ValueError):
    europa_user_error = True  # europa prints it as one line and exits 2
