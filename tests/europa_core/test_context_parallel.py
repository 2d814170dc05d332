"""Context parallelism for MLA: the zig-zag cut, and attention over a sequence split across
real gloo ranks against the same attention on the whole sequence in one process."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.core.model.attention import causal_blocks
from europa.core.model.zigzag import ZigZag, gathered_from_whole, whole_from_gathered
from tests.conftest import run_ranks
from tests.europa_core.test_mla import _attention

zigzags = st.integers(1, 6).flatmap(
    lambda cp: st.tuples(st.just(cp), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))
)


@settings(max_examples=40, deadline=None)
@given(zigzags)
def test_the_ranks_rows_hold_every_position_once_and_equal_causal_work(shape):
    cp, chunk, batch, features = shape
    seq_len = 2 * cp * chunk
    whole = torch.randn(batch, seq_len, features)
    ranks = [ZigZag(cp, rank) for rank in range(cp)]
    positions = [z.positions(2 * chunk) for z in ranks]
    assert sorted(torch.cat(positions).tolist()) == list(range(seq_len))
    for z, mine in zip(ranks, positions, strict=True):
        assert torch.equal(z.cut(whole), whole[:, mine])
        assert torch.equal(z.cut(torch.arange(seq_len), dim=0), mine)
    # a query at position p attends to p + 1 keys
    assert len({int((p + 1).sum()) for p in positions}) == 1
    gathered = torch.stack([z.cut(whole) for z in ranks])
    assert torch.equal(whole_from_gathered(gathered), whole)
    assert torch.equal(gathered_from_whole(whole, cp), gathered)


@settings(max_examples=40, deadline=None)
@given(zigzags, st.integers(1, 5))
def test_query_blocks_cover_each_row_once_at_its_position(shape, chunks):
    cp, chunk, _, _ = shape
    for rank in range(cp):
        z = ZigZag(cp, rank)
        blocks = causal_blocks(z.segments(2 * chunk), chunks)
        rows = [row for start, end, _ in blocks for row in range(start, end)]
        assert rows == list(range(2 * chunk))
        positions = z.positions(2 * chunk)
        for start, end, key_end in blocks:
            assert int(positions[end - 1]) + 1 == key_end
            assert torch.equal(positions[start:end], torch.arange(key_end - (end - start), key_end))


def test_a_cut_that_is_not_two_chunks_a_rank_is_refused():
    with pytest.raises(ValueError, match="not 4 equal chunks"):
        ZigZag(2, 0).cut(torch.zeros(1, 6))


def _module(q_lora_rank: int, chunks: int, kernel: str):
    """One MLA layer with QK-clip's maxima armed: europa's block-causal attention, or
    torchtitan's SDPA (its math path on CPU; fused kernels on CUDA)."""
    from europa.spec.logit_max import arm

    module = _attention(q_lora_rank, 3, 4, 4, 5, chunks, attention=kernel)
    arm(module.inner_attention, module.n_heads)
    return module


def _split_attention(rank, world, exchange, q_lora_rank, chunks, kernel, early=False):
    """This rank's output and input gradient; the group's summed parameter gradients and
    its heads' largest logits (a MAX over the group)."""
    import torch.distributed as dist

    from europa.core.model.context_parallel import ContextParallel

    module = _module(q_lora_rank, chunks, kernel)
    zigzag = ZigZag(world, rank)
    module.context_parallel = ContextParallel(
        dist.group.WORLD, zigzag, exchange, gather_early=early
    )
    x, grad = _inputs(world)
    z = ZigZag(world, rank)
    x = z.cut(x).requires_grad_()
    out = module(x, None, None)
    out.backward(z.cut(grad))
    grads = [p.grad for p in module.parameters()]
    for g in grads:
        dist.all_reduce(g)
    maxima = module.inner_attention.logit_max.read()
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    return [out.detach(), x.grad, *grads, maxima]


def _inputs(cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(cp)
    x = torch.randn(2, 4 * cp * 3, 32, generator=generator)
    return x, torch.randn(x.shape, generator=generator)


@pytest.mark.parametrize(
    ("world", "exchange", "q_lora_rank", "chunks", "kernel", "early"),
    [
        (2, "latent", 8, 2, "block_causal", False),
        (2, "kv", 0, 1, "block_causal", True),
        (4, "latent", 0, 3, "block_causal", True),
        (4, "kv", 8, 2, "block_causal", False),
        (2, "latent", 8, 2, "sdpa", True),
        (4, "kv", 0, 1, "sdpa", False),
    ],
)
def test_attention_split_across_ranks_equals_the_whole_sequence(
    world, exchange, q_lora_rank, chunks, kernel, early
):
    """``early``: the gather issued before the query projection (europa-overlap)."""
    module = _module(q_lora_rank, chunks, kernel)
    x, grad = _inputs(world)
    x.requires_grad_()
    out = module(x, None, None)
    out.backward(grad)
    maxima = module.inner_attention.logit_max.read()
    whole = [out.detach(), x.grad, *(p.grad for p in module.parameters()), maxima]
    args = (exchange, q_lora_rank, chunks, kernel, early)
    results = run_ranks(_split_attention, world, *args, timeout=60)
    for rank, got in enumerate(results):
        z = ZigZag(world, rank)
        expected = [z.cut(whole[0]), z.cut(whole[1]), *whole[2:]]
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _exchange_order(rank, world, early):
    """The order, on this rank, of the exchange's issues and waits and of the query
    projection's forward and backward."""
    import torch.distributed as dist

    from europa.core.model.context_parallel import ContextParallel

    events = []

    class Recorded:  # a collective's work whose wait is recorded
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self):
            events.append(f"{self.name} waited")
            return self.work.wait()

    def recording(collective, name):
        def issue(*args, **kwargs):
            events.append(f"{name} issued")
            return Recorded(collective(*args, **kwargs), name)

        return issue

    dist.all_gather_single = recording(dist.all_gather_single, "gather")
    dist.reduce_scatter_single = recording(dist.reduce_scatter_single, "reduce-scatter")
    module = _module(8, 2, "block_causal")
    module.context_parallel = ContextParallel(
        dist.group.WORLD, ZigZag(world, rank), "latent", gather_early=early
    )
    module.wq_a.register_forward_pre_hook(lambda *_: events.append("queries"))
    module.wq_a.register_full_backward_hook(lambda *_: events.append("queries' backward"))
    x, grad = _inputs(world)
    x = ZigZag(world, rank).cut(x).requires_grad_()
    module(x, None, None).backward(ZigZag(world, rank).cut(grad))
    return events


def test_europa_overlap_issues_the_gather_before_the_queries_and_waits_after():
    """Early, the gather travels while the query projection computes, and the
    reduce-scatter while its backward does; otherwise each is waited for at once."""
    early, at_once = (run_ranks(_exchange_order, 2, e, timeout=60)[0] for e in (True, False))
    assert early == [
        "gather issued",
        "queries",
        "gather waited",
        "reduce-scatter issued",
        "queries' backward",
        "reduce-scatter waited",
    ]
    assert at_once == [
        "gather issued",
        "gather waited",
        "queries",
        "queries' backward",
        "reduce-scatter issued",
        "reduce-scatter waited",
    ]
