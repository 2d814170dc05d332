"""FLOPs per token, and a step's compute and transfers handed to europa-plan to be priced.

Model FLOPs per token: ``6 ×`` the matrix-multiply parameters a token touches
(the embedding is a lookup; of the routed experts, top-k of them), plus causal
attention, ``6 × heads × (qk + v head dims) × seq_len / 2`` per layer. Hardware
FLOPs add the forward again when blocks are recomputed.

The time is europa-plan's (``europa.plan.exposure``). Compute: on a GPU europa-plan knows
(the profile's ``fitted_gpu``), bfloat16 training is its kernel model fitted on published
runs, for the layers the rank holds; otherwise (a CPU, a profile of the user's own,
float32) the hardware FLOPs at the profile's measured or assumed rate. Each kind of
traffic becomes a
transfer at its link's rate (the collective's own, where the profile has one), overlapped
or not, and europa-plan says what of it the step waits for. Without europa-overlap, the
layouts prefetch parameter gathers and overlap gradient reductions (FSDP2's own
schedule); expert all-to-all, host copies and optimizer-step traffic wait. With it,
everything but optimizer-step traffic runs beside compute. Sums made once a step
(FlexShard's copies) run beside the last micro-batch's backward only. On CPU ranks
nothing overlaps: gloo moves the bytes with the same cores that compute
(``benchmarks/plan_accuracy.py`` measures it). A host link's two directions share one
budget: offload copies out during forward and back during backward, and the plan does
not count on the two running at once.
"""

from __future__ import annotations

from europa.core.config.schema import EuropaConfig, ModelConfig
from europa.core.plan.hardware import DEVICE_TO_HOST, HOST_TO_DEVICE, HardwareProfile
from europa.core.plan.plan_record import compute_record
from europa.core.plan.shapes import ModelShapes
from europa.core.plan.traffic import HOST, Traffic
from europa.plan.compute_time import attention_flops_seconds, state_pass_seconds
from europa.plan.compute_time import rank_compute as rank_compute_terms
from europa.plan.exposure import (
    Compute,
    Transfer,
    flat_compute,
    kernel_compute,
    with_forward_work,
)
from europa.plan.stages import RankStage
from europa.spec.logit_max import score_block_elements
from europa.spec.plan_layout import LAST_BACKWARD, QUERIES_BACKWARD, QUERIES_FORWARD
from europa.spec.qk_clip import maxima_bytes

LAYOUT_OVERLAPPED = (
    "parameter_gather",
    "gradient_reduce_scatter",
    "gradient_replica_all_reduce",
    "expert_gradient_all_reduce",
)
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


def logit_max_flops(config: EuropaConfig, hardware: HardwareProfile, layers: int) -> float:
    """QK-clip's maxima, one micro-batch of ``layers`` layers: with a fused attention kernel
    (a GPU), the causal scores computed again beside it, forward only (a recomputation does
    not record); with block-causal attention (a CPU), nothing (the kernel's own scores)."""
    if not _maxima_beside_kernel(config, hardware):
        return 0.0
    m, t = config.model, config.training
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    rows = t.seq_len / config.parallel.cp  # a rank's queries, each over half the keys
    return 2.0 * t.batch_size * m.n_heads * qk * rows * t.seq_len / 2 * layers


def _maxima_beside_kernel(config: EuropaConfig, hardware: HardwareProfile) -> bool:
    """Whether QK-clip's maxima compute the scores again beside the attention kernel (a
    fused one returns none; block-causal attention records from its own)."""
    return config.optimizer.qk_clip and hardware.attention_kernel != "block_causal"


def logit_max_scores_bytes(config: EuropaConfig, hardware: HardwareProfile) -> int:
    """The largest block of scores QK-clip's maxima compute beside a fused kernel
    (``europa.spec.logit_max``), alive in a block's forward beside what it saves."""
    if not _maxima_beside_kernel(config, hardware):
        return 0
    m, t = config.model, config.training
    elements = score_block_elements(t.batch_size, m.n_heads, t.seq_len // config.parallel.cp,
                                    t.seq_len)  # fmt: skip
    return elements * (2 if t.dtype == "bfloat16" else 4)


