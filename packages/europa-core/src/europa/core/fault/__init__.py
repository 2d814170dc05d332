"""Replica-level fault tolerance (``[fault_tolerance]``): replica groups that train as jobs
of their own and meet through torchft (``groups``), how they are launched and the
Lighthouse that forms their quorums (``launch``), and what a healing group receives
(``state``)."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_torchft() -> None:
    """torchft's Rust side logs every quorum and commit at INFO, and its manager warns at
    each reconfiguration that a CUDA flight recorder is missing; keep their warnings and
    errors, and drop two warnings about torch itself. Before torchft is imported: its Rust
    logger reads RUST_LOG once."""
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)
    # torchft 0.2.0's checkpoint transport, at every heal, on torch 2.13: a read-only
    # buffer it only reads, and a pytree check torch has deprecated
    for message, category in (("The given buffer is not writable", UserWarning),
                              (r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                               FutureWarning)):  # fmt: skip
        warnings.filterwarnings("ignore", message=message, category=category)
