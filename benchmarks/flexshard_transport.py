"""A FlexShard unit's gather and reduce-scatter on gloo: torch's collectives against the
direct transfers FlexShard uses there (``europa.flexshard.direct``), in one run.

On spawned gloo ranks, for rows of ``--width`` fp32 elements per rank (the widest
``debug`` block is about 2 M), each way runs ``--calls`` times after a warm-up, the ways
alternating round by round:

* gather: ``all_gather_single`` of this rank's packed segment into fresh rows (gloo
  receives into a flat buffer of its own, then copies every row out), against this
  rank's pieces (``--pieces`` parameters per segment) sent straight from where they are
  and each other rank's received in place into its row (nothing packed: FlexShard takes
  a rank's own pieces from its local parameters, so its own row is never filled);
* reduce-scatter: an in-place ``all_reduce`` of the rows (what FlexShard did on gloo,
  which has no reduce-scatter: every row travels to every rank) and
  ``reduce_scatter_single`` (torch's: a clone, then an all-reduce), each after the
  gradients are packed into rows (a copy), against each owner's pieces (``--pieces``
  parameters per row) sent straight from the gradients and the received pieces summed in
  rank order (nothing packed).

Per way: the median wall and CPU milliseconds per call on rank 0 (CPU: this process,
every thread), and the ratios collective / direct. Results are checked equal.

    python benchmarks/flexshard_transport.py [--ranks 2] [--width 2097152] [--calls 20]
        [--pieces 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import run_ranks


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run_rank(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    from europa.flexshard.direct import gather_pieces, reduce_scatter_pieces

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        width = args["width"]
        generator = torch.Generator().manual_seed(rank)
        segment = torch.randn(width, generator=generator)
        grads = torch.randn(world, width, generator=generator)

        def gather_collective():
            rows = torch.empty(world, width)
            dist.all_gather_single(rows.view(-1), segment.clone())
            return rows

        own_pieces = list(segment.chunk(args["pieces"]))  # as FlexShard's local parameters
        spans, start = [], 0
        for piece in own_pieces:
            spans.append(slice(start, start + piece.numel()))
            start += piece.numel()

        def gather_direct():
            rows = torch.empty(world, width)
            gather_pieces(own_pieces, rows, [spans] * world, rank, None)
            return rows

        def all_reduce_rows():
            rows = grads.clone()  # the scatter of the gradients into rows
            dist.all_reduce(rows)
            return rows[rank]

        def reduce_scatter_collective():
            rows, mine = grads.clone(), torch.empty(width)
            dist.reduce_scatter_single(mine, rows.view(-1))
            return mine

        def pieces(row: int) -> list[torch.Tensor]:  # views of the gradients, as FlexShard's
            return list(grads[row].chunk(args["pieces"]))

        def reduce_scatter_direct():
            outgoing = [[] if peer == rank else pieces(peer) for peer in range(world)]
            sums, _ = reduce_scatter_pieces(pieces(rank), outgoing, rank, None)
            return torch.cat(sums)

        ways = {
            "gather_collective": gather_collective,
            "gather_direct": gather_direct,
            "reduce_scatter_all_reduce": all_reduce_rows,
            "reduce_scatter_collective": reduce_scatter_collective,
            "reduce_scatter_direct": reduce_scatter_direct,
        }
        gathered = gather_collective()
        summed = reduce_scatter_collective()
        direct = gather_direct()
        direct[rank] = segment  # its own row stays empty: its pieces are where they were
        equal = torch.equal(direct, gathered) and torch.allclose(
            reduce_scatter_direct(), summed, rtol=1e-6, atol=1e-6
        )
        wall = {name: [] for name in ways}
        cpu = {name: [] for name in ways}
        for _ in range(args["rounds"]):
            for name, way in ways.items():
                way()  # warm-up
                dist.barrier()
                started, cpu_started = time.perf_counter(), _cpu_s()
                for _ in range(args["calls"]):
                    way()
                wall[name].append((time.perf_counter() - started) / args["calls"])
                cpu[name].append((_cpu_s() - cpu_started) / args["calls"])
        return {
            "equal": equal,
            "wall_ms": {n: 1e3 * statistics.median(v) for n, v in wall.items()},
            "cpu_ms": {n: 1e3 * statistics.median(v) for n, v in cpu.items()},
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=2097152, help="fp32 elements per row")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--pieces", type=int, default=8, help="parameters per rank's share")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ranks = run_ranks(_run_rank, args.ranks, vars(args))
    first = ranks[0]
    ratios = {}
    for measure in ("wall_ms", "cpu_ms"):
        figures = first[measure]
        ratios[measure] = {
            "gather_collective_over_direct": figures["gather_collective"]
            / figures["gather_direct"],
            "reduce_scatter_all_reduce_over_direct": figures["reduce_scatter_all_reduce"]
            / figures["reduce_scatter_direct"],
            "reduce_scatter_collective_over_direct": figures["reduce_scatter_collective"]
            / figures["reduce_scatter_direct"],
        }
    result = {
        "benchmark": "flexshard_transport",
        "ranks": args.ranks,
        "width": args.width,
        "calls": args.calls,
        "pieces": args.pieces,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "results_equal": all(r["equal"] for r in ranks),
        "rank0": {k: first[k] for k in ("wall_ms", "cpu_ms")},
        "ratios": ratios,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
