"""Signal handlers held for a scope: a stop recorded in training, passed on to workers,
or passed on to replica groups."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Self


class SignalScope:
    """While entered, ``_handle`` takes each of ``SIGNALS``; on exit the previous handlers
    come back. Only the main thread may set handlers: elsewhere nothing changes."""

    SIGNALS: tuple[signal.Signals, ...] = ()

    def __enter__(self) -> Self:
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        raise NotImplementedError
