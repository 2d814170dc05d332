"""Which layers each pipeline rank holds, and how many micro-batches' activations it
keeps at once under the run's schedule."""

from __future__ import annotations

from dataclasses import dataclass

from europa.plan.record import Model, Run
from europa.plan.schedules import ORDER_OF, stages_of_rank


@dataclass(frozen=True)
class RankStage:
    """One pipeline rank's share of the model."""

    rank: int
    layers: tuple[int, ...]  # indices into the model's layers (MTP modules after them)
    embedding: bool
    head: bool  # the output head, its loss and the MTP modules

    def layer_counts(self, model: Model) -> tuple[int, int]:
        """The dense and the MoE layers the rank runs, a MTP module (on the head's rank) as
        one more layer of the last layer's kind."""
        layers = len(self.layers) + (model.mtp_modules if self.head else 0)
        if not model.moe:
            return layers, 0
        dense = sum(1 for i in self.layers if i < model.n_dense_layers)
        return dense, layers - dense


def rank_stages(run: Run) -> tuple[RankStage, ...]:
    """Layers are cut into pp × vp chunks in order, as evenly as they go: a chunk with one
    layer more sits in the middle (the first and the last also hold the embedding and
    the head). Each chunk runs where the schedule places its stage
    (``europa.plan.schedules.stages_of_rank``: chunk c on rank c mod pp, or the V's r and
    2pp − 1 − r, which puts the head on rank 0)."""
    lay, n_layers = run.layout, run.model.n_layers
    chunks = lay.pp * lay.vp
    base, extra = divmod(n_layers, chunks)
    sizes = [base + (1 if 0 < c <= extra else 0) for c in range(chunks)]
    if extra == chunks - 1:  # every chunk but one has one more: the first is the short one
        sizes = [base, *[base + 1] * (chunks - 1)]
    order = ORDER_OF[lay.schedule]
    rank_of = {c: r for r in range(lay.pp) for c in stages_of_rank(order, r, lay.pp, lay.vp)}
    held: list[list[int]] = [[] for _ in range(lay.pp)]
    start = 0
    for chunk, size in enumerate(sizes):
        held[rank_of[chunk]].extend(range(start, start + size))
        start += size
    first, last = rank_of[0], rank_of[chunks - 1]
    return tuple(
        RankStage(rank, tuple(held[rank]), embedding=rank == first, head=rank == last)
        for rank in range(lay.pp)
    )


def micro_batches_in_flight(run: Run, rank: int) -> float:
    """Micro-batches whose activations rank ``rank`` holds at its peak, in units of one
    micro-batch through all of the rank's layers.

    1F1B: pp − rank (warm-up, then one in, one out). Interleaved (Megatron):
    2(pp − rank − 1) + (vp − 1)·pp + 1 chunk-sized micro-batches, a chunk being 1/vp of the
    rank's layers. ZBV holds pp; DualPipe and DualPipeV pp + 1 (DeepSeek-V3 report, s3.2.1).
    None more than the step's micro-batches."""
    lay, micro = run.layout, run.micro_batches
    if lay.pp == 1:
        return 1.0
    if lay.schedule == "1f1b":
        return float(min(micro, lay.pp - rank))
    if lay.schedule == "interleaved":
        chunks = min(micro * lay.vp, 2 * (lay.pp - rank - 1) + (lay.vp - 1) * lay.pp + 1)
        return chunks / lay.vp
    if lay.schedule == "zbv":
        return float(min(micro, lay.pp))
    return float(min(micro, lay.pp + 1))  # dualpipe, dualpipev
