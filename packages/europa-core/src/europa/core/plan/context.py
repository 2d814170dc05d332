"""Context parallelism's terms in a plan (``parallel.cp``; ``europa.core.model.context_parallel``
is what runs).

A rank holds ``seq_len / cp`` rows of each of its micro-batch's sequences. Each MLA layer's
forward gathers what its queries attend to from the cp - 1 other ranks, and its backward
reduce-scatters that gradient: each sends this rank's rows once, ``(cp - 1) × rows ×
width`` numbers in the compute dtype. A recomputed forward gathers again. The latent
exchange's width is ``kv_lora_rank + qk_rope_head_dim`` and every rank up-projects the whole
sequence (``wkv_b`` on the cp - 1 others' rows too: hardware FLOPs the model's count
leaves out); the kv exchange's is every head's keys and values.

With europa-overlap each layer issues its gather before the query projection and waits after
it, and its backward runs beside the reduce-scatter: the exchange hides behind that work
(its share of the step's hardware FLOPs), not behind the whole step.
"""

from __future__ import annotations

from europa.core.config.schema import ModelConfig


def sequence_groups(parallel, world_size: int) -> int:
    """Groups of ranks reading different sequences: a pipeline's ranks read the same, and
    so do a context-parallel group's."""
    return world_size // (parallel.pp * parallel.cp)


def rows_per_micro_batch(config) -> int:
    """Token rows a rank computes per micro-batch: its share of each sequence."""
    t = config.training
    return t.batch_size * t.seq_len // config.parallel.cp


def exchange_width(m: ModelConfig, exchange: str) -> int:
    """Numbers a token sends per MLA layer in ``exchange``."""
    if exchange == "latent":
        return m.kv_lora_rank + m.qk_rope_head_dim
    # every head's keys (the rotary key once per head) and values
    return m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)


def exchange_bytes_per_pass(config, layers: int) -> int:
    """Bytes a rank sends in one pass of the exchange (the forward's gathers, or the
    backward's reduce-scatters) over ``layers`` layers, per optimizer step."""
    p, t = config.parallel, config.training
    if p.cp == 1:
        return 0
    itemsize = 2 if t.dtype == "bfloat16" else 4
    width = exchange_width(config.model, p.cp_exchange)
    per_layer = (p.cp - 1) * rows_per_micro_batch(config) * width * itemsize
    return per_layer * layers * t.grad_accum_steps


def upprojection_flops(config, layers: int) -> int:
    """The latent exchange's extra work per optimizer step: ``wkv_b`` forward and backward
    (6 FLOPs a multiply-add's weight a row) on the rows of the cp - 1 other ranks."""
    p, m = config.parallel, config.model
    if p.cp == 1 or p.cp_exchange != "latent":
        return 0
    weight = m.kv_lora_rank * m.n_heads * (m.qk_nope_head_dim + m.v_head_dim)
    others = (p.cp - 1) * rows_per_micro_batch(config)
    return 6 * weight * others * layers * config.training.grad_accum_steps


def query_projection_flops(config, layers: int) -> int:
    """One forward of the query projection (``wq``, or ``wq_a``, its norm and ``wq_b``) on a
    rank's rows per optimizer step: the work europa-overlap runs beside each layer's
    gather (its backward, twice this, beside the reduce-scatter)."""
    m = config.model
    out = m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    weight = m.dim * m.q_lora_rank + m.q_lora_rank * out if m.q_lora_rank else m.dim * out
    rows = rows_per_micro_batch(config)
    return 2 * weight * rows * layers * config.training.grad_accum_steps
