"""Compute time: what one pipeline rank's GPU spends on one micro-batch, forward and
backward, by kind, and on the optimizer step once a step.

Each layer is its list of matrix multiplies by shape (``europa.plan.kernels``), on one
GPU's share (tp splits heads and hidden widths, sequence parallelism and cp split tokens,
experts receive the rows balanced routing sends them), its attention, and its
memory-bound work in bytes. Under the fp8 and mxfp8 recipes the layers' multiplies run at
the fp8 peak and read one-byte inputs after a cast (its bytes are memory-bound work);
the output head, the routers and attention stay in bf16, as Megatron-core's recipes keep
them. A recomputed module runs its forward once more (``recompute`` below).
"""

from __future__ import annotations

from dataclasses import dataclass

from europa.plan.kernels import Gemm, bytes_seconds, flops_seconds, gemm_seconds
from europa.plan.memory import memory_by_rank
from europa.plan.record import PRECISION_PEAK, Efficiencies, Gpu, Run
from europa.plan.shapes import padded_vocab
from europa.plan.stages import RankStage, rank_stages

BF16 = 2
ATTENTION_BACKWARD = 2.5  # FlashAttention's backward: five multiplies against two


@dataclass(frozen=True)
class ComputeTerms:
    """Seconds on one GPU: one micro-batch through a rank's layers, forward and backward."""

    dense_gemm: float
    expert_gemm: float
    attention: float
    memory_bound: float
    recompute: float  # the extra forward of what the run recomputes

    @property
    def total(self) -> float:
        return (
            self.dense_gemm + self.expert_gemm + self.attention + self.memory_bound + self.recompute
        )


@dataclass(frozen=True)
class _Work:
    """One layer's (or the head's) work on one GPU for one micro-batch."""

    gemms: tuple[tuple[str, str, Gemm], ...]  # (kind, module, multiply), kind dense or expert
    attention_flops: float  # forward
    moved: tuple[tuple[str, float], ...]  # (module, bytes) of memory-bound work, all passes


def layer_work(run: Run, moe_layer: bool) -> _Work:
    model, lay = run.model, run.layout
    tp, h = lay.tp, model.dim
    tokens, local = run.micro_batch_tokens, run.local_tokens
    gemms: list[tuple[str, str, Gemm]] = []
    dense = lambda module, n, k: gemms.append(("dense", module, Gemm(tokens, n, k)))  # noqa: E731
    if model.mla:
        n, qk = model.n_heads, model.qk_nope_head_dim + model.qk_rope_head_dim
        ql, kvl, dr = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
        if ql:
            dense("attention", ql, h)
            dense("mla_up_proj", n * qk / tp, ql)
        else:
            dense("attention", n * qk / tp, h)
        dense("attention", kvl + dr, h)
        # a gathered latent is up-projected for the whole sequence, every cp rank's rows
        kv_rows = tokens * lay.cp if lay.cp_exchange == "latent" else tokens
        kv_width = n * (model.qk_nope_head_dim + model.v_head_dim) / tp
        gemms.append(("dense", "mla_up_proj", Gemm(kv_rows, kv_width, kvl)))
        dense("attention", h, n * model.v_head_dim / tp)
        attention = 2 * tokens * run.seq_len / 2 * n / tp * (qk + model.v_head_dim)
        rotary = (n / tp + 1) * dr
    else:
        d, n, g = model.head_dim, model.n_heads, model.n_kv_heads
        dense("attention", d * (n + 2 * g) / tp, h)
        dense("attention", h, n * d / tp)
        attention = 2 * tokens * run.seq_len / 2 * n / tp * 2 * d
        rotary = (n + g) / tp * d
    moved = [("layernorm", 2 * 3 * 2 * BF16 * h * local), ("attention", 3 * 3 * BF16 * h * local)]
    moved.append(("mla_up_proj", 3 * 2 * BF16 * rotary * tokens))
    if moe_layer:
        e = model.num_experts
        rows = local * model.top_k * lay.etp  # rows this GPU's experts receive (balanced)
        per_expert = rows / (e / lay.ep)
        ffn = model.moe_hidden_dim / lay.etp
        gemms.append(("expert", "moe", Gemm(per_expert, 2 * ffn, h, count=e / lay.ep)))
        gemms.append(("expert", "moe", Gemm(per_expert, h, ffn, count=e / lay.ep)))
        if model.num_shared_experts:
            shared = model.num_shared_experts * model.moe_hidden_dim / tp
            dense("shared_experts", 2 * shared, h)
            dense("shared_experts", h, shared)
        gemms.append(("dense", "router", Gemm(local, e, h)))
        moved.append(("moe_act", 3 * 5 * BF16 * rows * ffn))  # SwiGLU with the router's weight
        moved.append(("moe", 3 * 4 * BF16 * rows * h))  # permute and unpermute, both ways
        moved.append(("moe", 3 * 4 * 4 * local * e))  # the router's scores, top-k, softmax
        if model.num_shared_experts:
            moved.append(("shared_experts", 3 * 5 * BF16 * tokens * shared))
    else:
        ffn = model.ffn_hidden_dim / tp
        dense("mlp", 2 * ffn, h)
        dense("mlp", h, ffn)
        moved.append(("mlp", 3 * 5 * BF16 * tokens * ffn))
    return _Work(tuple(gemms), attention, tuple(moved))


