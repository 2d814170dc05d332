"""Ctrl-C in the launching process while local workers train.

torch's elastic agent would forward a SIGINT and then wait for the workers, and a
second SIGINT during that wait only restarts the wait. So the launcher handles SIGINT
itself: the first is passed on to every worker (each runs in a session of its own, out
of the terminal's reach), which finishes its step and checkpoints (``train.stop``); the
second kills the workers and raises ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from types import FrameType

from europa.core.launch.casualty import kill_workers, live_workers


class ForwardedInterrupts:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.forwarded = False
        self._previous: object = None

    def __enter__(self) -> ForwardedInterrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        workers = live_workers(self.run_dir)
        if not self.forwarded and workers:
            self.forwarded = True
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGINT)
            return
        kill_workers(self.run_dir)
        raise KeyboardInterrupt
