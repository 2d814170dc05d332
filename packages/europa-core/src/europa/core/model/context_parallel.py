"""Context parallelism for MLA: each rank holds part of every sequence (``zigzag``) and
gathers what its queries attend to from the others.

MLA makes every head's keys and values from one latent per token: ``kv_lora_rank``
columns (normed) and the rotated shared key, ``qk_rope_head_dim`` columns; 576 for
Kimi-K2 against 64 × (192 + 128) = 20,480 for its up-projected keys and values. So the
``latent`` exchange all-gathers the latent across the group and up-projects the whole
sequence on every rank (``wkv_b`` once more per position held elsewhere); its backward
reduce-scatters the latent's gradient. The ``kv`` exchange gathers the up-projected keys
(the rotary key once per head) and values instead, as torch's ring attention, Megatron's
CP and torchtitan's MLA path move them: kept for comparison. Either is issued asynchronously;
with ``gather_early`` (europa-overlap) the query projection computes while it travels, and
its backward while the reduce-scatter does.

Notation: B batch, l this rank's rows, L the whole sequence, N heads, F features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from europa.core.config.schema import CP_EXCHANGES
from europa.core.model.attention import BlockCausalAttention, rotate
from europa.core.model.zigzag import ZigZag, gathered_from_whole, whole_from_gathered
from europa.spec.plan_layout import CONTEXT_GATHER, CONTEXT_REDUCE_SCATTER
from europa.spec.tags import mark_traffic


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
    # Issue the gather before the query projection and wait after it, and run the query
    # projection's backward beside the reduce-scatter (europa-overlap's switch).
    gather_early: bool = False

    def __post_init__(self) -> None:
        if self.exchange not in CP_EXCHANGES:
            raise ValueError(f"exchange = {self.exchange!r}: expected one of {CP_EXCHANGES}")


class _Flight:
    """One gather of this rank's rows across the group, issued and not yet waited for, and
    in backward the reduce-scatter of their gradient likewise."""

    def __init__(self, context: ContextParallel, shape: torch.Size) -> None:
        self.context, self.shape = context, shape  # (B, l, F) of a rank's rows
        self.work = self.payload = self.gathered = None
        self.grad_work = self.grad_buffers = None  # (sent, received) until waited for

    @property
    def cp(self) -> int:
        return dist.get_world_size(self.context.group)

    def sent(self, tensor: torch.Tensor) -> None:
        self.context.sent.count += (self.cp - 1) * tensor.numel() * tensor.element_size()


class _Launch(torch.autograd.Function):
    """Issues the all-gather of (B, l, F) rows; a token links it to ``_Arrive``. Backward
    waits for the reduce-scatter ``_Arrive``'s backward issued."""

    @staticmethod
    def forward(ctx, local_BlF: torch.Tensor, flight: _Flight) -> torch.Tensor:
        payload = local_BlF.contiguous().view(-1)
        flight.payload, flight.gathered = payload, payload.new_empty(flight.cp * payload.numel())
        mark_traffic(payload, CONTEXT_GATHER)
        flight.work = dist.all_gather_single(
            flight.gathered, payload, group=flight.context.group, async_op=True
        )
        flight.sent(payload)
        ctx.flight = flight
        return local_BlF.new_empty(0)

    @staticmethod
    def backward(ctx, _token: torch.Tensor):
        flight = ctx.flight
        if flight.grad_work is not None:
            flight.grad_work.wait()
        (_, mine), flight.grad_work, flight.grad_buffers = flight.grad_buffers, None, None
        return mine, None


class _Arrive(torch.autograd.Function):
    """Waits for the gather and gives (B, L, F), the whole sequence in order. Backward
    issues the reduce-scatter that sums every rank's gradient of this rank's rows, and
    waits for it at once unless the gather was issued early (europa-overlap), when the
    query projection's backward runs beside it."""

    @staticmethod
    def forward(ctx, token: torch.Tensor, flight: _Flight) -> torch.Tensor:
        flight.work.wait()
        gathered, flight.work, flight.payload, flight.gathered = flight.gathered, None, None, None
        ctx.flight = flight
        return whole_from_gathered(gathered.view(flight.cp, *flight.shape))

    @staticmethod
    def backward(ctx, grad_BLF: torch.Tensor):
        flight = ctx.flight
        per_rank = gathered_from_whole(grad_BLF, flight.cp).contiguous()
        mine = per_rank.new_empty(flight.shape)
        payload = per_rank.view(-1)
        mark_traffic(payload, CONTEXT_REDUCE_SCATTER)
        flight.grad_work = dist.reduce_scatter_single(
            mine.view(-1), payload, group=flight.context.group, async_op=True
        )
        flight.grad_buffers = (payload, mine)
        flight.sent(mine)
        if not flight.context.gather_early:
            flight.grad_work.wait()
            flight.grad_work = None
        return per_rank.new_empty(0), None


def launch_gather(local_BlF: torch.Tensor, context: ContextParallel):
    """Issue the gather of this rank's (B, l, F) rows; ``arrive`` gives the whole sequence."""
    flight = _Flight(context, local_BlF.shape)
    return _Launch.apply(local_BlF, flight), flight


def arrive(token: torch.Tensor, flight: _Flight) -> torch.Tensor:
    return _Arrive.apply(token, flight)


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
        payload = torch.cat([latent, k_pe.squeeze(2)], dim=-1)
    else:
        kv = attention.wkv_b(latent).view(batch, local_len, -1, nope + attention.v_head_dim)
        heads = kv.size(2)
        payload = torch.cat(
            [kv.flatten(2), k_pe.expand(batch, local_len, heads, rope).flatten(2)], dim=-1
        )
    in_flight = launch_gather(payload, context)
    if not context.gather_early:
        whole = arrive(*in_flight)
    q = _queries(attention, x_BlD).view(batch, local_len, -1, attention.qk_head_dim)
    if context.gather_early:
        whole = arrive(*in_flight)
    if context.exchange == "latent":
        latent, k_pe = torch.split(whole, [attention.kv_lora_rank, rope], dim=-1)
        kv = attention.wkv_b(latent).view(batch, whole.size(1), -1, nope + attention.v_head_dim)
        k_pe = k_pe.unsqueeze(2)  # (B, L, 1, R)
    else:
        kv, k_pe = torch.split(whole, [kv[0, 0].numel(), heads * rope], dim=-1)
        kv = kv.view(batch, whole.size(1), heads, -1)
        k_pe = k_pe.view(batch, whole.size(1), heads, rope)  # (B, L, N, R)

    segments = context.zigzag.segments(local_len)
    inner, scale = attention.inner_attention, attention.softmax_scale
    if isinstance(inner, BlockCausalAttention):
        output = inner.mla(q, kv, k_pe, rope_cache, nope=nope, scale=scale, segments=segments)
    else:
        output = _sdpa_chunks(inner, q, kv, k_pe, rope_cache, nope, scale, segments)
    return attention.wo(output.reshape(batch, local_len, -1))


def _queries(attention, x_BlD: torch.Tensor) -> torch.Tensor:
    if attention.q_lora_rank > 0:
        return attention.wq_b(attention.q_norm(attention.wq_a(x_BlD)))
    return attention.wq(x_BlD)


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
