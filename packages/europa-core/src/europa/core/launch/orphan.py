"""A local worker ends when the ``europa train`` that started it does.

The workers run in sessions of their own (so that one Ctrl-C reaches each once, see
``interrupt``), and a launcher killed with SIGKILL cannot pass anything on: without this,
its workers would train on as orphans, writing the run directory that a ``--resume``,
now free to take the run directory's lock, is about to use. Each worker watches for its
parent to change (the launcher's pid comes in the environment, so a launcher dead before
the watch starts is seen too) and kills itself when it does."""

from __future__ import annotations

import os
import signal
import threading
import time

LAUNCHER_PID = "EUROPA_LAUNCHER_PID"
POLL_SECONDS = 0.2


def announce_launcher() -> None:
    """In the launcher, before it starts workers: they inherit its environment."""
    os.environ[LAUNCHER_PID] = str(os.getpid())


def exit_with_launcher() -> None:
    """In a worker: a daemon thread that SIGKILLs this process once its launcher is gone."""
    launcher = int(os.environ.get(LAUNCHER_PID) or os.getppid())

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(POLL_SECONDS)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="europa-launcher-watch", daemon=True).start()
