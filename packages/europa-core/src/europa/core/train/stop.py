"""Stop cleanly when the scheduler asks: finish the step, checkpoint, exit 0.

SLURM sends SIGTERM at the time limit (and ``--signal=USR1@<seconds>`` sends
SIGUSR1 ahead of it). A handler only records the request; at the end of each
step every rank reports whether it saw one (all-reduce MAX), so all ranks
stop after the same step even when only some of them were signalled.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank has been signalled (a collective)."""
        flag = torch.tensor([1 if self.signal_name else 0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
