"""Memory per GPU, by part, on the pipeline rank that needs the most.

* **weights**: bf16, the rank's share: dense matrices over tp, experts over ep × etp (each
  rank holds num_experts / ep whole experts, each over etp), embedding on the first rank,
  head and MTP modules on the last. ZeRO-3 (fsdp, hsdp) holds its stage's weights whole
  in bf16 once gathered with pipeline stages (they are not resharded between the
  micro-batches), and two layers at a time without.
* **gradients**: fp32 (Megatron's main gradients; FSDP's reduce dtype), sharded over the
  data-parallel group by fsdp and hsdp only (ZeRO-1 keeps the whole gradient buffer).
* **optimizer**: fp32 master weights and moments: Adam 12 bytes a parameter, Muon 8 (its
  one momentum) for the matrices and Adam for the embedding and head. With
  ``state_dtype = "bfloat16"`` the bf16 weights are trained directly: bf16 gradients and
  moments, no master copy. Sharded by zero1,
  fsdp and hsdp over the parameter's data-parallel group (dp × cp for dense parameters,
  tp × cp × dp / (ep × etp) for experts).
* **activations**: tensors saved for backward, per layer and token, as Megatron-core's
  layers save them (FlashAttention: queries, keys, values and output; a matrix
  multiply's input in its recipe's precision),
  less what the run's recompute gives back, times the micro-batches the schedule keeps
  in flight on that rank (``europa.plan.stages``); on the last rank the logits of one
  micro-batch (bf16, and the fp32 softmax the loss saves).
* **buffers**: the CUDA context, NCCL's and the expert dispatcher's buffers and cuBLAS
  workspaces, ``RUNTIME_GIB`` on every rank (an assumption, not a measurement).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from europa.plan.record import Model, Recompute, Run
from europa.plan.shapes import dense_ffn_macs, expert_macs, padded_vocab, router_macs
from europa.plan.stages import RankStage, micro_batches_in_flight, rank_stages

GIB = 2**30
BF16, FP32 = 2, 4
ADAM_STATE, MUON_STATE = 12, 8  # fp32 master weight + moments, bytes a parameter
RUNTIME_GIB = 2.5


@dataclass(frozen=True)
class MemoryPlan:
    """GiB per GPU on the rank that needs the most (``rank``)."""

    rank: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    micro_batches_in_flight: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers


@dataclass(frozen=True)
class _Params:
    """Parameters one rank holds, by how they are sharded and optimised."""

    dense: float  # over tp; data-parallel over dp × cp
    replicated: float  # whole on every tp rank (the routers)
    experts: float  # over ep × etp; data-parallel over expert_dp
    embedding: float  # embedding and head (always Adam)
    largest_layer: float  # what ZeRO-3 gathers at once without stages (two of them)


def attention_params(model: Model) -> int:
    h, n = model.dim, model.n_heads
    if model.mla:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        ql, kvl = model.q_lora_rank, model.kv_lora_rank
        q = h * ql + ql + ql * n * qk if ql else h * n * qk
        kv = (
            h * (kvl + model.qk_rope_head_dim)
            + kvl
            + kvl * n * (model.qk_nope_head_dim + model.v_head_dim)
        )
        return q + kv + n * model.v_head_dim * h + h
    d, g = model.head_dim, model.n_kv_heads
    return h * d * (n + 2 * g) + n * d * h + h + (2 * d if model.qk_norm else 0)


def rank_params(run: Run, stage: RankStage) -> _Params:
    model, lay = run.model, run.layout
    dense_layers, moe_layers = stage.layer_counts(model)
    layers = dense_layers + moe_layers
    attention = attention_params(model) / lay.tp
    dense_ffn = (dense_ffn_macs(model) + model.dim) / lay.tp
    shared = (model.num_shared_experts * expert_macs(model) + model.dim) / lay.tp
    experts = model.num_experts // lay.ep * expert_macs(model) / lay.etp if model.moe else 0
    dense = layers * attention + dense_layers * dense_ffn + moe_layers * shared
    if stage.head:  # the final norm; each MTP module's projection and its two norms
        dense += (
            model.dim + model.mtp_modules * (2 * model.dim * model.dim + 2 * model.dim)
        ) / lay.tp
    table = padded_vocab(model, lay.tp) * model.dim / lay.tp
    embedding = table * (stage.embedding + (stage.head and not model.tied_embeddings))
    largest = attention + max(
        dense_ffn if dense_layers else 0, shared + experts if moe_layers else 0
    )
    routers = moe_layers * router_macs(model)
    return _Params(dense, routers, moe_layers * experts, embedding, largest)


def activation_bytes_per_token(run: Run, moe_layer: bool) -> float:
    """Bytes one layer saves for backward per token of a micro-batch, on one GPU.

    A matrix multiply's input is saved as it runs: one byte under the fp8 and mxfp8
    recipes (Transformer Engine keeps the quantised copy for the weight gradient), bf16
    otherwise. The router's scores are applied inside the experts' activation (Megatron's
    weighted SwiGLU), so the experts' outputs are combined without being saved."""
    model, lay, rc = run.model, run.layout, run.layout.recompute
    tp, h = lay.tp, model.dim
    outside = tp if lay.sequence_parallel else 1  # tensors between the tp regions
    if rc.kind == "full":
        return BF16 * h / outside  # the layer's input only
    gemm_in = BF16 if run.precision == "bfloat16" else 1
    normed = 0 if rc.covers("layernorm") else gemm_in * h / outside  # a norm's output
    saved = BF16 * h / outside + normed  # the attention norm's input and output
    if model.mla:
        n, qk = model.n_heads, model.qk_nope_head_dim + model.qk_rope_head_dim
        ql, kvl, dr = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
        saved += BF16 * (ql + kvl + dr)  # the latents, before their norms
        if not rc.covers("layernorm"):
            saved += gemm_in * (ql + kvl)  # the latent norms' outputs
        if not rc.covers("mla_up_proj"):
            saved += BF16 * n * (2 * qk + model.v_head_dim) / tp  # q, k, v
        out = n * model.v_head_dim / tp
    else:
        d, n, g = model.head_dim, model.n_heads, model.n_kv_heads
        saved += BF16 * (n + 2 * g) * d / tp  # q, k, v
        if model.qk_norm and not rc.covers("layernorm"):
            saved += BF16 * (n + g) * d / tp
        out = n * d / tp
    saved += (BF16 + gemm_in) * out  # attention's output, also the output projection's input
    saved += BF16 * h / outside + normed  # the feed-forward norm's input and output
    if moe_layer:
        if rc.covers("moe"):
            return saved
        saved += 2 * FP32 * model.num_experts / outside  # router logits and scores
        rows = model.top_k * lay.etp / outside  # expert rows a token, gathered over etp
        ffn = model.moe_hidden_dim / lay.etp
        activation = 0 if rc.covers("moe_act") else gemm_in * ffn
        saved += rows * (gemm_in * h + BF16 * 2 * ffn + activation)  # fc1 in, fc1 out, act
        if model.num_shared_experts and not rc.covers("shared_experts"):
            shared = model.num_shared_experts * model.moe_hidden_dim / tp
            saved += (2 * BF16 + gemm_in) * shared
    elif not rc.covers("mlp"):
        saved += (2 * BF16 + gemm_in) * model.ffn_hidden_dim / tp  # fc1's gate and up, act
    return saved


