"""The planner's step time against measured steps, every layout, in one run.

For each rank count (1, 2, 4 by default) the hardware is measured first, on that many
fresh ranks (``europa plan --measure-hardware``: matmul rates at the model's shapes with
the ranks sharing the machine's cores as training will, collectives, copies). Then each
configuration trains on fresh ranks through the Trainer ``europa train`` runs (the
``_e2e_ranks`` harness: median timed step, forward / backward / optimizer split, the
exposed communication from a profiler window), and ``make_plan`` predicts the same
config with the profile measured in this run. Configurations: core (plain at 1 rank,
FSDP2, DDP), FlexShard, FlexShard with ``ep``, the two-stage exchange (4 ranks as 2
emulated nodes on loopback), each as is, with ``-p overlap`` and with ``-p offload``.

Per configuration: predicted and measured step, their ratio, and the phases (predicted
compute, each traffic kind and exposed communication; measured forward, backward,
optimizer and exposed communication). The overall figure is the largest
|predicted / measured - 1|. Every figure is a prediction checked against a run made
in the same invocation; nothing is carried from another machine.

    python benchmarks/plan_accuracy.py [--json] [--worlds 1,2,4] [--steps 4] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _e2e_ranks import europa_runs
from _harness import run_ranks

PRESET = "debug"
OVERLAP = ("overlap.timeline=false",)
TWO_NODES = ("parallel.ranks_per_node=2",)


def layouts(world: int) -> list[dict[str, Any]]:
    base = [{"name": "core", "plugins": [], "overrides": []}]
    if world > 1:
        base.append({"name": "core-ddp", "plugins": [],
                     "overrides": [f"parallel.dp_replicate={world}"]})  # fmt: skip
    base.append({"name": "flexshard", "plugins": ["flexshard"], "overrides": []})
    if world > 1:
        base.append({"name": f"flexshard-ep{world}", "plugins": ["flexshard"],
                     "overrides": [f"parallel.ep={world}"]})  # fmt: skip
    if world == 4:
        base.append({"name": "flexshard-ep4-two-level", "plugins": ["flexshard"],
                     "overrides": ["parallel.ep=4", *TWO_NODES]})  # fmt: skip
    out = []
    for layout in base:
        out.append(layout)
        if world > 1:
            out.append({**layout, "name": layout["name"] + "+overlap",
                        "plugins": [*layout["plugins"], "overlap"],
                        "overrides": [*layout["overrides"], *OVERLAP]})  # fmt: skip
        out.append({**layout, "name": layout["name"] + "+offload",
                    "plugins": [*layout["plugins"], "offload"],
                    "overrides": [*layout["overrides"], "offload.host_memory_gib=8"]})  # fmt: skip
    for layout in out:
        if "flexshard" in layout["plugins"]:
            layout["overrides"] = [*layout["overrides"], "flexshard.log_plan=false"]
    return out


def _node_settings(layout: dict) -> tuple[str, ...]:
    return tuple(o for o in layout["overrides"] if o.startswith("parallel.ranks_per_node"))


def measure_profile(world: int, overrides: list[str], out: Path) -> dict[str, Any]:
    sets = [f for o in [*overrides, f"parallel.nproc={world}", "parallel.device=\"cpu\""]
            for f in ("--set", o)]  # fmt: skip
    command = [sys.executable, "-m", "europa.cli", "plan", PRESET, "--hardware", "cpu",
               "--measure-hardware", "--out", str(out), *sets]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    raw = done.stdout[done.stdout.index("{") :]
    return {"seconds": time.perf_counter() - started, "raw": json.loads(raw)}


def predict(world: int, overrides: list[str], layout: dict, profile: Path) -> dict[str, Any]:
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session

    config, plugins = open_session(
        PRESET, [*overrides, *layout["overrides"], f"parallel.nproc={world}"], layout["plugins"]
    )
    plan = make_plan(config, plugins, load_profile(str(profile)), world)
    step = plan.with_overlap if plan.overlap_enabled else plan.without_overlap
    return {
        "step_s": step.step_s,
        "compute_s": step.compute_s,
        "exposed_communication_s": step.exposed_s,
        "traffic_s": {f"{kind}@{link}": s for (kind, link), s in step.link_s.items()},
    }


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    args = parser.parse_args()
    args.worlds = [int(w) for w in args.worlds.split(",")]
    return args


def main() -> None:
    args = _parse()
    configs = []
    steps = args.warmup + args.steps + args.profile_steps
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            overrides = [f"training.seq_len={args.seq_len}",
                         f"training.batch_size={args.global_batch // world}",
                         "metrics.log_every=1000", "metrics.progress=false",
                         f"training.steps={steps}"]  # fmt: skip
            chosen = [lay for lay in layouts(world)
                      if not args.only or lay["name"] in args.only.split(",")]  # fmt: skip
            # One profile per node layout: emulated nodes measure their "between nodes" link.
            profiles = {}
            for nodes in sorted({_node_settings(lay) for lay in chosen}):
                path = Path(tmp) / f"measured-{world}{'-'.join(('', *nodes))}.toml"
                found = measure_profile(world, [*overrides, *nodes], path)
                profiles[nodes] = path
                name = f"profile@{world}{''.join(nodes)}"
                configs.append({"name": name, "measured_hardware": found,
                                "profile": path.read_text()})  # fmt: skip
            for layout in chosen:
                profile = profiles[_node_settings(layout)]
                run_args = {"preset": PRESET, "overrides": overrides, "layouts": [layout],
                            "root": tmp, "warmup": args.warmup, "timed": args.steps,
                            "profiled": args.profile_steps}  # fmt: skip
                measured = run_ranks(europa_runs, world, run_args)[0][layout["name"]]
                measured.pop("operator_table", None)
                predicted = predict(world, overrides, layout, profile)
                configs.append({
                    "name": f"{layout['name']}@{world}",
                    "world": world,
                    "plugins": layout["plugins"],
                    "overrides": layout["overrides"],
                    "predicted": predicted,
                    "measured": {k: measured[k] for k in
                                 ("step_s", "step_s_all", "phases_s", "exposed_communication_s")},
                    "ratio": predicted["step_s"] / measured["step_s"],
                })  # fmt: skip
                if not args.json:
                    c = configs[-1]
                    said, saw = predicted["step_s"], measured["step_s"]
                    step = f"predicted {said:.3f} s  measured {saw:.3f} s"
                    print(f"{c['name']:<36} {step}  ratio {c['ratio']:.3f}", flush=True)
    ratios = [c["ratio"] for c in configs if "ratio" in c]
    worst = max(ratios, key=lambda r: abs(r - 1))
    print(json.dumps({
        "benchmark": "plan_accuracy",
        "preset": PRESET,
        "args": vars(args),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "configs": configs,
        "comparisons": {
            "largest_abs_error": abs(worst - 1),
            "worst_ratio": worst,
            "within_20_percent": sum(abs(r - 1) <= 0.2 for r in ratios),
            "configurations": len(ratios),
        },
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
