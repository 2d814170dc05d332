"""A step's predicted time and its terms: compute by kind, the communication the step
waits for by collective, the pipeline's bubble and the optimizer step.

The pipeline is bound by its slowest rank: each of the step's M micro-batches passes
through it (its compute and its exposed tp, ep and cp collectives). The schedule adds
its bubble: 1F1B's P − 1 stage times, interleaving's (P − 1)/V, at the pipeline's mean
rank time; ZBV and DualPipeV, which fill the bubble with weight-gradient work, about a
third of it. Where one micro-batch's expert exchange runs beside another's compute
(``ep_overlap``, DualPipe's and DualPipeV's pairs), compute hides the generation's
``overlap`` share of it, up to the compute it pairs with: the exchange's kernels take
SMs and the pairing is not perfect. The data-parallel collectives'
exposed part and the optimizer step come once a step.
"""

from __future__ import annotations

from dataclasses import dataclass

from europa.plan.comm_time import comm_by_rank, dp_seconds
from europa.plan.compute_time import compute_by_rank, optimizer_seconds
from europa.plan.record import Run

COMPUTE_KINDS = ("dense_gemm", "expert_gemm", "attention", "memory_bound", "recompute")


@dataclass(frozen=True)
class StepTime:
    """Seconds a step takes, and what they are made of (each a term of ``total``)."""

    terms: dict[str, float]
    slowest_rank: int

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def bubble_share(run: Run) -> float:
    """The schedule's idle time, in mean rank times of one micro-batch."""
    lay = run.layout
    if lay.pp == 1:
        return 0.0
    if lay.schedule == "1f1b":
        return lay.pp - 1
    if lay.schedule == "interleaved":
        return (lay.pp - 1) / lay.vp
    return (lay.pp - 1) / (3 * lay.vp)  # zbv, dualpipev, dualpipe: B/W split fills most


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
    terms["bubble_s"] = bubble_share(run) * mean
    terms["dp_exposed_s"] = dp_seconds(run, compute).exposed
    terms["optimizer_step_s"] = optimizer_seconds(run)
    return StepTime(terms, slowest)
