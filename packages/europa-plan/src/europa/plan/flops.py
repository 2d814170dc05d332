"""FLOPs per token, two ways.

* ``source_flops_per_token``: the "model FLOPs" a source divides by its step time, in the
  run's ``flops_convention``, so a plan compares with a published TFLOP/s figure:

  - ``megatron`` (Megatron-LM's ``num_floating_point_operations``, copied by
    Megatron-Bridge's ``flop_utils``): 3× forward, 2 FLOPs a multiply-add, causal
    attention halved, a MTP module counted as one more layer of the last layer's kind
    with its norms, its 2h→h projection and its own output head, the latent norms of MLA
    counted as one MAC a latent element, the vocabulary padded to 128 × tp; routers,
    other norms and the embedding not counted;
  - ``nemo-automodel`` (NeMo AutoModel's ``flops_utils``): the same, less the latent-norm
    terms, with the vocabulary unpadded and MTP not counted (it reads ``mtp_num_layers``,
    which Hugging Face DeepSeek-V3 / Kimi-K2 configs do not have);
  - ``llama3-paper``: the paper does not state its count; it is counted as Megatron does.

* ``executed_flops``: what the GPUs execute, per kind: dense GEMMs, grouped expert GEMMs,
  attention, and the rest (memory-bound work at 1 FLOP an elementwise operation, a few a
  norm or softmax element), with recompute's extra forward. GEMMs run 3× forward (the
  input and weight gradients); attention 3.5× (FlashAttention's backward recomputes the
  scores: five matrix multiplies against the forward's two).
"""

from __future__ import annotations

from dataclasses import dataclass

from europa.plan.record import Run
from europa.plan.shapes import (
    attention_macs,
    dense_ffn_macs,
    elementwise,
    expert_macs,
    padded_vocab,
    router_macs,
    shared_macs,
)

FLOP_PER_MAC = 2
GEMM_PASSES = 3  # forward, input gradient, weight gradient
ATTENTION_PASSES = 3.5  # FlashAttention: forward 2 matmuls, backward 5
ELEMENTWISE_PASSES = 3  # a backward of an elementwise operation touches about twice as much
# FLOPs an element of each memory-bound operation costs, forward (a count, not a time:
# part 2 prices these by bytes moved).
NORM_FLOPS, ACTIVATION_FLOPS, ROTARY_FLOPS, SOFTMAX_FLOPS = 4, 4, 3, 5


def source_flops_per_token(run: Run) -> float:
    """The run's model FLOPs per token in its source's convention (see the module doc)."""
    model, s = run.model, run.seq_len
    automodel = run.flops_convention == "nemo-automodel"
    mtp = 0 if automodel else model.mtp_modules
    vocab = model.vocab_size if automodel else padded_vocab(model, run.layout.tp)
    n_layers = model.n_layers + mtp
    n_dense = model.n_dense_layers if model.moe else model.n_layers
    n_moe = n_layers - n_dense if model.moe else 0
    if not model.moe:
        n_dense += mtp
    attn = attention_macs(model, s)
    latent_norms = 0 if automodel or not model.mla else model.q_lora_rank + model.kv_lora_rank
    per_layer_attention = attn.projections + latent_norms + attn.core
    macs = (
        n_layers * per_layer_attention
        + n_dense * dense_ffn_macs(model)
        + n_moe * (model.top_k * expert_macs(model) + shared_macs(model))
        + mtp * (3 * model.dim + 2 * model.dim * model.dim)
        + (mtp + 1) * model.dim * vocab
    )
    return GEMM_PASSES * FLOP_PER_MAC * macs


@dataclass(frozen=True)
class ExecutedFlops:
    """FLOPs the GPUs execute per token of a step (forward, backward and recompute)."""

    dense_gemm: float
    expert_gemm: float
    attention: float
    other: float
    recompute: float  # of the above, recompute's extra forward

    @property
    def total(self) -> float:
        return self.dense_gemm + self.expert_gemm + self.attention + self.other


