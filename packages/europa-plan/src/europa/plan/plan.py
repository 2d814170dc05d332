"""A run's plan: what the planner works out for one run, as plain data (the command
prints it as a table or JSON; ``benchmarks/published_runs.py`` compares it with the
published figures)."""

from __future__ import annotations

from typing import Any

from europa.plan.flops import executed_flops, published_step, source_flops_per_token
from europa.plan.memory import hbm_gib, plan_memory
from europa.plan.record import FLOPS_CONVENTIONS, Run
from europa.plan.step_time import predict_step

GIGA = 1e9


def flops_plan(run: Run) -> dict[str, Any]:
    """FLOPs per token (GFLOP): the source's count against ours in its convention, and
    what the GPUs execute by kind."""
    source = run.published.flops_per_token
    planned = source_flops_per_token(run)
    executed = executed_flops(run)
    kinds = ("dense_gemm", "expert_gemm", "attention", "other", "recompute")
    return {
        "flops_per_token": {
            "convention": run.flops_convention,
            "counts": FLOPS_CONVENTIONS[run.flops_convention],
            "source": None if source is None else source / GIGA,
            "planned": planned / GIGA,
            "ratio": None if source is None else planned / source,
        },
        "executed_flops_per_token": {
            **{kind: getattr(executed, kind) / GIGA for kind in kinds},
            "total": executed.total / GIGA,
        },
        "executed_tflop_per_gpu_step": executed.total * run.tokens_per_step / run.gpus / 1e12,
    }


def layout_text(run: Run) -> str:
    lay = run.layout
    parts = [f"tp{lay.tp}" + ("+sp" if lay.sequence_parallel else ""), f"cp{lay.cp}"]
    parts.append(f"pp{lay.pp}" + (f"×vp{lay.vp}" if lay.vp > 1 else "") + f" {lay.schedule}")
    parts.append(f"dp{lay.dp} {lay.dp_kind}" + (f"/{lay.dp_shard}" if lay.dp_shard else ""))
    if run.model.moe:
        parts.append(f"ep{lay.ep} etp{lay.etp}")
    rc = lay.recompute
    parts.append(
        "recompute " + (rc.kind if rc.kind != "selective" else ",".join(sorted(rc.modules)))
    )
    return " ".join(parts)


def memory_plan(run: Run) -> dict[str, Any]:
    """GiB per GPU on the pipeline rank that needs the most, by part, against its HBM."""
    memory = plan_memory(run)
    parts = ("weights", "gradients", "optimizer", "activations", "buffers")
    return {
        "memory_gib": {
            "planned": memory.total,
            "hbm": hbm_gib(run),
            **{part: getattr(memory, part) for part in parts},
            "rank": memory.rank,
            "micro_batches_in_flight": memory.micro_batches_in_flight,
        },
        "fits": memory.total <= hbm_gib(run),
    }


def time_plan(run: Run) -> dict[str, Any]:
    """The predicted step time and its terms, beside the published one: a step time, or
    where the source gives only TFLOP/s, its TFLOP/s against ours (in its convention)."""
    step = predict_step(run)
    published, published_s = run.published, published_step(run)
    out: dict[str, Any] = {
        "predicted_step_s": step.total,
        "predicted_tokens_per_s_per_gpu": run.tokens_per_step / run.gpus / step.total,
        "slowest_rank": step.slowest_rank,
        "bubble_from": step.bubble_from,
        "terms": step.terms,
    }
    if published.step_s is not None:
        out["published_step_s"] = published.step_s
    elif published.tflops_per_gpu is not None:
        out["published_tflops_per_gpu"] = published.tflops_per_gpu
        implied = published.tflops_per_gpu * published_s  # the step's TFLOP a GPU
        out["predicted_tflops_per_gpu"] = implied / step.total
    out["ratio"] = None if published_s is None else step.total / published_s
    return {"time": out}


def plan_run(run: Run) -> dict[str, Any]:
    """The plan of one run, JSON-ready."""
    return {
        "id": run.id,
        "model": run.model.id,
        "gpu": run.gpu.id,
        "gpus": run.gpus,
        "precision": run.precision,
        "layout": layout_text(run),
        "micro_batches": run.micro_batches,
        "tokens_per_step": run.tokens_per_step,
        "assumed": list(run.assumed),
        **flops_plan(run),
        **memory_plan(run),
        **time_plan(run),
    }
