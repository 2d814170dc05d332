"""Stop signals in the launching process while local workers train.

torch's elastic agent would forward a signal and then wait for the workers; a second
signal during that wait raises out of its shutdown (a batch system that signals every
process of a job, beside a fault-tolerant run's ``europa train`` passing its own stop to
each group, sends a group's launcher two), and a second SIGINT only restarts the wait.
So the launcher handles the stop signals itself, and each worker runs in a session of
its own, out of the terminal's reach:

* SIGTERM and SIGUSR1 (a batch system's stop, and its warning ahead of the time limit)
  are passed on to every worker, each time, and never raise here: each worker finishes
  its step and checkpoints (``train.stop``), and they exit 0.
* SIGINT (Ctrl-C): the first is passed on to every worker; the second kills them and
  raises ``KeyboardInterrupt``.

A stop before any worker has started raises torch's ``SignalException``, as the agent's
own handler would.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from types import FrameType

from europa.core.launch.casualty import kill_workers, live_workers
from europa.core.launch.signals import SignalScope

PASSED_ON = (signal.SIGTERM, signal.SIGUSR1)


class ForwardedInterrupts(SignalScope):
    SIGNALS = (signal.SIGINT, *PASSED_ON)

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.forwarded = False  # a Ctrl-C was passed on

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        workers = live_workers(self.run_dir)
        if signum in PASSED_ON:
            if not workers:
                from torch.distributed.elastic.multiprocessing.api import SignalException

                sig = signal.Signals(signum)
                raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
            _pass_on(workers, signum)
            return
        if not self.forwarded and workers:
            self.forwarded = True
            _pass_on(workers, signum)
            return
        kill_workers(self.run_dir)
        raise KeyboardInterrupt


def _pass_on(workers: list[int], signum: int) -> None:
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)
