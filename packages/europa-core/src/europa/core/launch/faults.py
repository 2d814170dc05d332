"""A failed collective means another rank died or hung: say so in one line and exit.

Under the local launcher a dead worker is seen by torch's elastic agent, which stops the
others; across nodes (torchrun, SLURM) a surviving rank learns of it only from its next
collective, which fails when the peer's connection drops or times out after
``parallel.collective_timeout_s``. Either way the rank records ``lost-contact`` in its
progress file (so the launcher names the rank that died, not this one) and exits 1.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from europa.core.errors import LostContact, is_user_error
from europa.core.launch.progress import LOST_CONTACT, RankProgress

# gloo raises a plain RuntimeError whose message points into its transport code
# ("Connection reset by peer", "Timed out waiting 600000ms for recv ..."); NCCL and the
# store raise torch.distributed.DistError subclasses.
_GLOO_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer")


def root_exception(err: BaseException) -> BaseException:
    """The first rank's own error inside DCP's CheckpointException, else ``err``."""
    failures = getattr(err, "failures", None)
    if isinstance(err, CheckpointException) and failures:
        wrapped = next(iter(failures.values()))  # (exception, traceback frames)
        return wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return err


def is_lost_contact(err: BaseException) -> bool:
    err = root_exception(err)
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _GLOO_MARKERS)


def _gist(err: BaseException) -> str:
    """The first sentence, without gloo's source location: ``Read error [addr]: Connection
    reset by peer``."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(err).strip())
    first = text.splitlines()[0] if text else type(err).__name__
    return first.split(". ")[0]


@contextmanager
def reporting_faults(run_dir: Path, rank: int) -> Iterator[RankProgress]:
    """Around one rank's training: its progress file, and a failed collective turned
    into one line (``LostContact``)."""
    progress = RankProgress(run_dir, rank)
    try:
        yield progress
    except Exception as err:
        if not is_lost_contact(err):
            if not is_user_error(err):
                progress.mark("failed")
            raise
        progress.mark(LOST_CONTACT)
        raise LostContact(
            f"rank {rank} lost contact with the other ranks at step {progress.step} "
            f"({_gist(root_exception(err))}): another rank died or hung, see its "
            f"output; continue with: europa train --resume --run-dir {run_dir}"
        ) from None
