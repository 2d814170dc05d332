"""Each head's largest pre-softmax logit over a step's training forwards, for QK-clip
(``europa.spec.qk_clip``), beside any causal attention: torch only, so europa's trainer
and the torchtitan adapters arm attentions alike.

An inner attention module (torchtitan's convention: ``forward(q, k, v, *, scale=...)``
with (batch, sequence, heads, dim) tensors, causal) records only when armed (``arm``: a
``LogitMax`` in its ``logit_max`` attribute) and the forward is a training forward: the
module in training mode, gradients on, and not inside backward, so an
activation-checkpointing recomputation does not record again and evaluation
(``model.eval()``, ``torch.no_grad()``) never does.

A kernel that computes the scores itself (``records_logit_max = True`` on its class, as
europa-core's block-causal attention) records from them. Any other (SDPA, whose fused
kernels return no maximum) gets a forward pre-hook that computes the causal scores again,
without gradients, a block of query rows at a time, so that no whole sequence × sequence
matrix per head exists.
"""

from __future__ import annotations

import torch

from europa.spec.tags import mark_memory

# The elements of one block of scores computed beside a fused kernel: 256 Mi (512 MiB in
# bf16). A block's few kernel launches cost about what a small block's product does: at
# 128k tokens with context parallelism over 8 ranks, 16 Mi made blocks of 2 query rows, 4 M
# blocks a step of the seed; 256 Mi makes blocks of 32 rows.
SCORE_BLOCK_ELEMENTS = 1 << 28


def _block_rows(batch: int, heads: int, rows: int, keys: int) -> int:
    """Query rows a block of ``causal_score_max`` takes of ``rows`` over ``keys`` keys."""
    return min(rows, max(1, SCORE_BLOCK_ELEMENTS // (batch * heads * keys)))


def score_block_elements(batch: int, heads: int, rows: int, keys: int) -> int:
    """The elements of the largest block ``causal_score_max`` makes for ``rows`` queries
    over ``keys`` keys (what it holds beside the attention's inputs)."""
    return batch * heads * _block_rows(batch, heads, rows, keys) * keys


class LogitMax:
    """One attention's maxima: a float32 (n_heads,) tensor, -inf until a forward records."""

    def __init__(self, n_heads: int) -> None:
        self.n_heads = n_heads
        self.value: torch.Tensor | None = None

    def reset(self) -> None:
        self.value = None

    def read(self) -> torch.Tensor:
        if self.value is None:
            return torch.full((self.n_heads,), float("-inf"))
        return self.value.detach().float().cpu()

    def observe(self, scores: torch.Tensor, batch: int) -> None:
        """``scores``: head-major (batch · n_heads, rows, keys), masked entries -inf."""
        self.record(scores.detach().amax(dim=(1, 2)).view(batch, self.n_heads).amax(0))

    def record(self, per_head: torch.Tensor) -> None:
        """``per_head``: (n_heads,) maxima of one forward's scores."""
        self.value = per_head if self.value is None else torch.maximum(self.value, per_head)


def recorder(inner_attention: torch.nn.Module) -> LogitMax | None:
    """The armed ``LogitMax`` of ``inner_attention`` if this forward is one to record."""
    armed = getattr(inner_attention, "logit_max", None)
    if armed is None or not inner_attention.training or not torch.is_grad_enabled():
        return None
    if torch._C._current_graph_task_id() != -1:  # inside backward: a recomputation
        return None
    return armed


@torch.no_grad()
def causal_score_max(q_BLNH, k_BLNH, scale: float, into: LogitMax) -> None:
    """Record the causal scores' maxima of (B, L, N, H) queries and keys, in blocks of rows.
    Fewer queries than keys are the last positions (context parallelism's chunks). A block
    of rows sees every key before its first row's position unmasked; only its last keys, as
    many as its rows, need the triangle masked (made once)."""
    batch, seq_len, heads, _ = q_BLNH.shape
    if seq_len == 0:
        return
    offset = k_BLNH.size(1) - seq_len  # the first query's position
    q, k = q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2)  # (B, N, L, H)
    rows = _block_rows(batch, heads, seq_len, k_BLNH.size(1))
    later = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu(1)
    largest = torch.full((batch, heads), float("-inf"), dtype=q.dtype, device=q.device)
    for start in range(0, seq_len, rows):
        end = min(seq_len, start + rows)
        keys, n = offset + end, end - start
        scores = torch.matmul(q[:, :, start:end], k[:, :, :keys].mT).mul_(scale)
        mark_memory(scores, "attention_scores")
        scores[..., keys - n :].masked_fill_(later[:n, :n], float("-inf"))
        torch.maximum(largest, scores.amax(dim=(2, 3)), out=largest)
    into.record(largest.amax(0))


def _beside(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The pre-hook: the maxima of the queries and keys the attention is about to take."""
    into = recorder(module)
    if into is None:
        return
    if kwargs.get("attention_masks") is not None or not kwargs.get("is_causal", True):
        raise ValueError("QK-clip records the maxima of plain causal attention only")
    q, k = args[0], args[1]
    scale = kwargs.get("scale")
    causal_score_max(q, k, q.size(-1) ** -0.5 if scale is None else scale, into)


def arm(inner_attention: torch.nn.Module, n_heads: int) -> LogitMax:
    """Make ``inner_attention``'s training forwards record their heads' maxima."""
    inner_attention.logit_max = LogitMax(n_heads)
    computes_scores = getattr(type(inner_attention), "records_logit_max", False)
    if not computes_scores and getattr(inner_attention, "_logit_max_hook", None) is None:
        hook = inner_attention.register_forward_pre_hook(_beside, with_kwargs=True)
        inner_attention._logit_max_hook = hook
    return inner_attention.logit_max


__all__ = [
    "SCORE_BLOCK_ELEMENTS",
    "LogitMax",
    "arm",
    "causal_score_max",
    "recorder",
    "score_block_elements",
]
