"""Causal attention that skips the masked half of the scores, for CPU runs.

On CPU, SDPA runs its reference ("math") path for MLA attention: the CPU flash
kernel needs value heads as wide as query heads (MLA's are 128 against 192, and
padding v to 192 measured slower). That path multiplies every query with every
key, then masks half the scores away. This module cuts the queries into
``chunks`` row blocks; block i multiplies only with the keys up to its own end,
with an additive -inf mask on its diagonal block. Score, softmax and
probability-times-value work drop to (chunks + 1) / (2 chunks) of SDPA's (5/8
at 4), and so do the saved probabilities. The maths is SDPA's up to fp32
rounding (masked scores add exact zeros to every sum), in fp32 whatever the
compute dtype (as SDPA's CPU path). Forward and backward are written out
(``_BlockCausal``) because autograd through the per-block slices would build
a zero-filled whole-size gradient per block.

Same interface as torchtitan's ``ScaledDotProductAttention``: (B, L, N, H)
tensors in and out, causal only; and ``mla``, the same attention from MLA's parts
before they are concatenated (``europa.core.model.mla``). Armed for QK-clip
(``europa.spec.logit_max``), a training forward records each head's largest
score from the blocks it computes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torchtitan.protocols.module import Module

from europa.spec.logit_max import recorder

DEFAULT_CHUNKS = 4


def chunk_bounds(seq_len: int, chunks: int) -> list[tuple[int, int]]:
    """(start, end) of each query block: ``chunks`` near-equal blocks, none empty."""
    chunks = max(1, min(chunks, seq_len))
    edges = [seq_len * i // chunks for i in range(chunks + 1)]
    return list(itertools.pairwise(edges))


def causal_blocks(segments, chunks: int) -> list[tuple[int, int, int]]:
    """Query blocks of a causal attention whose query rows are runs of consecutive positions:
    ``segments`` holds (first row, first position, rows) of each run; each run is cut into
    ``chunks`` blocks. A block is (start row, end row, key end): its rows are positions
    key end - rows .. key end, and it attends to keys 0..key end."""
    return [
        (first_row + start, first_row + end, first_position + end)
        for first_row, first_position, rows in segments
        for start, end in chunk_bounds(rows, chunks)
    ]


def _diagonal_mask(rows: int, key_end: int, like: torch.Tensor) -> torch.Tensor:
    """Additive mask (the ``rows`` positions before key_end, keys 0..key_end): -inf where a
    key follows its query."""
    positions = torch.arange(key_end - rows, key_end, device=like.device).unsqueeze(1)
    keys = torch.arange(key_end, device=like.device).unsqueeze(0)
    mask = torch.zeros(rows, key_end, dtype=like.dtype, device=like.device)
    return mask.masked_fill_(keys > positions, float("-inf"))


def _head_major(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows start..end of a (B, L, N, H) tensor as a contiguous fp32 (B·N, end - start, H)."""
    rows = t[:, start:end].transpose(1, 2)
    out = torch.empty(rows.shape, dtype=torch.float32, device=t.device)
    return out.copy_(rows).view(-1, end - start, t.size(-1))


