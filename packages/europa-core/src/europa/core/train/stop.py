"""Stop cleanly when the scheduler asks: finish the step, checkpoint, exit 0.

SLURM sends SIGTERM at the time limit (and ``--signal=USR1@<seconds>`` sends
SIGUSR1 ahead of it). A handler only records the request; at the end of each
step every rank reports whether it saw one (all-reduce MAX), so all ranks
stop after the same step even when only some of them were signalled.

With fault tolerance, each step also takes the maximum over the replica groups (through
torchft, before the step's vote), so every group stops after the same committed step
and one of them saves it.

Ctrl-C (SIGINT) asks the same; a second Ctrl-C stops at once (KeyboardInterrupt).
The local launcher forwards each Ctrl-C it gets to its workers, which run in sessions
of their own, so a worker sees one SIGINT per Ctrl-C.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from europa.core.launch.signals import SignalScope

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest(SignalScope):
    SIGNALS = STOP_SIGNALS

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._interrupted = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Record the request only."""
        if signum == signal.SIGINT and self._interrupted:
            raise KeyboardInterrupt
        self._interrupted = self._interrupted or signum == signal.SIGINT
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def agreed(self, device: torch.device, replicas=None) -> bool:
        """True on every rank once any rank has been signalled (a collective). With
        ``replicas`` (``europa.spec.replicas.ReplicaGroups``), on every rank of every group
        in this step's quorum: called before the step's vote, so all of them stop after
        the same committed step."""
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if replicas is not None:
            replicas.maximum(flag)
        return bool(flag.item())
