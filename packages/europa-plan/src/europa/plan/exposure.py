"""A step from the transfers a trainer states: compute, each transfer's seconds at its
link's rate, and what of them the step waits for.

europa-core plans europa's own runs this way: its technique plugins state every transfer
of a step (bytes, link, whether it can run beside compute and when), and this module
prices them, so europa-core keeps no time arithmetic of its own.

Compute comes one of two ways (``Compute``): from europa-plan's kernel model, fitted on
published runs (``kernel_compute``, for a GPU europa-plan knows), or as a step's hardware
FLOPs over a measured or assumed ``peak × efficiency`` (``flat_compute``: a CPU's measured
rates, a profile of the user's own). A transfer the step
does not overlap adds its seconds. Overlapped transfers add up per link (links named
with one ``budget`` share it: a host link's two directions, timed one at a time at
their own rates), and a link exposes what exceeds the compute beside it, what of the
sums issued in the last micro-batch's backward exceeds that backward, and at least what
only starts when it ends (its ``tail_bytes``). A transfer that can run beside only part of
the compute (``beside_s``: context parallelism's exchange beside the query projection)
exposes what exceeds that part.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from europa.plan.compute_time import ComputeTerms


@dataclass(frozen=True)
class Transfer:
    kind: str
    link: str
    bytes: float  # per step
    rate: float  # bytes/s on ``link`` for this transfer's collective
    overlapped: bool  # runs beside compute in this plan
    last_backward: bool = False  # issued only during the last micro-batch's backward
    tail_bytes: float = 0.0  # of ``bytes``, what starts only once that backward ends
    budget: str = ""  # links sharing one budget of seconds; empty: its own link's
    # The compute it can run beside, where that is less than the step's (issued before one
    # piece of work and waited for after it); what is left over the step waits for.
    beside_s: float | None = None

    @property
    def seconds(self) -> float:
        return self.bytes / self.rate


@dataclass(frozen=True)
class Compute:
    """A step's compute on one rank, recomputation included, and how it was priced."""

    seconds: float
    last_backward_s: float  # of it, the last micro-batch's backward and recomputed forward
    priced_by: str
    optimizer_s: float = 0.0  # the optimizer step after it, which nothing overlaps


def flat_compute(
    *, model_flops: float, hardware_flops: float, peak_flops: float, efficiency: float,
    micro_batches: int, priced_by: str,
) -> Compute:  # fmt: skip
    """``hardware_flops`` (``model_flops`` and the forward recomputed) at one rate; the
    last micro-batch's backward is all but the forward's third of the model FLOPs."""
    seconds = hardware_flops / (peak_flops * efficiency)
    forward = model_flops / 3 / hardware_flops if hardware_flops else 0.0
    last_backward = seconds * (1 - forward) / micro_batches
    return Compute(seconds, last_backward, priced_by)


def kernel_compute(
    terms: ComputeTerms, micro_batches: int, priced_by: str, optimizer_s: float = 0.0
) -> Compute:
    """One micro-batch's ``terms`` (``europa.plan.compute_time``) ``micro_batches`` times;
    the last one's backward is all but its forward's third of the work not recomputed."""
    forward = (terms.total - terms.recompute) / 3
    return Compute(terms.total * micro_batches, terms.total - forward, priced_by, optimizer_s)


def with_forward_work(compute: Compute, seconds: float, micro_batches: int, what: str) -> Compute:
    """``compute`` with ``seconds`` more in each micro-batch's forward (work beside the
    model's own, such as QK-clip's logit maxima): not in the last backward."""
    if seconds <= 0:
        return compute
    return replace(
        compute,
        seconds=compute.seconds + seconds * micro_batches,
        priced_by=f"{compute.priced_by}; {what}",
    )


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    link_s: dict[tuple[str, str], float]  # per (kind, link)
    exposed_s: float
    step_s: float
    mfu: float
    compute_priced_by: str = ""
    optimizer_s: float = 0.0  # of ``step_s``, the optimizer step (after the compute)
    last_backward_s: float = 0.0  # of the compute, what once-a-step sums may hide behind


def step_time(
    compute: Compute, transfers: Iterable[Transfer], *, model_flops: float, peak_flops: float
) -> StepTime:
    """One rank's step: its ``compute`` and ``transfers`` (see the module's note); MFU
    counts ``model_flops`` against ``peak_flops``."""
    transfers = list(transfers)
    last_backward = compute.last_backward_s
    per_budget: dict[str, list[float]] = {}  # [all of it, last-backward only, tail]
    exposed = 0.0
    for t in transfers:
        if t.overlapped:
            beside = t.seconds if t.beside_s is None else min(t.seconds, t.beside_s)
            exposed += t.seconds - beside
            budget = per_budget.setdefault(t.budget or t.link, [0.0, 0.0, 0.0])
            budget[0] += beside
            budget[1] += beside if t.last_backward else 0.0
            budget[2] += min(t.tail_bytes / t.rate, beside)
        else:
            exposed += t.seconds
    beyond = [
        max(s - compute.seconds, last - last_backward, tail)
        for s, last, tail in per_budget.values()
    ]
    exposed += max([0.0, *beyond])
    step = compute.seconds + exposed + compute.optimizer_s
    seconds = {(t.kind, t.link): t.seconds for t in transfers}
    mfu = model_flops / (step * peak_flops)
    return StepTime(
        compute.seconds,
        seconds,
        exposed,
        step,
        mfu,
        compute.priced_by,
        compute.optimizer_s,
        compute.last_backward_s,
    )


def pipeline_step_time(
    rank_step: StepTime,
    *,
    busy_s: float,
    step_s: float,
    extra: Iterable[Transfer] = (),
    model_flops: float,
    peak_flops: float,
    optimizer_s: float = 0.0,
) -> StepTime:
    """A pipeline's step, played out by its schedule (``europa.plan.simulate``): the
    busiest rank's ``busy_s`` is its compute, the rest of ``step_s`` what it waits for,
    and the slowest rank's ``optimizer_s`` follows; ``rank_step``'s transfers and the
    stages' ``extra`` ones (hidden states between ranks) are listed. MFU counts
    ``model_flops`` against every pipeline rank's ``peak_flops``."""
    link_s = dict(rank_step.link_s) | {(t.kind, t.link): t.seconds for t in extra}
    step = step_s + optimizer_s
    mfu = model_flops / (step * peak_flops) if step else 0.0
    how = rank_step.compute_priced_by
    last = rank_step.last_backward_s
    return StepTime(busy_s, link_s, step_s - busy_s, step, mfu, how, optimizer_s, last)
