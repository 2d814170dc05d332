"""Errors a user can cause. Each carries one line that names the key, the value
and what was expected; the CLI prints it without a traceback and exits 2.

A plugin marks its own user-facing errors the same way, through europa-spec's
``UserError`` (``europa_user_error = True``).
"""

from europa.spec.errors import UserError, is_user_error

__all__ = ["is_user_error"]


def one_line(err: BaseException | str) -> str:
    # splitlines, not split("\n"): a user's value may hold \r, \v, U+2028 and other breaks.
    return " ".join(str(err).splitlines())


class EuropaError(UserError):
    """Base of every user-facing error. ``str(err)`` is a single line."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class ConfigError(EuropaError):
    """A config key is unknown, has the wrong type or an impossible value."""


class PluginError(EuropaError):
    """Plugins conflict, are unknown, or break the hook contract."""


class LaunchError(EuropaError):
    """The distributed environment is incomplete or inconsistent."""


class CheckpointError(EuropaError):
    """A checkpoint is missing, incomplete or does not match the run."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint file's bytes differ from what was written (a checksum check)."""

    def __init__(self, file: str, problem: str) -> None:
        super().__init__(f"checkpoint file {file!r} is damaged: {problem}")
        self.file = file
        self.problem = problem

    def __reduce__(self):  # crosses ranks inside DCP's gathered failures
        return (type(self), (self.file, self.problem))


class RendezvousTimedOut(LaunchError):
    """Not every node joined the rendezvous in time; nothing was trained."""


class LaunchedRunError(EuropaError):
    """A user-facing error that a local worker hit, reported once by the launcher."""


class WorkerFailed(RuntimeError):
    """A local worker exited non-zero; it has printed its own error. Not a
    EuropaError: the cause may be a bug, and the exit code is the worker's."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class LostContact(WorkerFailed):
    """A collective failed or timed out on this rank: another rank died or hung.
    Not the user's error, but no bug here either: one line, exit 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 1)


class ResourceError(EuropaError):
    """The job cannot fit on the machine it was asked to run on."""
