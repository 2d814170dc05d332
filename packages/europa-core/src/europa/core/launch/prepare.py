"""Create the run directory of a new run, or check the one a resumed run continues: the
launcher's first act, before any rank starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from europa.core.errors import ConfigError
from europa.core.run_dir import CACHE, CONFIG_FILE, LOCK_FILE, write_replacing

if TYPE_CHECKING:
    from europa.core.config import EuropaConfig


def check_run_dir(
    config: EuropaConfig, run_dir: Path, *, resume: bool, from_older: bool = False
) -> tuple[int, Path] | None:
    """A new or empty directory (its data cache and lock aside), or on resume one with a checkpoint
    to continue from (with ``from_older``, an older one when newer ones are damaged).
    Returns that checkpoint (step, path): the launcher decides it here, once, and passes
    it down."""
    from europa.core.checkpoint.store import checkpoint_to_resume  # torch: only when training

    check_usable(run_dir)
    if resume:
        return checkpoint_to_resume(run_dir, config.training.steps, from_older=from_older)
    if run_dir.exists() and any(_holds_a_run(p) for p in run_dir.iterdir()):
        raise ConfigError(
            f"--run-dir = {str(run_dir)!r}: already holds a run; expected a new or empty "
            "directory, or --resume to continue it"
        )
    return None


def _holds_a_run(entry: Path) -> bool:
    """Anything but the data cache, the lock and an empty checkpoints folder (a replica
    group's, linked to its run's before the run's first save) is an earlier run's."""
    if entry.name in (CACHE, LOCK_FILE):
        return False
    return not (entry.name == "checkpoints" and entry.is_dir() and not any(entry.iterdir()))


def check_usable(run_dir: Path) -> None:
    """A directory, or a path whose nearest existing ancestor is a writable directory."""
    shown = repr(str(run_dir))
    try:
        nearest = next(path for path in (run_dir, *run_dir.parents) if path.exists())
        if not nearest.is_dir():
            where = "is a file" if nearest == run_dir else f"is under the file {str(nearest)!r}"
            raise ConfigError(f"--run-dir = {shown}: {where}; expected a directory")
        if not os.access(nearest, os.W_OK | os.X_OK):
            raise ConfigError(
                f"--run-dir = {shown}: {str(nearest)!r} is not writable; expected a directory "
                "this user may write"
            )
    except OSError as err:  # a name too long, a loop of links, ...
        raise ConfigError(f"--run-dir = {shown}: {err.strerror}; expected a usable path") from None


def prepare_run_dir(
    config: EuropaConfig,
    run_dir: Path,
    *,
    resume: bool,
    from_older: bool = False,
    checked: bool = False,
    keep_partials: bool = False,
) -> None:
    """Create (or, on resume, check and clear of unfinished saves) the run directory and
    write the resolved config. ``checked``: the caller has run ``check_run_dir`` (and
    decided the checkpoint); ``keep_partials``: other jobs may be saving into its
    checkpoints now (a replica group's)."""
    from europa.core.checkpoint.store import clear_partials
    from europa.core.config import config_to_toml

    if not checked:
        check_run_dir(config, run_dir, resume=resume, from_older=from_older)
    if resume and not keep_partials:
        clear_partials(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_replacing(run_dir / CONFIG_FILE, config_to_toml(config))
