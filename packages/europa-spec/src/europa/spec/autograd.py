"""What a hook needs to know of autograd's state, asked in one place.

torch exposes no public "is a backward running?"; its engine numbers each backward it runs
(``torch._C._current_graph_task_id``, -1 outside one), which is what a module's forward hook
reads to tell a recomputation (activation checkpointing reruns a block's forward inside the
backward) from the forward itself."""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward then is a
    recomputation, and a callback queued now (``queue_callback``) runs when it ends."""
    return torch._C._current_graph_task_id() != -1


__all__ = ["in_backward"]
