"""The one error a planner's user sees: a bad runs file, told in one line."""

from __future__ import annotations


class PlanInputError(ValueError):
    """A runs file the planner refuses: one line naming the file, the table (the run,
    model or gpu), the key, the value and what was expected. The ``europa_user_error``
    marker is europa-spec's convention, so europa's command prints it without a
    traceback and exits 2 (europa-plan does not import europa-spec: it installs alone)."""

    europa_user_error = True

    def __str__(self) -> str:  # one line, whatever a file's values hold
        return " ".join(super().__str__().replace("\n", "\\n").split())
