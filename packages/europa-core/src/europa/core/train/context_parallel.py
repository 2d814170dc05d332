"""``parallel.cp`` in the trainer: each group of ``cp`` data-parallel ranks reads the same
sequences, each rank keeps its zig-zag rows of them, and every MLA layer gathers what its
queries attend to from the group (``europa.core.model.context_parallel``).

Everything past attention sees tokens: the MoE layer routes this rank's rows; the loss is
this rank's mean, and as every rank holds as many rows, the data-parallel average of those
means is the global batch's mean, as without cp.
"""

from __future__ import annotations

import dataclasses

import torch

from europa.core.config.values import fail
from europa.core.launch.distributed import context_parallel_group
from europa.core.model.context_parallel import ContextParallel
from europa.core.model.mla import ContextParallelMLA
from europa.core.model.zigzag import ZigZag
from europa.spec.job import CONTEXT_GATHER_EARLY


class _RowsOfRank:
    """A batch source whose ``batch(...)`` gives (inputs, labels, ...) of whole sequences,
    cut to this rank's rows."""

    def __init__(self, source, zigzag: ZigZag) -> None:
        self._source, self._zigzag = source, zigzag

    def __getattr__(self, name: str):
        return getattr(self._source, name)

    def batch(self, *args):
        inputs, labels, *rest = self._source.batch(*args)
        return self._zigzag.cut(inputs), self._zigzag.cut(labels), *rest


def enable(job, model: torch.nn.Module) -> ContextParallel:
    """Join this rank's context-parallel group (a collective) and set every MLA layer to
    attend across it."""
    parallel = job.config.parallel
    attentions = [m for m in model.modules() if hasattr(m, "kv_lora_rank")]
    others = [type(m).__name__ for m in attentions if not isinstance(m, ContextParallelMLA)]
    if others:  # a plugin's own model
        why = f"1 with {others[0]} attention (context parallelism runs europa's MLA)"
        raise fail("parallel.cp", parallel.cp, why)
    group, rank = context_parallel_group(job.mesh, parallel.cp)
    early = bool(job.state.get(CONTEXT_GATHER_EARLY))  # europa-overlap's
    context = ContextParallel(
        group, ZigZag(parallel.cp, rank), parallel.cp_exchange, gather_early=early
    )
    for attention in attentions:
        attention.context_parallel = context
    return context


def cut_batches(batches, context: ContextParallel):
    """``train.batches.Batches`` whose training and validation batches are this rank's rows."""
    validation = batches.validation
    return dataclasses.replace(
        batches,
        source=_RowsOfRank(batches.source, context.zigzag),
        validation=None if validation is None else _RowsOfRank(validation, context.zigzag),
    )
