"""``--measure-hardware``'s direct transfers inside the model's step
(``europa.core.plan.measure_direct``) and the heap policy of a CPU rank
(``europa.core.launch.heap``)."""

from __future__ import annotations

import subprocess
import sys

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


HEAP_PROBE = """
import ctypes, sys
from europa.core.launch.heap import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
block = libc.malloc(16 << 20)
mapped = libc.mallinfo2().hblkhd
libc.free(block)
print(mapped >= 16 << 20, libc.mallinfo2().fordblks >= 16 << 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_cpu_rank_keeps_a_freed_block_in_its_heap_for_the_next_allocation():
    def probe(mode: str) -> str:
        run = [sys.executable, "-c", HEAP_PROBE, mode]
        return subprocess.run(run, capture_output=True, text=True, check=True).stdout.split()

    assert probe("default") == ["True", "False"]  # its own mapping, unmapped when freed
    assert probe("keep") == ["False", "True"]  # from the heap, and kept there
