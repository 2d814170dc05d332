"""Expert parallelism in europa-flexshard: ep = 1, 2, 4 on the same ranks, in one run.

The same model (the ``debug`` preset by default), data and optimizer train a few
steps on 4 gloo processes under ``-p flexshard`` with each ``parallel.ep``
(every rank reads its own sequences, so the global batch is the same). Per
configuration:
  * tokens/s and step time (median over the timed steps, rank 0's record);
  * expert exchange bytes per rank and step sent to the other ranks, counted by
    wrapping the all-to-alls actually issued (``_links``, in a step of its own),
    against the figure ``europa_plan`` states for the same config;
  * routed-expert bytes per rank: stored (the rank's own parameters) and read
    by its grouped GEMMs in one forward (counted from the expert weight tensors
    the expert modules see: at ep = 1 every layer's full stack is gathered);
  * one profiled step split into expert compute (``aten::_grouped_mm``,
    forward and backward) and expert all-to-all (the all-to-all ops and the
    waits for them), the mean over ranks.

    python benchmarks/expert_parallel.py [--json] [--ep 1 2 4] [--ranks 4] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import local_bytes, print_result, run_ranks, trainer_on_rank
from _links import LinkCounter

ALL_TO_ALL_EVENTS = ("all_to_all", "alltoall", "wait_tensor")


def _expert_weights_read(trainer) -> tuple[list[int], list]:
    """Bytes of the expert weights each expert module sees, one entry per call."""
    seen: list[int] = []

    def record(module, args, output):
        seen.append(sum(local_bytes(getattr(module, n)) for n, p in module.named_parameters()
                        if p.ndim == 3))  # fmt: skip

    handles = [
        module.inner_experts.register_forward_hook(record)
        for module in trainer.model.modules()
        if hasattr(module, "inner_experts") and hasattr(module, "token_dispatcher")
    ]
    return seen, handles


def _profile_split(trainer, step: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(step)
    grouped = a2a = 0.0
    for event in prof.key_averages():
        if event.key == "aten::_grouped_mm":
            grouped += event.cpu_time_total
        elif any(part in event.key for part in ALL_TO_ALL_EVENTS):
            a2a += event.self_cpu_time_total
    return {"expert_compute_s": grouped / 1e6, "all_to_all_s": a2a / 1e6}


def _planned(trainer) -> dict:
    from europa.core.model import build_moe_model
    from europa.flexshard import plugin

    job = trainer.job
    model = build_moe_model(job.config.model)
    plan = {
        "parameter_shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
        "world_size": job.world_size,
    }
    plugin.europa_plan(job=job, plan=plan)
    return plan["flexshard"]


def _run_rank(rank: int, world: int, args: dict) -> dict:
    overrides = [
        f"parallel.ep={args['ep']}",
        f"training.batch_size={args['batch_size']}",
        f"training.seq_len={args['seq_len']}",
        f"training.steps={args['steps']}",
    ]
    with trainer_on_rank(rank, world, args["preset"], overrides, ["flexshard"]) as trainer:
        layout = trainer.job.state["flexshard"]
        stored = sum(
            local_bytes(p) for n, p in layout.named_local_parameters() if layout.spec(n).stacked
        )
        records, split, read = [], {}, []
        counter = LinkCounter(per_node=world)  # one node: every byte on its intra-node link
        for step in range(args["steps"]):
            if step == 1:
                read, handles = _expert_weights_read(trainer)
                with counter:
                    records.append(trainer.step(step))
                for handle in handles:
                    handle.remove()
            elif step == 2:
                split = _profile_split(trainer, step)
            else:
                records.append(trainer.step(step))
        timed = records[2:]
        return {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "step_s": statistics.median(r["step_time_s"] for r in timed),
            "all_to_all_bytes": sum(counter.totals().values()),
            "all_to_all_calls": counter.calls,
            "routed_expert_bytes_stored": stored,
            # the first forward's calls: one per MoE layer (a recompute would repeat them)
            "routed_expert_bytes_read_per_forward": sum(read[: len(handles)]),
            "losses": [r["loss"] for r in records],
            "planned": _planned(trainer) if rank == 0 else None,
            **split,
        }


def _summary(ep: int, per_rank: list[dict]) -> dict:
    planned = per_rank[0]["planned"]
    counted = statistics.mean(r["all_to_all_bytes"] for r in per_rank)
    plan_bytes = planned.get("expert_all_to_all_bytes_per_rank_per_step", 0)
    return {
        "ep": ep,
        "tokens_per_s": per_rank[0]["tokens_per_s"],
        "step_s": per_rank[0]["step_s"],
        "all_to_all_bytes_per_rank_counted": counted,
        "all_to_all_bytes_per_rank_planned": plan_bytes,
        "counted_over_planned": counted / plan_bytes if plan_bytes else None,
        "routed_expert_bytes_stored_per_rank": [r["routed_expert_bytes_stored"] for r in per_rank],
        "routed_expert_bytes_read_per_rank": [
            r["routed_expert_bytes_read_per_forward"] for r in per_rank
        ],
        "expert_compute_s": statistics.mean(r["expert_compute_s"] for r in per_rank),
        "all_to_all_s": statistics.mean(r["all_to_all_s"] for r in per_rank),
        "losses": per_rank[0]["losses"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="1 warm-up, 1 counted, 1 profiled")
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4 (warm-up, counted, profiled, timed)")

    configs = []
    for ep in args.ep:
        result = _summary(ep, run_ranks(_run_rank, args.ranks, vars(args) | {"ep": ep}))
        configs.append(result)
        if not args.json:
            print(json.dumps(result), file=sys.stderr)
    by_ep = {c["ep"]: c for c in configs}
    base = by_ep.get(1)
    comparisons = {}
    if base is not None:
        for ep, c in by_ep.items():
            comparisons[f"ep{ep}"] = {
                "tokens_per_s_over_ep1": c["tokens_per_s"] / base["tokens_per_s"],
                "max_routed_expert_bytes_read_over_ep1": max(c["routed_expert_bytes_read_per_rank"])
                / max(base["routed_expert_bytes_read_per_rank"]),
                "final_loss_relative_difference": abs(c["losses"][-1] - base["losses"][-1])
                / abs(base["losses"][-1]),
            }
    print_result("expert_parallel", args, configs, comparisons, ranks=args.ranks)


if __name__ == "__main__":
    main()
