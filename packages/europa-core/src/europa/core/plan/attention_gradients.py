"""What one MLA layer's backward holds beyond what it saved: the gradients its attention
kernel returns, alive while a block's backward runs (the ``block backward`` moments of
``europa.core.plan.moments``).

Design note. A fused kernel (SDPA on CUDA) returns the gradients of its queries, keys and
values, the size of its inputs. Over a whole 4k sequence that is a few hundred MiB; with
context parallelism every rank's keys and values are the whole sequence's, and at 128k
tokens they are GiB. ``europa plan --execute`` on the stand-in accelerator (debug with
Kimi-K2's 64 heads, 65,536 tokens, every block recomputed) shows what is alive at the
backward's peak:

* cp = 1: the kernel's query, key and value gradients;
* cp > 1: each of the rank's two chunks attends to the keys up to its last position
  (``europa.core.model.context_parallel``); both chunks' key and value gradients are alive
  together before they are summed into the whole sequence's, beside the gradient of the
  rank's rows of queries (sliced out of it: a whole-rows buffer) and one chunk's own.

Counted so, the executed device peak there is 0.93 (cp = 1), 0.98 (cp = 2) and 1.05
(cp = 4) of the planned one; without this term it was 1.36, 1.72 and 1.92.
Block-causal attention (``europa.core.model.attention``, the CPU's) keeps other buffers in
its backward (each query block's probabilities and their gradient): not counted here.
"""

from __future__ import annotations

from fractions import Fraction

from europa.core.config.schema import EuropaConfig


def attention_gradient_bytes(config: EuropaConfig, kernel: str) -> int:
    """Bytes of one layer's attention gradients on a rank for one micro-batch of ``config``
    (its sequences cut over ``parallel.cp`` ranks); ``kernel``: the hardware's."""
    if kernel != "fused":
        return 0
    m, t, cp = config.model, config.training, config.parallel.cp
    seq_len, dtype_bytes = t.seq_len, 2 if t.dtype == "bfloat16" else 4
    qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    rows = seq_len // cp
    if cp == 1:
        keys, query_rows = Fraction(seq_len), Fraction(rows)
    else:  # chunks r and 2cp - 1 - r end at positions (r + 1) and (2cp - r) chunks
        keys, query_rows = Fraction(seq_len * (2 * cp + 1), 2 * cp), Fraction(3 * rows, 2)
    per_head = keys * (qk + v) + query_rows * qk
    return int(t.batch_size * m.n_heads * dtype_bytes * per_head)
