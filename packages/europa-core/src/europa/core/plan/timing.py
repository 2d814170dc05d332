"""Step time and MFU from hardware figures.

Model FLOPs per token: ``6 ×`` the matrix-multiply parameters a token touches
(the embedding is a lookup; of the routed experts, top-k of them), plus causal
attention, ``6 × heads × (qk + v head dims) × seq_len / 2`` per layer. Hardware
FLOPs add the forward again when blocks are recomputed. Compute time is
hardware FLOPs over ``peak × matmul_efficiency``; each link moves its bytes at
its bandwidth times its efficiency (the collective's own, where the profile has one).

Communication is exposed (adds to the step) unless it can overlap. Without
europa-overlap, the layouts prefetch parameter gathers and overlap gradient
reductions (FSDP2's own schedule); expert all-to-all, host copies and
optimizer-step traffic wait. With it, everything but optimizer-step traffic
runs beside compute, so a link exposes only what exceeds the compute time. Sums made
once a step (FlexShard's copies) run beside the last micro-batch's backward only, and
the one of the gradient that completes last after it. On CPU
ranks nothing overlaps: gloo moves the bytes with the same cores that compute
(``benchmarks/plan_accuracy.py`` measures it).

Host copies are timed one direction at a time, each at its own rate, and their seconds
add up against one budget, the host link's: offload copies out during forward and back
during backward, and the plan does not count on the two directions running at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from europa.core.config.schema import ModelConfig
from europa.core.plan.hardware import DEVICE_TO_HOST, HOST_TO_DEVICE
from europa.core.plan.shapes import ModelShapes
from europa.core.plan.traffic import HOST, Traffic
from europa.spec.plan_layout import LAST_BACKWARD

LAYOUT_OVERLAPPED = (
    "parameter_gather",
    "gradient_reduce_scatter",
    "gradient_replica_all_reduce",
    "expert_gradient_all_reduce",
)
# Links whose overlapped seconds add up against one budget (above).
BUDGET = {HOST_TO_DEVICE: HOST, DEVICE_TO_HOST: HOST}


def matmul_parameters_per_token(shapes: ModelShapes, m: ModelConfig) -> int:
    dense = sum(
        p.numel for p in shapes.parameters if len(p.shape) >= 2 and "tok_embeddings" not in p.name
    )
    routed = shapes.counts.routed_experts
    return dense - routed + routed * m.top_k // m.num_experts


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> int:
    per_layer = 6 * m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return per_layer * seq_len // 2 * m.n_layers


def model_flops_per_token(
    shapes: ModelShapes, m: ModelConfig, seq_len: int, layers: int | None = None
) -> int:
    """Training FLOPs per token of ``shapes`` (the whole model, or a pipeline rank's part
    holding ``layers`` of its layers)."""
    attention = attention_flops_per_token(m, seq_len)
    if layers is not None:
        attention = attention * layers // m.n_layers
    return 6 * matmul_parameters_per_token(shapes, m) + attention


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    link_s: dict[tuple[str, str], float]  # per (kind, link)
    exposed_s: float
    step_s: float
    mfu: float


def step_time(
    *,
    model_flops: float,
    hardware_flops: float,
    peak_flops: float,
    matmul_efficiency: float,
    traffic: list[Traffic],
    bandwidth: dict[tuple[str, str | None], float],  # bytes/s per (link, collective)
    overlapped_kinds: tuple[str, ...],
    micro_batches: int = 1,
) -> StepTime:
    compute = hardware_flops / (peak_flops * matmul_efficiency)
    # The last micro-batch's backward, its recomputed forward included: all but the
    # forward's third of the model FLOPs.
    last_backward = compute * (1 - model_flops / 3 / hardware_flops) / micro_batches
    rate = {(t.kind, t.link): bandwidth[t.link, t.collective] for t in traffic}
    seconds = {(t.kind, t.link): t.bytes_per_step / rate[t.kind, t.link] for t in traffic}
    per_link: dict[str, list[float]] = {}  # [all of it, last-backward only, tail]
    exposed = 0.0
    for t in traffic:
        if t.overlappable and t.kind in overlapped_kinds:
            link = per_link.setdefault(BUDGET.get(t.link, t.link), [0.0, 0.0, 0.0])
            link[0] += seconds[t.kind, t.link]
            if t.window == LAST_BACKWARD:
                link[1] += seconds[t.kind, t.link]
            link[2] += t.tail_bytes / rate[t.kind, t.link]
        else:
            exposed += seconds[t.kind, t.link]
    # A link exposes what exceeds the compute beside it, what of the last backward's sums
    # exceeds that backward, and at least what only starts when it ends.
    beyond = [max(s - compute, last - last_backward, tail) for s, last, tail in per_link.values()]
    exposed += max([0.0, *beyond])
    step = compute + exposed
    return StepTime(compute, seconds, exposed, step, model_flops / (step * peak_flops))
