"""Seconds a rank's training thread spends blocked in the expert exchange: while an
``ExchangeClock`` exists (from its creation), every ``torch.distributed.all_to_all_single`` of this
process is timed, a synchronous call whole, an asynchronous one at its ``wait``."""

from __future__ import annotations

import time


class ExchangeClock:
    """Seconds the training thread spends blocked in ``all_to_all_single``: a synchronous
    call, or the ``wait`` of an asynchronous one."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.blocked = 0.0
        self._original = dist.all_to_all_single
        dist.all_to_all_single = self._timed

    def _timed(self, *args, async_op: bool = False, **kwargs):
        started = time.perf_counter()
        work = self._original(*args, async_op=async_op, **kwargs)
        self.blocked += time.perf_counter() - started
        return _TimedWork(work, self) if async_op else work

    def take(self) -> float:
        blocked, self.blocked = self.blocked, 0.0
        return blocked


class _TimedWork:
    def __init__(self, work, clock: ExchangeClock) -> None:
        self.work, self.clock = work, clock

    def wait(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.clock.blocked += time.perf_counter() - started
