"""A step's predicted time and its terms: compute by kind, the communication the step
waits for by collective, the pipeline's bubble and the optimizer step.

The pipeline is bound by its slowest rank: each of the step's M micro-batches passes
through it (its compute and its exposed tp, ep and cp collectives). The schedule adds
its bubble, at the pipeline's mean rank time: the schedule's own order played out
(``bubble_share``: 1F1B's P − 1, interleaving's about (P − 1)/V, less where ZBV and
DualPipeV fill it with weight-gradient work), a hidden state or its gradient crossing
between pipeline ranks at the point-to-point rate of the link it crosses. Where one
micro-batch's expert exchange runs beside another's compute
(``ep_overlap``, DualPipe's and DualPipeV's pairs), compute hides the generation's
``overlap`` share of it, up to the compute it pairs with: the exchange's kernels take
SMs and the pairing is not perfect. The data-parallel collectives'
exposed part and the optimizer step come once a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from europa.plan.comm_time import comm_by_rank, dp_seconds
from europa.plan.compute_time import compute_by_rank, optimizer_seconds
from europa.plan.links import p2p_seconds
from europa.plan.record import Run
from europa.plan.schedules import ORDER_OF, rank_orders
from europa.plan.simulate import simulate

# Beyond this many stage × micro-batch actions the schedule's order is not played out
# (its closed form stands in, and the plan says so): a step of millions of micro-batches
# would take that long to simulate.
MAX_SIMULATED_ACTIONS = 100_000
COMPUTE_KINDS = ("dense_gemm", "expert_gemm", "attention", "memory_bound", "recompute")


@dataclass(frozen=True)
class StepTime:
    """Seconds a step takes, and what they are made of (each a term of ``total``)."""

    terms: dict[str, float]
    slowest_rank: int
    bubble_from: str  # "simulated", "closed form" or "no stages"

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def bubble_share(run: Run, transfer: float = 0.0) -> tuple[float, str]:
    """The schedule's idle time, in mean rank times of one micro-batch, and how it was
    found: the schedule's own order played out (``europa.plan.simulate``: every stage of
    equal time, ``transfer`` the share of a rank's time a hidden state takes between
    ranks), or, where the schedule refuses the shape or it has more than
    ``MAX_SIMULATED_ACTIONS``, its closed form (1F1B's P − 1,
    interleaving's (P − 1)/V, a third of it with a split backward)."""
    lay = run.layout
    if lay.pp == 1:
        return 0.0, "no stages"
    schedule, micro = ORDER_OF[lay.schedule], run.micro_batches
    rounded = float(f"{transfer:.2g}")  # a fit's thousands of plans then share a few
    if lay.pp * lay.vp * micro <= MAX_SIMULATED_ACTIONS:
        try:
            return _simulated_bubble(schedule, lay.pp, lay.vp, micro, rounded), "simulated"
        except ValueError:
            pass
    if lay.schedule == "1f1b":
        return lay.pp - 1, "closed form"
    if lay.schedule == "interleaved":
        return (lay.pp - 1) / lay.vp, "closed form"
    return (lay.pp - 1) / (3 * lay.vp), "closed form"


@cache
def _simulated_bubble(schedule: str, pp: int, per_rank: int, micro: int, transfer: float) -> float:
    """The step less one rank's work, in a rank's micro-batch times: a stage takes
    1/per_rank of it, a hidden state between two ranks ``transfer`` (none within one)."""
    orders = rank_orders(schedule, pp, per_rank, micro)
    rank_of = {a.stage: r for r, order in orders.items() for a in order}
    played = simulate(
        orders,
        compute_s=lambda stage: 1 / per_rank,
        transfer_s=lambda a, b: transfer if rank_of[a] != rank_of[b] else 0.0,
    )
    return played.step_s - micro


def stage_transfer_seconds(run: Run) -> float:
    """One micro-batch's hidden state (or its gradient) from one pipeline rank to the
    next: the rank's tokens × the width in bf16, across the network where a pipeline
    rank's tp × cp × dp GPUs fill a domain (pp is the outermost axis)."""
    lay = run.layout
    crosses = lay.tp * lay.cp * lay.dp >= run.gpu.gpus_per_node
    return p2p_seconds(run.local_tokens * run.model.dim * 2, crosses, run.gpu, run.gpu.efficiencies)


def predict_step(run: Run) -> StepTime:
    compute = compute_by_rank(run)
    comm = comm_by_rank(run, compute)
    paired = run.ep_overlap or run.layout.schedule in ("dualpipe", "dualpipev")
    hides = run.gpu.efficiencies.overlap if paired else 0.0
    per_rank = []
    for c, k in zip(compute, comm, strict=True):
        ep = k.ep - hides * min(k.ep, c.total)
        per_rank.append((c, k, ep, c.total + k.tp + k.cp + ep))
    slowest = max(range(len(per_rank)), key=lambda r: per_rank[r][3])
    c, k, ep, _ = per_rank[slowest]
    m = run.micro_batches
    terms = {f"{kind}_s": getattr(c, kind) * m for kind in COMPUTE_KINDS}
    terms |= {"tp_exposed_s": k.tp * m, "ep_exposed_s": ep * m, "cp_exposed_s": k.cp * m}
    mean = sum(r[3] for r in per_rank) / len(per_rank)
    transfer = stage_transfer_seconds(run) / mean if run.layout.pp > 1 else 0.0
    share, bubble_from = bubble_share(run, transfer)
    terms["bubble_s"] = share * mean
    terms["dp_exposed_s"] = dp_seconds(run, compute).exposed
    terms["optimizer_step_s"] = optimizer_seconds(run)
    return StepTime(terms, slowest, bubble_from)
