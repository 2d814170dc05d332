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

BACKWARD_THREAD = "backward "  # europa.core.pipeline.paired's name prefix

Intervals = list[tuple[float, float]]


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
        clock, run, join = self, threading.Thread.run, threading.Thread.join

        def timed_run(thread, *args, **kwargs):
            started = time.perf_counter()
            try:
                return run(thread, *args, **kwargs)
            finally:
                if thread.name.startswith(BACKWARD_THREAD):
                    clock._record("alive", started)

        def timed_join(thread, *args, **kwargs):
            started = time.perf_counter()
            try:
                return join(thread, *args, **kwargs)
            finally:
                if thread.name.startswith(BACKWARD_THREAD):
                    clock._record("idle", started)

        threading.Thread.run, threading.Thread.join = timed_run, timed_join

    def take(self) -> float:
        """The exposed exchange since the last ``take`` (see the module's note)."""
        spans, self._spans = self._spans, defaultdict(list)
        idle, alive, waits = (_union(spans[k]) for k in ("idle", "alive", "waits"))
        return _length(_subtract(idle, alive)) + _length(_intersect(idle, waits))


class _TimedWork:
    def __init__(self, work, clock: ExchangeClock) -> None:
        self.work, self.clock = work, clock

    def wait(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.clock._blocked(started)


def _union(spans: Intervals) -> Intervals:
    merged: Intervals = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    return [(max(s, t), min(e, f)) for s, e in a for t, f in b if max(s, t) < min(e, f)]


def _subtract(a: Intervals, b: Intervals) -> Intervals:
    out = []
    for start, end in a:
        for t, f in b:
            if f <= start or t >= end:
                continue
            if t > start:
                out.append((start, t))
            start = max(start, f)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def _length(spans: Intervals) -> float:
    return sum(end - start for start, end in spans)
