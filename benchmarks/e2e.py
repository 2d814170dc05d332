"""End to end: europa's trainer (every layout) against torchtitan 0.3.0's own Trainer.

One invocation, everything in the same run: the ``debug`` preset (the shape of
torchtitan's ``deepseek_v3`` debugmodel), fp32, AdamW, no activation checkpointing, a
fixed global batch (4 × 256 by default: 1 rank × 4 or 2 ranks × 2), the same token ids on
each rank for both systems. europa runs core's layout (plain at 1 rank, FSDP2 at 2),
``-p flexshard`` and, at 2 ranks, core with ``parallel.dp_replicate=2`` (DDP),
``-p flexshard`` with ``parallel.ep=2``, and core and the latter with ``-p overlap``,
each through the Trainer ``europa train`` runs, each on fresh ranks;
torchtitan runs its Trainer through ``_torchtitan_cpu`` twice, as shipped (routed experts
cast to bf16) and with its routed experts in fp32. Each rank gets cores ÷ ranks threads
(2, and 1 per rank, on 2 cores; torchrun gives ``--nproc 2`` one each).

Per configuration: tokens/s from the median timed step (warm-up steps excluded; the
mean beside it, since a shared machine's bursts land in single steps); the step split
into forward, backward, optimizer step and the rest (clipping, load balance, schedule,
logging; torchtitan's forward leaves out its output layer and loss, which its chunked
loss computes, so they count as its backward); the exposed communication within them,
from a torch.profiler window of a few steps after the timed ones; model FLOPs per
token (``europa.core.plan.timing``: 6 × active matmul parameters + causal attention,
no recomputation); achieved FLOP/s and MFU against the fp32 ``torch.mm`` peak measured
in the same run at the model's own matmul shapes and thread setting. Then the ratios
and the targets they are held to (``_e2e_report.TARGETS``).

On one GPU (``--device cuda --dtype bfloat16 --preset small --worlds 1``, the GPU check's
part) the same configurations that run on one rank train in bf16 mixed precision (fp32
parameters and optimizer state, bf16 compute) against torchtitan's Trainer as shipped
(its mixed precision, bf16 routed experts; the fp32-experts variant has nothing to
change there), with and without the CUDA graph of forward and backward its debugmodel
ships with; the clock waits for the GPU at each mark, the peak is bf16 ``torch.mm`` on
that GPU, each configuration's peak GPU memory is reported, the final checkpoint is left
out of the run (the GPU check has minutes, not the write of a 6.5 GB state), and the
targets are the GPU goals (``_e2e_report.GPU_TARGETS``). A configuration that fails is
reported (``failed_configs``, and a last line naming it, exit status 1) and the others
still run.

    python benchmarks/e2e.py [--json] [--out DIR] [--steps 6] [--warmup 2] [--quick]
        [--preset debug] [--device cpu|cuda] [--dtype float32|bfloat16] [--rounds 1]

``--rounds N`` runs every configuration N times, the order reversed each round, and keeps
each configuration's fastest round (every round's tokens/s stays in the JSON): on a shared
machine two configurations run a few minutes apart can differ by 15 % for the machine's
sake alone, and a neighbour only ever slows a round.

``--out DIR`` writes e2e.json, e2e_table.md and e2e_profile_europa.txt (the top 25
operators by self CPU time of each europa run, rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _e2e_ranks import europa_runs, matmul_rates, torchtitan_runs
from _e2e_report import GPU_TARGETS, TARGETS, keep_fastest, markdown_table, ratios_and_targets
from _harness import run_ranks

OVERLAP = ("overlap.timeline=false", 'overlap.reshard_after_forward="none"')
LAYOUTS = (
    # core: plain at 1 rank (fp32, nothing to shard), FSDP2 over 2
    {"name": "core", "plugins": [], "overrides": [], "min_world": 1},
    # fp32 replicas: core's layout is DDP (plain parameters, bucketed gradient all-reduce)
    {"name": "core-ddp", "plugins": [], "overrides": ["parallel.dp_replicate=2"],
     "min_world": 2},
    {"name": "flexshard", "plugins": ["flexshard"], "overrides": ["flexshard.log_plan=false"],
     "min_world": 1},
    {"name": "flexshard-ep2", "plugins": ["flexshard"],
     "overrides": ["flexshard.log_plan=false", "parallel.ep=2"], "min_world": 2},
    # europa-overlap: the next block's gather issued ahead, and gathered blocks kept
    # through backward (no second gather; memory for the speed, as `europa plan` shows)
    {"name": "core+overlap", "plugins": ["overlap"],
     "overrides": [*OVERLAP], "min_world": 2},
    {"name": "flexshard-ep2+overlap", "plugins": ["flexshard", "overlap"],
     "overrides": ["flexshard.log_plan=false", "parallel.ep=2", *OVERLAP], "min_world": 2},
    # the non-expert matrices whole on each rank (DDP-like), the experts split over ep
    {"name": "flexshard-ep2-dense-rank+overlap", "plugins": ["flexshard", "overlap"],
     "overrides": ["flexshard.log_plan=false", "parallel.ep=2", 'flexshard.dense_group="rank"',
                   *OVERLAP], "min_world": 2},
)  # fmt: skip
# torchtitan as shipped (routed experts cast to bf16) and with fp32 experts, each under
# FSDP2 and, at 2 ranks, under its best replicated layout too (HSDP over 2 replicas of one
# shard: torchtitan 0.3.0 has no DDP), so europa's DDP meets torchtitan's fastest layout.
TORCHTITAN_VARIANTS = (
    {"name": "torchtitan-shipped", "fp32_experts": False, "replicate": False, "min_world": 1},
    {"name": "torchtitan-fp32-experts", "fp32_experts": True, "replicate": False,
     "min_world": 1},
    {"name": "torchtitan-shipped-hsdp", "fp32_experts": False, "replicate": True,
     "min_world": 2},
    {"name": "torchtitan-fp32-experts-hsdp", "fp32_experts": True, "replicate": True,
     "min_world": 2},
    # on a GPU its debugmodel ships capturing forward and backward as a CUDA graph
    {"name": "torchtitan-shipped-cudagraphs", "fp32_experts": False, "replicate": False,
     "cuda_graphs": True, "min_world": 1, "device": "cuda"},
)  # fmt: skip


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--out", type=Path, help="also write the JSON, table and profile here")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--profile-steps", type=int, default=2, help="profiled steps after them")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--log-every", type=int, default=10, help="both trainers' log period")
    parser.add_argument("--worlds", default="1,2", help="rank counts, comma-separated")
    parser.add_argument("--quick", action="store_true", help="smoke test: seq 32, 1+1+1 steps")
    parser.add_argument("--preset", default="debug", help="the model both systems train")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every configuration, in alternating order; each keeps "
                        "its fastest")  # fmt: skip
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    if args.quick:
        args.seq_len, args.global_batch = 32, 2
        args.steps = args.warmup = args.profile_steps = 1
    args.worlds = [int(w) for w in args.worlds.split(",")]
    for world in args.worlds:
        if world < 1 or args.global_batch % world:
            parser.error(
                f"--worlds {world}: expected a divisor of --global-batch {args.global_batch}"
            )
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if max(args.worlds) > gpus:
            parser.error(f"--worlds {args.worlds}: expected at most the {gpus} GPU(s) here")
    return args


def model_facts(preset: str, seq_len: int) -> dict[str, Any]:
    """Model FLOPs per token and the matmuls (k, n, tokens per row block) a step runs."""
    from europa.core.config import load_config
    from europa.core.model import build_moe_model
    from europa.core.plan.shapes import ModelShapes
    from europa.core.plan.timing import model_flops_per_token

    m = load_config(preset).model
    with torch.device("meta"):  # shapes only
        model = build_moe_model(m)
    matmuls = set()
    for name, p in model.named_parameters():
        if "tok_embeddings" in name or p.dim() < 2:
            continue
        if "routed_experts" in name:  # E × out × in: each expert sees top_k / E of the tokens
            matmuls.add((p.shape[2], p.shape[1], m.top_k / m.num_experts))
        else:
            matmuls.add((p.shape[1], p.shape[0], 1.0))
    return {
        "model_flops_per_token": model_flops_per_token(ModelShapes.of(model), m, seq_len),
        "matmuls": sorted(matmuls),
        "routing": {
            "top_k": m.top_k,
            "num_experts": m.num_experts,
            "shared_experts_hidden_dim": m.num_shared_experts * m.moe_hidden_dim,
            "score_func": m.score_func,
            "route_norm": m.route_norm,
        },
    }


def model_check(configs: list[dict], facts: dict) -> dict[str, Any]:
    """Whether torchtitan's model, as the launcher builds it, has europa's shape and routing."""
    counts = {c["config"]: c["parameters"] for c in configs}
    titan = next((c for c in configs if c["system"] == "torchtitan"), None)
    routing = {k: v for k, v in titan["routing"].items() if k != "experts_class"} if titan else None
    return {
        "parameters": counts,
        "parameters_equal": len(set(counts.values())) == 1,
        "europa_routing": facts["routing"],
        "torchtitan_routing": routing,
        "routing_equal": routing == facts["routing"],
        "torchtitan_own_flops_per_token": titan["torchtitan_flops_per_token"] if titan else None,
    }


def gemm_peak(world: int, tokens_per_rank: int, matmuls: list, seconds: float, args) -> dict:
    """Per shape, the FLOP/s of all ranks multiplying at once (summed over ranks)."""
    shapes = sorted({(max(1, round(tokens_per_rank * share)), k, n) for k, n, share in matmuls})
    timing = {"trials": 5, "seconds_per_trial": seconds / 5}
    on = {"device": args.device, "dtype": args.dtype}
    ranks = run_ranks(matmul_rates, world, {"shapes": shapes, **timing, **on})
    rates = {s: sum(r["flops_per_s"][s] for r in ranks) for s in ranks[0]["flops_per_s"]}
    return {"threads_per_rank": ranks[0]["threads"], "rates": rates}


def _peak(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    per_shape = {s: max(before["rates"][s], after["rates"][s]) for s in before["rates"]}
    best = max(per_shape, key=per_shape.get)
    return {
        "threads_per_rank": before["threads_per_rank"],
        "flops_per_s_by_shape_mxkxn": per_shape,
        "peak_flops_per_s": per_shape[best],
        "peak_shape_mxkxn": best,
    }


def run_world(args: argparse.Namespace, world: int, facts: dict, root: str, failed: dict):
    """The configurations at this many ranks, between two measurements of the matmul
    peak (the better of the two per shape: a neighbour's burst only lowers a peak). A
    configuration that fails goes into ``failed`` (its error's last lines) and the run
    goes on: the GPU check has one call to learn from."""
    batch = args.global_batch // world
    overrides = [
        f"training.batch_size={batch}",
        f"training.seq_len={args.seq_len}",
        f'training.dtype="{args.dtype}"',
        f"training.steps={args.warmup + args.steps + args.profile_steps}",
        f"metrics.log_every={args.log_every}",
        "metrics.progress=false",
    ]
    gemm_seconds = 0.2 if args.quick else 0.5
    before = gemm_peak(world, batch * args.seq_len, facts["matmuls"], gemm_seconds, args)
    timing = {"warmup": args.warmup, "timed": args.steps, "profiled": args.profile_steps}
    layouts = [layout for layout in LAYOUTS if world >= layout["min_world"]]
    # One fresh process group per configuration: a trainer that ran earlier in the same
    # processes slowed the next one's steps by up to a third (see run_alone).
    on = {"device": args.device, "preset": args.preset}
    europa_args = {"overrides": overrides, "final_save": args.device == "cpu", **on, **timing}
    # torchtitan's own debugmodel where that is the preset, else europa's [model] as its config
    titan_args = {"overrides": overrides[:3], "europa_shape": args.preset != "debug",
                  "log_every": args.log_every, "data_dir": root,
                  "steps": args.warmup + args.steps + args.profile_steps,
                  **on, **timing}  # fmt: skip
    variants = [
        v
        for v in TORCHTITAN_VARIANTS
        if world >= v["min_world"]
        and v.get("device", args.device) == args.device
        and not (v["fp32_experts"] and args.dtype != "float32")
    ]
    # Rounds alternate the order (europa's layouts then torchtitan's variants, then all of
    # it reversed), so no configuration always runs at the same moment of the run.
    europa, titan = {}, {}
    for r in range(args.rounds):
        systems = [
            (europa_runs, {**europa_args, "root": f"{root}/round-{r}"}, "layouts", layouts,
             europa),
            (torchtitan_runs, titan_args, "variants", variants, titan),
        ]  # fmt: skip
        for fn, fn_args, key, configurations, kept in systems if r % 2 == 0 else systems[::-1]:
            ordered = configurations if r % 2 == 0 else configurations[::-1]
            keep_fastest(kept, run_alone(fn, world, fn_args, key, ordered, failed))
    after = gemm_peak(world, batch * args.seq_len, facts["matmuls"], gemm_seconds, args)
    peak = _peak(before, after)
    runs = [("europa", europa), ("torchtitan", titan)]
    configs = [
        _config(system, name, world, batch, result, facts, peak["peak_flops_per_s"])
        for system, results in runs
        for name, result in results.items()
    ]
    return configs, peak


def run_alone(fn, world: int, args: dict, key: str, configurations, failed: dict) -> dict:
    """``fn`` on fresh ranks for each configuration in turn; results by name, and the
    last lines of each failure by name in ``failed``.

    Run one after another in the same processes, the second europa layout took 20-30%
    longer per step than it did when run first, whichever layout it was (user CPU time
    per step unchanged, the idle time grew: fewer cores busy), so the order of the
    configurations decided part of their ratio. The likely cause is the first run's final
    checkpoint: DCP's plans gathered through gloo left libgomp throttled (see
    ``_alone`` in ``europa.core.checkpoint.store`` and ``benchmarks/checkpoint_steps.py``);
    fresh ranks keep the configurations independent of any such state anyway."""
    results: dict[str, Any] = {}
    for configuration in configurations:
        try:
            results.update(run_ranks(fn, world, {**args, key: [configuration]})[0])
        except RuntimeError as err:  # a rank's error, with its traceback
            name = f"{configuration['name']} ({world} rank)"
            failed[name] = str(err).strip().splitlines()[-6:]
            print(f"e2e: {name} failed: {failed[name][-1]}", file=sys.stderr)
    return results


def _config(system, name, world, batch, result, facts, peak_flops) -> dict[str, Any]:
    achieved = result["tokens_per_s"] * facts["model_flops_per_token"]
    return {
        "system": system,
        "config": name,
        "ranks": world,
        "batch_per_rank": batch,
        **result,
        "achieved_flops_per_s": achieved,
        "mfu": achieved / peak_flops,
    }


def main() -> None:
    args = _parse()
    facts = model_facts(args.preset, args.seq_len)
    configs, peaks, failed = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="e2e-") as root:
        for world in args.worlds:
            world_configs, peaks[f"{world}_rank"] = run_world(args, world, facts, root, failed)
            configs += world_configs
    tables = {
        f"{c['config']} ({c['ranks']} rank)": c.pop("operator_table")
        for c in configs
        if "operator_table" in c
    }
    result = {
        "benchmark": "e2e",
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "global_batch": args.global_batch,
        "seq_len": args.seq_len,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "profiled_steps": args.profile_steps,
        "rounds": args.rounds,
        "log_every": args.log_every,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "model_flops_per_token": facts["model_flops_per_token"],
        "model_check": model_check(configs, facts),
        "matmul_peak": peaks,
        "configs": configs,
        "failed_configs": failed,
        **ratios_and_targets(configs, GPU_TARGETS if args.device == "cuda" else TARGETS),
    }
    document = json.dumps(result, indent=2)
    table = markdown_table(configs)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "e2e.json").write_text(document + "\n")
        (args.out / "e2e_table.md").write_text(table + "\n")
        (args.out / "e2e_profile_europa.txt").write_text(
            "".join(f"== europa {name}, rank 0 ==\n{t}\n" for name, t in tables.items() if t)
        )
    print(document if args.json else table)
    if failed:
        sys.exit(f"e2e: {len(failed)} configuration(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
