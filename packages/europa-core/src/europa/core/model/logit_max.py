"""Each head's largest pre-softmax logit over a step's training forwards, for QK-clip.

An attention module records only when it is armed (``arm``: a ``LogitMax`` attribute on
the inner attention) and the forward is a training forward: the module in training mode,
gradients on, and not inside backward, so an activation-checkpointing recomputation
does not record again and evaluation (``model.eval()``, ``torch.no_grad()``) never does.

``BlockCausalAttention`` takes the maximum from the score blocks it computes anyway.
``MaxRecordingSDPA`` (SDPA, whose fused kernels return no maximum) computes the causal
scores again beside it, without gradients, a block of query rows at a time so that no
whole sequence × sequence matrix per head exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common.attention import ScaledDotProductAttention

# The elements of one block of scores beside SDPA: 16 Mi, 32 MiB in bf16.
SCORE_BLOCK_ELEMENTS = 1 << 24


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
        per_head = scores.detach().amax(dim=(1, 2)).view(batch, self.n_heads).amax(0)
        self.value = per_head if self.value is None else torch.maximum(self.value, per_head)


def recorder(inner_attention: torch.nn.Module) -> LogitMax | None:
    """The armed ``LogitMax`` of ``inner_attention`` if this forward is one to record."""
    armed = getattr(inner_attention, "logit_max", None)
    if armed is None or not inner_attention.training or not torch.is_grad_enabled():
        return None
    if torch._C._current_graph_task_id() != -1:  # inside backward: a recomputation
        return None
    return armed


def arm(inner_attention: torch.nn.Module, n_heads: int) -> LogitMax:
    if not getattr(inner_attention, "records_logit_max", False):
        raise ValueError(
            f"QK-clip: attention {type(inner_attention).__name__} records no logit maxima; "
            "expected BlockCausalAttention or MaxRecordingSDPA"
        )
    inner_attention.logit_max = LogitMax(n_heads)
    return inner_attention.logit_max


@torch.no_grad()
def causal_score_max(q_BLNH, k_BLNH, scale: float, into: LogitMax) -> None:
    """Record the causal scores' maxima of (B, L, N, H) queries and keys, in blocks of rows."""
    batch, seq_len, heads, _ = q_BLNH.shape
    q, k = q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2)  # (B, N, L, H)
    rows = max(1, SCORE_BLOCK_ELEMENTS // (batch * heads * seq_len))
    for start in range(0, seq_len, rows):
        end = min(seq_len, start + rows)
        scores = torch.matmul(q[:, :, start:end], k[:, :, :end].mT) * scale
        later = torch.arange(end, device=q.device) > torch.arange(
            start, end, device=q.device
        ).unsqueeze(1)
        scores.masked_fill_(later, float("-inf"))
        into.observe(scores.flatten(0, 1), batch)


class MaxRecordingSDPA(ScaledDotProductAttention):
    """torchtitan's SDPA attention, recording the logit maxima when armed."""

    records_logit_max = True

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, scale: float | None = None, **kwargs):
        into = recorder(self)
        if into is not None:
            if kwargs.get("attention_masks") is not None or not kwargs.get("is_causal", True):
                raise ValueError("QK-clip records the maxima of plain causal attention only")
            used = q_BLNH.size(-1) ** -0.5 if scale is None else scale
            causal_score_max(q_BLNH, k_BLNH, used, into)
        return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, **kwargs)