def _sequence_major(t: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """A head-major (B·N, rows, H) tensor viewed as (B, rows, N, H): _head_major's inverse."""
    return t.view(batch, heads, t.size(1), t.size(2)).transpose(1, 2)


def _write_rows(dest: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    """Write a head-major (B·N, n, H) block into rows start..start + n of a (B, L, N, H) tensor."""
    batch, _, heads, _ = dest.shape
    dest[:, start : start + rows.size(1)].copy_(_sequence_major(rows, batch, heads))


def _attend(k, v, query_block, out_BLNH, scale: float, bounds, logit_max=None):
    """Forward over the query blocks: ``query_block(start, end)`` gives block rows
    start..end head-major (B·N, end - start, H) in fp32; each block's output is written
    into ``out_BLNH``, and its scores' maxima into ``logit_max`` (a ``LogitMax``), if
    given. Returns the blocks' queries and probabilities (saved for backward)."""
    queries, probabilities = [], []
    for start, end, key_end in bounds:
        q = query_block(start, end)
        mask = _diagonal_mask(end - start, key_end, q)
        scores = torch.baddbmm(mask, q, k[:, :key_end].mT, alpha=scale)
        if logit_max is not None:
            logit_max.observe(scores, out_BLNH.size(0))
        probs = scores.softmax(dim=-1)
        _write_rows(out_BLNH, start, torch.bmm(probs, v[:, :key_end]))
        queries.append(q)
        probabilities.append(probs)
    return queries, probabilities


def _attend_backward(k, v, queries, probabilities, grad_out_BLNH, write_grad_q, scale, bounds):
    """Backward over the query blocks, last first: each block's query gradient (head-major,
    scaled) goes to ``write_grad_q(start, grad_q)``; returns the head-major key (scaled) and
    value gradients. A last block that sees every key writes them whole (no zero fill); the
    other blocks add their products over a key prefix onto them."""
    grad_k = grad_v = None
    blocks = reversed(list(zip(bounds, queries, probabilities, strict=True)))
    for (start, end, key_end), q, probs in blocks:
        grad_block = _head_major(grad_out_BLNH, start, end)
        grad_probs = torch.bmm(grad_block, v[:, :key_end].mT)
        # softmax backward, dS = P * (dP - rowsum(P * dP)), in one fused pass
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        write_grad_q(start, torch.bmm(grad_scores, k[:, :key_end]).mul_(scale))
        if grad_k is None and key_end == k.size(1):
            grad_v = torch.bmm(probs.mT, grad_block)
            grad_k = torch.bmm(grad_scores.mT, q)
            continue
        if grad_k is None:  # only context parallelism's queries miss the last keys
            grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        grad_v[:, :key_end].add_(torch.bmm(probs.mT, grad_block))
        grad_k[:, :key_end].add_(torch.bmm(grad_scores.mT, q))
    return grad_k.mul_(scale), grad_v


class _BlockCausal(torch.autograd.Function):
    """(B, L, N, H) tensors in and out. Keys and values are copied head-major whole,
    (B·N, L, H); queries, outputs and their gradients head-major one query block at a
    time, so every product writes a contiguous tensor of its own (CPU ``bmm`` copies
    through a temporary into a strided ``out=``, and ``baddbmm_`` into a strided slice
    falls back to one ``addmm_`` per matrix). Saves each query block, k, v and each
    block's probabilities."""

    @staticmethod
    def forward(ctx, q_BLNH, k_BLNH, v_BLNH, scale: float, bounds, logit_max):
        seq_len = q_BLNH.size(1)
        k, v = (_head_major(t, 0, seq_len) for t in (k_BLNH, v_BLNH))
        out_BLNH = torch.empty_like(v_BLNH, memory_format=torch.contiguous_format)
        queries, probabilities = _attend(
            k,
            v,
            lambda start, end: _head_major(q_BLNH, start, end),
            out_BLNH,
            scale,
            bounds,
            logit_max,
        )
        ctx.save_for_backward(k, v, *queries, *probabilities)
        ctx.scale, ctx.bounds = scale, bounds
        ctx.dtypes = (q_BLNH.dtype, k_BLNH.dtype)
        return out_BLNH

    @staticmethod
    def backward(ctx, grad_out_BLNH):
        k, v, *saved = ctx.saved_tensors
        blocks = len(ctx.bounds)
        q_dtype, k_dtype = ctx.dtypes
        batch, seq_len, heads, _ = grad_out_BLNH.shape
        grad_q_BLNH = grad_out_BLNH.new_empty((batch, seq_len, heads, k.size(-1)), dtype=q_dtype)
        grad_k, grad_v = _attend_backward(
            k,
            v,
            saved[:blocks],
            saved[blocks:],
            grad_out_BLNH,
            lambda start, grad_q: _write_rows(grad_q_BLNH, start, grad_q),
            ctx.scale,
            ctx.bounds,
        )
        grad_k = _sequence_major(grad_k, batch, heads).to(k_dtype)
        grad_v = _sequence_major(grad_v, batch, heads).to(grad_out_BLNH.dtype)
        return grad_q_BLNH, grad_k, grad_v, None, None, None


def rotate(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """``x`` (..., R) rotated by the complex ``rope_cache`` (..., R/2, broadcast), in fp32
    and back to x's dtype: torchtitan's ``ComplexRoPE.apply_rotary_emb``, the same ops."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rope_cache).flatten(-2).type_as(x)


class _BlockCausalMLA(torch.autograd.Function):
    """MLA's attention without its concatenations: q (B, L, N, nope + R) straight from its
    projection (the last R columns not yet rotated), kv (B, L, N, nope + Dv) from wkv_b
    (keys' first ``nope`` columns, then the values), k_pe (B, L, 1, R) rotated and shared
    by every head, and the complex ``rope_cache`` (1, L, 1, R/2). The head-major copies
    _BlockCausal makes anyway are built from these parts (the query's rotation applied on
    the way), and the gradients are written whole into q's and kv's shapes, so neither the
    forward's two concatenations (q and k) nor the backward's concatenation of q's
    gradient exist. Same saved tensors and the same arithmetic as torchtitan's MLA
    followed by _BlockCausal."""

    @staticmethod
    def forward(ctx, q_BLNQ, kv_BLNF, k_pe_BL1R, rope_cache, nope, scale, bounds, logit_max):
        batch, seq_len, heads, _ = kv_BLNF.shape  # keys' length; q may hold fewer rows
        rope = k_pe_BL1R.size(-1)
        k = torch.empty(
            batch, heads, seq_len, nope + rope, dtype=torch.float32, device=kv_BLNF.device
        )
        k[..., :nope].copy_(kv_BLNF[..., :nope].transpose(1, 2))
        k[..., nope:].copy_(k_pe_BL1R.transpose(1, 2).expand(batch, heads, seq_len, rope))
        k = k.view(batch * heads, seq_len, nope + rope)
        v = _head_major(kv_BLNF[..., nope:], 0, seq_len)
        out_BLNH = kv_BLNF.new_empty(batch, q_BLNQ.size(1), heads, v.size(-1))

        def query_block(start: int, end: int) -> torch.Tensor:
            rows = q_BLNQ[:, start:end]
            block = torch.empty(
                batch,
                heads,
                end - start,
                q_BLNQ.size(-1),
                dtype=torch.float32,
                device=q_BLNQ.device,
            )
            block[..., :nope].copy_(rows[..., :nope].transpose(1, 2))
            block[..., nope:].copy_(
                rotate(rows[..., nope:], rope_cache[:, start:end]).transpose(1, 2)
            )
            return block.view(batch * heads, end - start, -1)

        queries, probabilities = _attend(k, v, query_block, out_BLNH, scale, bounds, logit_max)
        ctx.save_for_backward(k, v, rope_cache, *queries, *probabilities)
        ctx.scale, ctx.bounds, ctx.nope = scale, bounds, nope
        ctx.dtypes = (q_BLNQ.dtype, kv_BLNF.dtype, k_pe_BL1R.dtype)
        ctx.k_pe_heads = k_pe_BL1R.size(2)
        return out_BLNH

    @staticmethod
    def backward(ctx, grad_out_BLNH):
        k, v, rope_cache, *saved = ctx.saved_tensors
        blocks, nope = len(ctx.bounds), ctx.nope
        q_dtype, kv_dtype, k_pe_dtype = ctx.dtypes
        batch, q_len, heads, _ = grad_out_BLNH.shape
        grad_q = grad_out_BLNH.new_empty((batch, q_len, heads, k.size(-1)), dtype=q_dtype)
        unrotation = rope_cache.conj()

        def write_grad_q(start: int, block: torch.Tensor) -> None:
            rows = _sequence_major(block, batch, heads)
            end = start + rows.size(1)
            grad_q[:, start:end, :, :nope].copy_(rows[..., :nope])
            # the rotation's gradient, as autograd takes it: times the conjugate, in fp32
            pe = rows[..., nope:].to(q_dtype)
            grad_q[:, start:end, :, nope:].copy_(rotate(pe, unrotation[:, start:end]))

        grad_k, grad_v = _attend_backward(
            k,
            v,
            saved[:blocks],
            saved[blocks:],
            grad_out_BLNH,
            write_grad_q,
            ctx.scale,
            ctx.bounds,
        )
        grad_k = _sequence_major(grad_k, batch, heads)
        grad_kv = grad_out_BLNH.new_empty(
            (batch, grad_k.size(1), heads, nope + grad_v.size(-1)), dtype=kv_dtype
        )
        grad_kv[..., :nope].copy_(grad_k[..., :nope])
        grad_kv[..., nope:].copy_(_sequence_major(grad_v, batch, heads))
        grad_k_pe = grad_k[..., nope:].to(k_pe_dtype)
        if ctx.k_pe_heads == 1:  # one rotary key shared by every head
            grad_k_pe = grad_k_pe.sum(dim=2, keepdim=True)
        return grad_q, grad_kv, grad_k_pe, None, None, None, None, None


class BlockCausalAttention(Module):
    records_logit_max = True  # QK-clip's maxima from its own scores (europa.spec.logit_max)

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        chunks: int = DEFAULT_CHUNKS

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.chunks = config.chunks

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks=None,
        scale: float | None = None,
        is_causal: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        if attention_masks is not None or not is_causal:
            raise ValueError("BlockCausalAttention computes plain causal attention only")
        scale = q_BLNH.size(-1) ** -0.5 if scale is None else scale
        # fp32 arithmetic whatever the compute dtype, as SDPA's CPU path does
        bounds = causal_blocks([(0, 0, q_BLNH.size(1))], self.chunks)
        return _BlockCausal.apply(q_BLNH, k_BLNH, v_BLNH, scale, bounds, recorder(self))

    def mla(
        self,
        q_BLNQ: torch.Tensor,
        kv_BLNF: torch.Tensor,
        k_pe_BL1R: torch.Tensor,
        rope_cache: torch.Tensor,
        *,
        nope: int,
        scale: float,
        segments=None,
    ) -> torch.Tensor:
        """Causal MLA attention from its parts (``_BlockCausalMLA``): q with its last R
        columns not yet rotated by ``rope_cache``, kv as wkv_b gives it (``nope`` key
        columns, then the values), k_pe rotated and shared by the heads (or one per head).
        ``segments`` (``causal_blocks``) places q's rows among the keys' positions; by
        default q and the keys are the same positions."""
        segments = [(0, 0, q_BLNQ.size(1))] if segments is None else segments
        bounds = causal_blocks(segments, self.chunks)
        return _BlockCausalMLA.apply(
            q_BLNQ, kv_BLNF, k_pe_BL1R, rope_cache, nope, scale, bounds, recorder(self)
        )