def executed_flops(run: Run) -> ExecutedFlops:
    model, s, recompute = run.model, run.seq_len, run.layout.recompute
    attn = attention_macs(model, s)
    n_layers = model.n_layers + model.mtp_modules  # a MTP module is a whole layer
    n_moe = (n_layers - model.n_dense_layers) if model.moe else 0
    n_dense = n_layers - n_moe
    kinds = {"dense_gemm": 0.0, "expert_gemm": 0.0, "attention": 0.0, "other": 0.0}
    extra = dict.fromkeys(kinds, 0.0)

    def add(kind: str, flops: float, passes: float, recomputed: bool, layers: int) -> None:
        kinds[kind] += layers * flops * passes
        if recomputed:
            extra[kind] += layers * flops

    mac = FLOP_PER_MAC
    for layers, moe_layer in ((n_dense, False), (n_moe, True)):
        if not layers:
            continue
        full = recompute.kind == "full"
        proj = attn.down_proj + attn.qkv_proj + attn.out_proj
        add("dense_gemm", mac * proj, GEMM_PASSES, full, layers)
        add("dense_gemm", mac * attn.up_proj, GEMM_PASSES, recompute.covers("mla_up_proj"), layers)
        add("attention", mac * attn.core, ATTENTION_PASSES, recompute.covers("core_attn"), layers)
        if moe_layer:
            moe = recompute.covers("moe")
            routed = mac * model.top_k * expert_macs(model)
            add("expert_gemm", routed, GEMM_PASSES, moe, layers)
            shared = recompute.covers("shared_experts") or moe
            add("dense_gemm", mac * shared_macs(model), GEMM_PASSES, shared, layers)
            add("dense_gemm", mac * router_macs(model), GEMM_PASSES, moe, layers)
        else:
            mlp = recompute.covers("mlp")
            add("dense_gemm", mac * dense_ffn_macs(model), GEMM_PASSES, mlp, layers)
        ew = elementwise(model, moe_layer)
        norms = recompute.covers("layernorm")
        add("other", NORM_FLOPS * ew.norms, ELEMENTWISE_PASSES, norms, layers)
        add("other", ACTIVATION_FLOPS * ew.activation, ELEMENTWISE_PASSES, full, layers)
        expert_act = recompute.covers("moe_act") or recompute.covers("moe")
        expert_ew = ACTIVATION_FLOPS * ew.expert_activation
        add("other", expert_ew, ELEMENTWISE_PASSES, expert_act, layers)
        rope = recompute.covers("mla_up_proj") or full
        add("other", ROTARY_FLOPS * ew.rotary, ELEMENTWISE_PASSES, rope, layers)
        add("other", SOFTMAX_FLOPS * ew.router + ew.residual, ELEMENTWISE_PASSES, full, layers)
    vocab = padded_vocab(model, run.layout.tp)
    heads = 1 + model.mtp_modules
    add("dense_gemm", mac * heads * model.dim * vocab, GEMM_PASSES, False, 1)
    add("dense_gemm", mac * model.mtp_modules * 2 * model.dim * model.dim, GEMM_PASSES, False, 1)
    add("other", SOFTMAX_FLOPS * heads * vocab, ELEMENTWISE_PASSES, False, 1)  # the loss
    for kind, flops in extra.items():
        kinds[kind] += flops
    return ExecutedFlops(**kinds, recompute=sum(extra.values()))


def published_step(run: Run) -> float | None:
    """The step the source reports, or the one its TFLOP/s imply (in its convention)."""
    if run.published.step_s is not None:
        return run.published.step_s
    if run.published.tflops_per_gpu is not None:
        flops = source_flops_per_token(run) * run.tokens_per_step / run.gpus
        return flops / (run.published.tflops_per_gpu * 1e12)
    return None
