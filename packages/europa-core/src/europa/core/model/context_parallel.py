"""Context parallelism for MLA: each rank holds part of every sequence (``zigzag``) and
gathers what its queries attend to from the others.

MLA makes every head's keys and values from one latent per token: ``kv_lora_rank``
columns (normed) and the rotated shared key, ``qk_rope_head_dim`` columns; 576 for
Kimi-K2 against 64 × (192 + 128) = 20,480 for its up-projected keys and values. So the
``latent`` exchange all-gathers the latent across the group and up-projects the whole
sequence on every rank (``wkv_b`` once more per position held elsewhere); its backward
reduce-scatters the latent's gradient. The ``kv`` exchange gathers the up-projected keys
(the rotary key once per head) and values instead, as torch's ring attention, Megatron's
CP and torchtitan's MLA path move them: kept for comparison.

Notation: B batch, l this rank's rows, L the whole sequence, N heads, F features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from europa.core.config.schema import CP_EXCHANGES
from europa.core.model.attention import BlockCausalAttention, rotate
from europa.core.model.zigzag import ZigZag, gathered_from_whole, whole_from_gathered
from europa.spec.tags import mark_traffic

# The traffic each direction is (``europa.spec.tags.mark_traffic``; the planner's kinds).
EXCHANGE_KINDS = GATHER, REDUCE_SCATTER = ("context_gather", "context_reduce_scatter")


@dataclass(slots=True)
class SentBytes:
    """Bytes this rank sent in the group's exchanges since last taken."""

    count: int = 0

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


@dataclass(frozen=True, slots=True)
class ContextParallel:
    group: dist.ProcessGroup  # the ranks sharing this rank's sequences
    zigzag: ZigZag
    exchange: str = "latent"
    sent: SentBytes = field(default_factory=SentBytes)

    def __post_init__(self) -> None:
        if self.exchange not in CP_EXCHANGES:
            raise ValueError(f"exchange = {self.exchange!r}: expected one of {CP_EXCHANGES}")


class _GatherSequence(torch.autograd.Function):
    """(B, l, F) rows of this rank to (B, L, F), the whole sequence in order; backward
    sums every rank's gradient of this rank's rows (a reduce-scatter). Each direction
    sends this rank's rows to the cp - 1 others, counted into ``sent``."""

    @staticmethod
    def forward(ctx, local_BlF: torch.Tensor, group: dist.ProcessGroup, sent: SentBytes):
        cp = dist.get_world_size(group)
        batch, local_len, features = local_BlF.shape
        gathered = local_BlF.new_empty(cp * batch * local_len * features)
        payload = local_BlF.contiguous().view(-1)
        mark_traffic(payload, GATHER)
        dist.all_gather_single(gathered, payload, group=group)
        sent.count += (cp - 1) * local_BlF.numel() * local_BlF.element_size()
        ctx.group, ctx.sent = group, sent
        return whole_from_gathered(gathered.view(cp, batch, local_len, features))

    @staticmethod
    def backward(ctx, grad_BLF: torch.Tensor):
        cp = dist.get_world_size(ctx.group)
        per_rank = gathered_from_whole(grad_BLF, cp).contiguous()
        mine = per_rank.new_empty(per_rank.shape[1:])
        payload = per_rank.view(-1)
        mark_traffic(payload, REDUCE_SCATTER)
        dist.reduce_scatter_single(mine.view(-1), payload, group=ctx.group)
        ctx.sent.count += (cp - 1) * mine.numel() * mine.element_size()
        return mine, None, None


