"""The user-error marker: how any europa package says "the user asked for something
impossible" so that the CLI and the launcher print one line and exit 2, not a traceback.

An exception class says it with ``europa_user_error = True``; ``UserError`` is the
base every package's own error class derives from."""

from __future__ import annotations

USER_ERROR = "europa_user_error"


class UserError(ValueError):
    """A user's mistake (a bad setting, an impossible layout), told in one line that names
    the key, the value and what was expected."""

    europa_user_error = True


def is_user_error(err: BaseException) -> bool:
    """A user-facing error, from any europa package or plugin."""
    return getattr(err, USER_ERROR, False) is True


__all__ = ["USER_ERROR", "UserError", "is_user_error"]
