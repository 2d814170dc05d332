"""Saved activations: every tensor autograd keeps from forward to backward, per
block, itemised, for one micro-batch on one rank.

Design note. The list below is the set of tensors torchtitan 0.3.0's
DeepSeek-V3 block (as europa builds it: SDPA attention, MLA, routed + shared
experts) hands to ``saved_tensors_hooks``, one entry per distinct storage,
parameters excluded, as those hooks report it on CPU in fp32 and with bf16
parameters; ``tests/europa_core/test_plan_activations.py`` holds the two
together. What depends on the dtype:

* RMSNorm computes in fp32: it keeps an fp32 copy of its input (the input
  itself in an fp32 run), the fp32 rstd and the normalised fp32 input, and its
  output in the compute dtype.
* Attention ("math", SDPA's reference path, the one CPUs run) keeps q, kᵀ, the
  softmax probabilities (heads × seq_len per token: quadratic in the sequence)
  and v, all in fp32. Fused kernels ("fused", flash / memory-efficient on
  CUDA) keep q, k, v, the output and the fp32 log-sum-exp instead; that list
  follows the kernels' documented saves and has not been measured here.
  "block_causal" (``europa.core.model.attention``, what CPU runs use) keeps
  fp32 q, k, v and each query block's probabilities (keys up to the block's
  end only: about (chunks + 1) / (2 chunks) of the math path's).
* The router keeps fp32 scores in an fp32 run and compute-dtype ones with bf16
  parameters; the routed expert output is upcast to fp32 before it is scaled, and that
  copy is kept (``expert_output_bytes``: a layout's own dispatcher may keep the output as
  it is, as europa-flexshard's does).
* With context parallelism (``cp`` ranks a sequence, ``europa.core.model.context_parallel``)
  a token is one of a rank's rows: the attention's keys and values are the whole
  sequence's, cp per row, and so is the gathered latent that ``wkv_b`` keeps (the latent
  exchange, instead of the kv norm's output); a query block's probabilities span the keys
  up to its position in the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from europa.core.config.schema import ModelConfig

FP32 = 4
INT64 = 8
EXPERT_OFFSET_BYTES = 4  # int32 cumulative token counts, one per expert


@dataclass(frozen=True)
class SavedTensor:
    label: str
    bytes_per_token: int  # per token of the micro-batch


@dataclass(frozen=True)
class BlockActivations:
    name: str  # "layers.3", or "<root>" for embedding, final norm and loss
    tensors: tuple[SavedTensor, ...]
    input_bytes_per_token: int  # what full activation checkpointing keeps instead
    fixed_bytes: int = 0  # independent of the token count (the experts' offsets)

    @property
    def bytes_per_token(self) -> int:
        return sum(t.bytes_per_token for t in self.tensors)

    def saved_bytes(self, tokens: int) -> int:
        return self.bytes_per_token * tokens + self.fixed_bytes


def _norm(label: str, width: int, dtype_bytes: int, input_width: int | None = None):
    """RMSNorm: fp32 input copy (or the input itself), rstd, normalised input, output."""
    return [
        SavedTensor(f"{label}.input", (input_width or width) * FP32),
        SavedTensor(f"{label}.rstd", FP32),
        SavedTensor(f"{label}.normalised", width * FP32),
        SavedTensor(f"{label}.output", width * dtype_bytes),
    ]


def _block_causal_keys(seq_len: int, cp: int = 1) -> int:
    """Keys per query, on average over a rank's rows, that block-causal attention scores
    (every rank's rows score as many: the zig-zag cut)."""
    from europa.core.model.attention import DEFAULT_CHUNKS, causal_blocks
    from europa.core.model.zigzag import ZigZag

    rows = seq_len // cp
    segments = [(0, 0, seq_len)] if cp == 1 else ZigZag(cp, 0).segments(rows)
    bounds = causal_blocks(segments, DEFAULT_CHUNKS)
    return -(-sum((end - start) * key_end for start, end, key_end in bounds) // rows)  # ceil


def _attention(
    m: ModelConfig, a: int, seq_len: int, batch: int, kernel: str, cp: int = 1, exchange="latent"
) -> list[SavedTensor]:
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    h = m.n_heads
    out = _norm("attention_norm", m.dim, a)
    if m.q_lora_rank:
        out += _norm("q_norm", m.q_lora_rank, a)
    # In an fp32 run the kv norm keeps its input as the whole wkv_a output
    # (the rope part is a view of the same storage); with bf16 its fp32 copy.
    kv_input = m.kv_lora_rank + m.qk_rope_head_dim if a == FP32 else m.kv_lora_rank
    kv_norm = _norm("kv_norm", m.kv_lora_rank, a, input_width=kv_input)
    if cp > 1 and exchange == "latent":  # wkv_b keeps the gathered latent instead
        latent = m.kv_lora_rank + m.qk_rope_head_dim
        kv_norm[-1] = SavedTensor("context.gathered_latent", cp * latent * a)
    out += kv_norm
    if kernel == "math":
        # v is a view of wkv_b's output [.., heads, nope + v]; with one sequence
        # in fp32 the math path's reshape keeps that view (and its storage),
        # otherwise it copies v alone.
        v_width = m.qk_nope_head_dim + m.v_head_dim if batch == 1 and a == FP32 else m.v_head_dim
        out += [
            SavedTensor("sdpa.q", h * qk * FP32),
            SavedTensor("sdpa.k_transposed", cp * h * qk * FP32),
            SavedTensor("sdpa.probabilities", h * seq_len * FP32),
            SavedTensor("sdpa.v", cp * h * v_width * FP32),
        ]
    elif kernel == "block_causal":
        out += [
            SavedTensor("attention.q", h * qk * FP32),
            SavedTensor("attention.k", cp * h * qk * FP32),
            SavedTensor("attention.v", cp * h * m.v_head_dim * FP32),
            SavedTensor("attention.probabilities", h * _block_causal_keys(seq_len, cp) * FP32),
        ]
    else:
        out += [
            SavedTensor("sdpa.q", h * qk * a),
            SavedTensor("sdpa.k", cp * h * qk * a),
            SavedTensor("sdpa.v", cp * h * m.v_head_dim * a),
            SavedTensor("sdpa.output", h * m.v_head_dim * a),
            SavedTensor("sdpa.logsumexp", h * FP32),
        ]
    out.append(SavedTensor("wo.input", h * m.v_head_dim * a))
    return out


def _feed_forward(label: str, hidden: int, a: int) -> list[SavedTensor]:
    """SwiGLU: w1 and w3 outputs, silu(w1), their product (w2's input)."""
    return [SavedTensor(f"{label}.{part}", hidden * a) for part in ("w1", "w3", "silu", "w2_input")]


def _moe(m: ModelConfig, a: int, output_bytes: int) -> list[SavedTensor]:
    k = m.top_k
    score = FP32 if a == FP32 else a
    out = [
        SavedTensor("router.scores", m.num_experts * score),
        SavedTensor("router.top_indices", k * INT64),
        SavedTensor("router.denominator", score),
        SavedTensor("router.top_scores", k * score),
        SavedTensor("dispatch.token_indices", 2 * k * INT64),
        SavedTensor("experts.input", k * m.dim * a),
    ]
    out += _feed_forward("experts", k * m.moe_hidden_dim, a)
    out += [
        SavedTensor("experts.scores", k * a),
        SavedTensor("experts.output", k * m.dim * output_bytes),
    ]
    if m.num_shared_experts:
        out += _feed_forward("shared_experts", m.num_shared_experts * m.moe_hidden_dim, a)
    return out


def block_activations(
    m: ModelConfig,
    *,
    seq_len: int,
    batch: int,
    dtype_bytes: int,
    kernel: str = "math",
    cp: int = 1,
    exchange: str = "latent",
    expert_output_bytes: int = FP32,
) -> list[BlockActivations]:
    """Every block's saved tensors, then the root's (tokens and labels, final
    norm, the loss's fp32 log-probabilities over the vocabulary), per token of a rank's
    rows: with ``cp`` > 1, its seq_len / cp rows of each sequence, ``exchange`` gathered."""
    # A layout search asks again for every layout of the same model (the config is a
    # mutable dataclass: its repr, every field, is the key; the blocks are frozen).
    key = (repr(m), seq_len, batch, dtype_bytes, kernel, cp, exchange, expert_output_bytes)
    if key not in _ASKED:
        if len(_ASKED) >= 64:
            _ASKED.clear()
        blocks = _every_block(
            m, seq_len, batch, dtype_bytes, kernel, cp, exchange, expert_output_bytes
        )
        _ASKED[key] = tuple(blocks)
    return list(_ASKED[key])


_ASKED: dict[tuple, tuple[BlockActivations, ...]] = {}


def _every_block(
    m: ModelConfig,
    seq_len: int,
    batch: int,
    dtype_bytes: int,
    kernel: str,
    cp: int,
    exchange: str,
    expert_output_bytes: int,
) -> list[BlockActivations]:
    blocks = []
    for layer in range(m.n_layers):
        tensors = _attention(m, dtype_bytes, seq_len, batch, kernel, cp, exchange)
        tensors += _norm("ffn_norm", m.dim, dtype_bytes)
        if layer < m.n_dense_layers:
            tensors += _feed_forward("feed_forward", m.dense_hidden_dim, dtype_bytes)
        else:
            tensors += _moe(m, dtype_bytes, expert_output_bytes)
        fixed = 0 if layer < m.n_dense_layers else m.num_experts * EXPERT_OFFSET_BYTES
        blocks.append(
            BlockActivations(f"layers.{layer}", tuple(tensors), m.dim * dtype_bytes, fixed)
        )
    root = [
        SavedTensor("tokens", INT64),
        SavedTensor("labels", INT64),
        *_norm("norm", m.dim, dtype_bytes),
        SavedTensor("loss.log_probabilities", m.vocab_size * FP32),
    ]
    blocks.append(BlockActivations("<root>", tuple(root), 0))
    return blocks