def gather_sequence(local_BlF: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    return _GatherSequence.apply(local_BlF, context.group, context.sent)


def mla_forward(attention, x_BlD: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """``ContextParallelMLA``'s forward on this rank's rows of each sequence: the same
    projections, norms and rotations, the keys and values of the whole sequence."""
    batch, local_len, _ = x_BlD.shape
    nope, rope = attention.qk_nope_head_dim, attention.qk_rope_head_dim
    positions = context.zigzag.positions(local_len, device=x_BlD.device)
    rope_cache = attention.rope.cache[positions].view(1, local_len, 1, -1)

    latent, k_pe = torch.split(attention.wkv_a(x_BlD), [attention.kv_lora_rank, rope], dim=-1)
    k_pe = rotate(k_pe.unsqueeze(2), rope_cache)  # (B, l, 1, R)
    latent = attention.kv_norm(latent)
    if context.exchange == "latent":
        whole = gather_sequence(torch.cat([latent, k_pe.squeeze(2)], dim=-1), context)
        latent, k_pe = torch.split(whole, [attention.kv_lora_rank, rope], dim=-1)
        kv = attention.wkv_b(latent).view(batch, whole.size(1), -1, nope + attention.v_head_dim)
        k_pe = k_pe.unsqueeze(2)  # (B, L, 1, R)
    else:
        kv = attention.wkv_b(latent).view(batch, local_len, -1, nope + attention.v_head_dim)
        heads = kv.size(2)
        payload = torch.cat(
            [kv.flatten(2), k_pe.expand(batch, local_len, heads, rope).flatten(2)], dim=-1
        )
        whole = gather_sequence(payload, context)
        kv, k_pe = torch.split(whole, [kv[0, 0].numel(), heads * rope], dim=-1)
        kv = kv.view(batch, whole.size(1), heads, -1)
        k_pe = k_pe.view(batch, whole.size(1), heads, rope)  # (B, L, N, R)

    low_rank = attention.q_lora_rank > 0
    q = attention.wq_b(attention.q_norm(attention.wq_a(x_BlD))) if low_rank else attention.wq(x_BlD)
    q = q.view(batch, local_len, -1, attention.qk_head_dim)
    segments = context.zigzag.segments(local_len)
    inner, scale = attention.inner_attention, attention.softmax_scale
    if isinstance(inner, BlockCausalAttention):
        output = inner.mla(q, kv, k_pe, rope_cache, nope=nope, scale=scale, segments=segments)
    else:
        output = _sdpa_chunks(inner, q, kv, k_pe, rope_cache, nope, scale, segments)
    return attention.wo(output.reshape(batch, local_len, -1))


def _sdpa_chunks(inner, q_BlNQ, kv_BLNF, k_pe_BLnR, rope_cache, nope, scale, segments):
    """torch's SDPA (fused kernels on CUDA) for each chunk of this rank's rows: its queries
    against the keys up to its last position, causal from the bottom right. QK-clip's
    maxima, where armed, as the pre-hook beside SDPA takes them."""
    from europa.spec.logit_max import causal_score_max, recorder

    q_pe = rotate(q_BlNQ[..., nope:], rope_cache)
    q = torch.cat([q_BlNQ[..., :nope], q_pe], dim=-1)
    k_nope, v = torch.split(kv_BLNF, [nope, kv_BLNF.size(-1) - nope], dim=-1)
    k = torch.cat([k_nope, k_pe_BLnR.expand(-1, -1, k_nope.size(2), -1)], dim=-1)
    into = recorder(inner)
    outputs = []
    for first_row, first_position, rows in segments:
        keys = first_position + rows
        q_chunk = q[:, first_row : first_row + rows]
        if into is not None:
            causal_score_max(q_chunk, k[:, :keys], scale, into)
        out = torch.nn.functional.scaled_dot_product_attention(
            q_chunk.transpose(1, 2),
            k[:, :keys].transpose(1, 2),
            v[:, :keys].transpose(1, 2),
            attn_mask=_lower_right(rows, keys),
            scale=scale,
        )
        outputs.append(out.transpose(1, 2))
    return torch.cat(outputs, dim=1)


def _lower_right(rows: int, keys: int):
    """torch's causal mask aligned to the last key, which its fused kernels take without
    materialising it. A tensor subclass without data: made outside any dispatch mode (fake
    tensors under ``europa plan --execute``, europa-overlap's timeline), which would hand
    it a plain tensor to wrap."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return causal_lower_right(rows, keys)
