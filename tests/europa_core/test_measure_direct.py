"""``--measure-hardware``'s direct transfers inside the model's step
(``europa.core.plan.measure_direct``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def _exchanges(rank: int, world: int) -> dict:
    from europa.core.plan.measure_direct import direct_exchanges, exchanges_in_step

    gather, reduce_scatter, sent = direct_exchanges(world * 64 * 4, dist.group.WORLD, "cpu")
    rows, total = gather(), reduce_scatter()
    # Hooked into a two-block model: one gather before each forward, a gather and a
    # reduce-scatter before each backward; each of them takes part with every rank.
    blocks = [torch.nn.Linear(8, 8) for _ in range(2)]
    calls: list[str] = []
    remove = exchanges_in_step(
        blocks, lambda: calls.append("gather"), lambda: calls.append("reduce_scatter")
    )
    blocks[1](blocks[0](torch.ones(2, 8))).sum().backward()
    remove()
    blocks[1](blocks[0](torch.ones(2, 8))).sum().backward()  # unhooked: nothing more
    return {"rows": rows, "total": total, "sent": sent, "calls": calls}


@pytest.mark.distributed
def test_the_direct_exchanges_move_every_piece_once_and_sum_them(ranks):
    world = 3
    for rank, found in enumerate(ranks(_exchanges, world)):
        for peer in range(world):
            if peer != rank:  # its own row is left unfilled, as FlexShard's is
                assert torch.equal(found["rows"][peer], torch.full((64,), peer + 1.0))
        assert torch.equal(found["total"], torch.full((64,), 1.0 + 2.0 + 3.0))
        assert found["sent"] == 64 * 4 * (world - 1)
        assert found["calls"] == ["gather", "gather", "gather", "reduce_scatter",
                                  "gather", "reduce_scatter"]  # fmt: skip