def clip_maxima(config: EuropaConfig, ranks: int) -> tuple[int, int]:
    """QK-clip's maxima: their bytes and the ranks that reduce them (``step_traffic``)."""
    if not config.optimizer.qk_clip:
        return (0, 1)
    return (maxima_bytes(config.model.n_layers, config.model.n_heads), ranks)


def rank_compute(
    config: EuropaConfig,
    hardware: HardwareProfile,
    world_size: int,
    *,
    model_flops: float,
    hardware_flops: float,
    state_bytes: int,
    layers: tuple[int, ...] | None = None,
    head: bool = True,
    maxima_flops: float = 0.0,
) -> Compute:
    """One rank's compute for a step: europa-plan's kernel model, fitted on published
    runs, where ``hardware`` names its GPU and the run trains in bfloat16, and its
    optimizer step, the rank's ``state_bytes`` (parameters, gradients, optimizer state)
    read and written once; else the step's FLOPs at the profile's one rate (a CPU's
    measured one, a profile of the user's own, float32 training), the optimizer step not
    priced. ``layers`` (indices) and ``head``: a pipeline rank's share. ``maxima_flops``:
    QK-clip's maxima a micro-batch (``logit_max_flops``), forward work beside the model's,
    at the fitted attention efficiency (or the profile's rate)."""
    training = config.training
    micro = training.grad_accum_steps
    if hardware.fitted_gpu and training.dtype == "bfloat16":
        run = compute_record(config, hardware.fitted_gpu, world_size)
        held = tuple(range(config.model.n_layers)) if layers is None else layers
        stage = RankStage(0, held, embedding=layers is None or 0 in held, head=head)
        eff = run.gpu.efficiencies
        how = f"europa-plan's {eff.id} fit, kernel by kernel ({eff.fitted})"
        optimizer = state_pass_seconds(2 * state_bytes, run.gpu)
        compute = kernel_compute(rank_compute_terms(run, stage), micro, how, optimizer)
        maxima_s = attention_flops_seconds(maxima_flops, run.gpu)
        return with_forward_work(compute, maxima_s, micro, "QK-clip's maxima beside SDPA")
    why = "not fitted" if hardware.fitted_gpu else "the profile's"
    return flat_compute(
        model_flops=model_flops,
        hardware_flops=hardware_flops + maxima_flops * micro,
        peak_flops=hardware.peak_flops(training.dtype),
        efficiency=hardware.matmul_efficiency,
        micro_batches=micro,
        priced_by=f"{training.dtype} at matmul_efficiency {hardware.matmul_efficiency:g} "
        f"of the peak ({why}); the optimizer step not priced",
    )


def transfers(
    traffic: list[Traffic],
    hardware: HardwareProfile,
    overlapped_kinds: tuple[str, ...],
    windows: dict[str, float] | None = None,
) -> list[Transfer]:
    """``traffic`` as europa-plan prices it: each at ``hardware``'s rate for its link and
    collective, overlapped where its kind is in ``overlapped_kinds`` and it can be.
    ``windows``: the seconds of compute a window narrower than the step holds
    (``query_windows``)."""
    windows = windows or {}
    return [
        Transfer(
            kind=t.kind,
            link=t.link,
            bytes=t.bytes_per_step,
            rate=hardware.bandwidth(t.link, t.collective),
            overlapped=t.overlappable and t.kind in overlapped_kinds,
            last_backward=t.window == LAST_BACKWARD,
            tail_bytes=t.tail_bytes,
            budget=BUDGET.get(t.link, ""),
            beside_s=windows.get(t.window),
        )
        for t in traffic
    ]


def query_windows(
    compute: Compute, queries_flops: float, hardware_flops: float, recomputed: bool
) -> dict[str, float]:
    """The seconds context parallelism's early exchange runs beside: the query projection's
    forward (``queries_flops``, once more when recomputed) and its backward (twice that), as
    their share of the step's ``hardware_flops`` priced at ``compute``'s seconds."""
    if not hardware_flops:
        return {}
    forward = compute.seconds * queries_flops / hardware_flops
    return {
        QUERIES_FORWARD: forward * (2 if recomputed else 1),
        QUERIES_BACKWARD: 2 * forward,
    }