def head_work(run: Run) -> _Work:
    """The output head and loss of the last rank (and each MTP module's), bf16."""
    model, lay = run.model, run.layout
    tokens = run.micro_batch_tokens
    heads = 1 + model.mtp_modules
    vocab = padded_vocab(model, lay.tp) / lay.tp
    gemms = [("head", "head", Gemm(tokens, vocab, model.dim, count=heads))]
    if model.mtp_modules:
        eh = Gemm(tokens, model.dim, 2 * model.dim / lay.tp, count=model.mtp_modules)
        gemms.append(("dense", "head", eh))
    loss = 3 * 3 * 4 * tokens * vocab * heads  # fp32 logits: softmax and its gradient
    return _Work(tuple(gemms), 0.0, (("head", loss),))


def _seconds(run: Run, eff: Efficiencies, work: _Work, layers: int) -> dict[str, float]:
    gpu, recompute = run.gpu, run.layout.recompute
    layer_peak = PRECISION_PEAK[run.precision]
    fp8 = layer_peak != "bfloat16"
    out = dict.fromkeys(
        ("dense_gemm", "expert_gemm", "attention", "memory_bound", "recompute"), 0.0
    )
    for kind, module, gemm in work.gemms:
        low = fp8 and kind in ("dense", "expert") and module != "router"
        peak = gpu.peak_tflops[layer_peak if low else "bfloat16"]
        efficiency = eff.gemm[layer_peak if low else "bfloat16"]
        if kind == "expert":
            efficiency *= eff.grouped_gemm
        in_bytes = 1 if low else BF16
        passes = [
            gemm_seconds(g, peak, efficiency, gpu.hbm_tbps, gpu.sm_count, in_bytes)
            for g in gemm.passes()
        ]
        term = "expert_gemm" if kind == "expert" else "dense_gemm"
        out[term] += layers * sum(passes)
        if low:  # casting each pass's inputs to fp8: read bf16, write a byte
            cast = 3 * (gemm.m * gemm.k + gemm.m * gemm.n) * gemm.count
            out["memory_bound"] += layers * bytes_seconds(cast, gpu.hbm_tbps, eff.memory)
        if recompute.covers(module) or (recompute.kind == "full" and kind != "head"):
            out["recompute"] += layers * passes[0]
    attention = flops_seconds(work.attention_flops, gpu.peak_tflops["bfloat16"], eff.attention)
    out["attention"] += layers * attention * (1 + ATTENTION_BACKWARD)
    if recompute.covers("core_attn"):
        out["recompute"] += layers * attention
    for module, moved in work.moved:
        seconds = bytes_seconds(moved, gpu.hbm_tbps, eff.memory)
        out["memory_bound"] += layers * seconds
        if recompute.covers(module) or (recompute.kind == "full" and module != "head"):
            out["recompute"] += layers * seconds / 3  # the forward's share
    return out


def rank_compute(run: Run, stage: RankStage) -> ComputeTerms:
    """One micro-batch through one pipeline rank's layers (and its head, on the last)."""
    model, eff = run.model, efficiencies(run)
    dense_layers, moe_layers = stage.layer_counts(model)
    total = dict.fromkeys(
        ("dense_gemm", "expert_gemm", "attention", "memory_bound", "recompute"), 0.0
    )
    parts = [(False, dense_layers), (True, moe_layers)]
    works = [(layer_work(run, moe_layer=moe), count) for moe, count in parts if count]
    if stage.head:
        works.append((head_work(run), 1))
    for work, count in works:
        for term, seconds in _seconds(run, eff, work, count).items():
            total[term] += seconds
    return ComputeTerms(**total)


def optimizer_seconds(run: Run) -> float:
    """The optimizer step on the rank with the most state: its state read and written once
    (Adam: weights, gradients and two moments), memory-bound."""
    fullest = max(memory_by_rank(run), key=lambda p: p.optimizer + p.gradients)
    moved = 2 * (fullest.optimizer + fullest.gradients) * 2**30 + fullest.weights * 2**30
    return state_pass_seconds(moved, run.gpu)


def state_pass_seconds(moved_bytes: float, gpu: Gpu) -> float:
    """An optimizer step as europa-plan prices one: ``moved_bytes`` of state through HBM,
    memory-bound (Muon's Newton–Schulz multiplies are not counted)."""
    return bytes_seconds(moved_bytes, gpu.hbm_tbps, gpu_efficiencies(gpu).memory)


def attention_flops_seconds(flops: float, gpu: Gpu) -> float:
    """``flops`` of attention-shaped products (scores of queries against keys) in bf16, at
    the GPU's fitted attention efficiency (QK-clip's maxima beside a fused kernel)."""
    return flops_seconds(flops, gpu.peak_tflops["bfloat16"], gpu_efficiencies(gpu).attention)


def compute_by_rank(run: Run) -> list[ComputeTerms]:
    return [rank_compute(run, stage) for stage in rank_stages(run)]


def efficiencies(run: Run) -> Efficiencies:
    return gpu_efficiencies(run.gpu)


def gpu_efficiencies(gpu: Gpu) -> Efficiencies:
    if gpu.efficiencies is None:
        raise ValueError(f"gpu {gpu.id} was not read with its generation's efficiencies")
    return gpu.efficiencies