def _rank_activations(run: Run, stage: RankStage) -> tuple[float, float]:
    """Bytes of activations the rank keeps at its peak, and the micro-batches in flight."""
    model, lay = run.model, run.layout
    tokens = run.micro_batch_tokens
    dense_layers, moe_layers = stage.layer_counts(model)
    per_micro_batch = tokens * (
        dense_layers * activation_bytes_per_token(run, moe_layer=False)
        + moe_layers * activation_bytes_per_token(run, moe_layer=True)
    )
    in_flight = micro_batches_in_flight(run, stage.rank)
    total = per_micro_batch * in_flight
    if lay.recompute.kind != "none":  # the layer being recomputed holds what it gave back
        plain = dataclasses.replace(run, layout=dataclasses.replace(lay, recompute=Recompute()))
        given_back = activation_bytes_per_token(plain, model.moe) - activation_bytes_per_token(
            run, model.moe
        )
        total += tokens * given_back
    if stage.head:
        heads = 1 + model.mtp_modules
        total += heads * tokens * padded_vocab(model, lay.tp) / lay.tp * (BF16 + FP32)
    return total, in_flight


def _state_bytes(run: Run, params: _Params) -> tuple[float, float, float]:
    """Weights, gradients and optimizer state: bytes on the rank."""
    lay, kind = run.layout, run.layout.modelled_data_parallel()
    dense_dp = lay.dp_shard * lay.cp if kind == "hsdp" else lay.dp * lay.cp
    expert_dp = lay.expert_dp
    if kind == "hsdp":
        expert_dp = max(1, expert_dp // (lay.dp // lay.dp_shard))
    if kind == "ddp":
        dense_dp = expert_dp = 1
    fp32 = run.state_dtype == "float32"
    # fp32: a master copy and fp32 moments; bf16: the bf16 weights are trained directly
    adam = ADAM_STATE if fp32 else 2 * BF16
    hidden = adam if run.optimizer == "adam" else (MUON_STATE if fp32 else BF16)
    grad = FP32 if fp32 else BF16
    dense = params.dense + params.replicated
    optimizer = (
        dense * hidden / dense_dp
        + params.experts * hidden / expert_dp
        + params.embedding * adam / dense_dp
    )
    held = dense + params.experts + params.embedding
    if kind in ("fsdp", "hsdp"):
        shards = (dense + params.embedding) / dense_dp + params.experts / expert_dp
        gathered = held if lay.pp > 1 else 2 * params.largest_layer
        weights = BF16 * gathered + (0 if fp32 else BF16 * shards)  # bf16: the shards too
        gradients = grad * shards
    else:
        weights, gradients = BF16 * held, grad * held
    return weights, gradients, optimizer


def plan_memory(run: Run) -> MemoryPlan:
    """The plan of the pipeline rank that needs the most memory."""
    return max(memory_by_rank(run), key=lambda p: p.total)


def memory_by_rank(run: Run) -> list[MemoryPlan]:
    plans = []
    for stage in rank_stages(run):
        params = rank_params(run, stage)
        weights, gradients, optimizer = _state_bytes(run, params)
        activations, in_flight = _rank_activations(run, stage)
        plans.append(
            MemoryPlan(
                rank=stage.rank,
                weights=weights / GIB,
                gradients=gradients / GIB,
                optimizer=optimizer / GIB,
                activations=activations / GIB,
                buffers=RUNTIME_GIB,
                micro_batches_in_flight=in_flight,
            )
        )
    return plans


def hbm_gib(run: Run) -> float:
    """The GPU's HBM as CUDA sees it: vendors' HBM "GB" are binary (stacks of 16 or 24 GiB)."""
    return float(run.gpu.hbm_gb)


def parameter_count(model: Model) -> int:
    """All of a model's parameters, MTP modules included (a MTP module: one layer, its
    2h→h projection and two norms; it shares the embedding and the head)."""
    layers = model.n_layers + model.mtp_modules
    n_dense = model.n_dense_layers if model.moe else layers
    n_moe = layers - n_dense
    ffn = dense_ffn_macs(model) + model.dim
    moe = (model.num_experts + model.num_shared_experts) * expert_macs(model) + model.dim
    moe += router_macs(model)
    tables = model.vocab_size * model.dim * (1 if model.tied_embeddings else 2)
    mtp = model.mtp_modules * (2 * model.dim * model.dim + 2 * model.dim)
    return layers * attention_params(model) + n_dense * ffn + n_moe * moe + tables + mtp + model.dim
