"""Seconds a rank's training spends blocked in the expert exchange, with nothing computing
beside it: while an ``ExchangeClock`` exists (from its creation), every
``torch.distributed.all_to_all_single`` of this process is timed, a synchronous call whole,
an asynchronous one at its ``wait``.

A pipeline whose paired chunks run side by side (``europa.core.pipeline.paired``) runs a
backward in a second thread, named ``backward …``, while the training thread runs a
forward. A wait of one thread is hidden while the other computes. So the clock keeps
intervals: each thread's waits, each backward thread's life, and the training thread's
``join`` of it (where it idles once its forward is done). The exposed exchange is the time
the training thread is idle (waiting in the exchange or for the backward thread) while no
backward thread lives or the one that lives waits in the exchange too. Without a second
thread that is the training thread's own waits."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from _steps import Intervals, difference, intersect, length, union

BACKWARD_THREAD = "backward "  # europa.core.pipeline.paired's name prefix


class ExchangeClock:
    def __init__(self) -> None:
        import torch.distributed as dist

        self.training = threading.get_ident()
        self._spans: dict[str, Intervals] = defaultdict(list)  # "idle", "alive", "waits"
        self._original = dist.all_to_all_single
        dist.all_to_all_single = self._timed
        self._watch_backward_threads()

    def _record(self, kind: str, started: float) -> None:
        self._spans[kind].append((started, time.perf_counter()))

    def _blocked(self, started: float) -> None:
        mine = threading.get_ident() == self.training
        self._record("idle" if mine else "waits", started)

    def _timed(self, *args, async_op: bool = False, **kwargs):
        started = time.perf_counter()
        work = self._original(*args, async_op=async_op, **kwargs)
        self._blocked(started)
        return _TimedWork(work, self) if async_op else work

    def _watch_backward_threads(self) -> None:
        """A backward thread's life ("alive") and the training thread's ``join`` of it
        ("idle"), recorded by wrapping ``threading.Thread.run`` and ``join``."""
        for name, kind in (("run", "alive"), ("join", "idle")):
            setattr(threading.Thread, name, self._timed_thread_method(name, kind))

    def _timed_thread_method(self, name: str, kind: str):
        clock, method = self, getattr(threading.Thread, name)

        def timed(thread, *args, **kwargs):
            started = time.perf_counter()
            try:
                return method(thread, *args, **kwargs)
            finally:
                if thread.name.startswith(BACKWARD_THREAD):
                    clock._record(kind, started)

        return timed

    def take(self) -> float:
        """The exposed exchange since the last ``take`` (see the module's note)."""
        spans, self._spans = self._spans, defaultdict(list)
        idle, alive, waits = (union(spans[k]) for k in ("idle", "alive", "waits"))
        return length(difference(idle, alive)) + length(intersect(idle, waits))


class _TimedWork:
    def __init__(self, work, clock: ExchangeClock) -> None:
        self.work, self.clock = work, clock

    def wait(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.clock._blocked(started)
