"""``europa plan``: will this run fit, and how fast will it go?"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer

from europa.cli.options import ConfigArg, PluginOpt, SetOpt
from europa.core.errors import ConfigError
from europa.core.plugins import EuropaPluginManager
from europa.core.session import open_session

DOES_NOT_FIT = 1


def register(app: typer.Typer, manager: EuropaPluginManager) -> None:
    @app.command("plan")
    def plan_command(
        config: ConfigArg = None,
        plugin: PluginOpt = None,
        set_: SetOpt = None,
        hardware: Annotated[
            str | None,
            typer.Option(
                "--hardware",
                metavar="NAME|PATH.toml",
                help="gh200-jupiter (the default), h100-sxm, h200, cpu, or your own TOML "
                "profile; with --measure-hardware, what is not measured comes from it "
                "(default: the shipped profile nearest this machine).",
            ),
        ] = None,
        nodes: Annotated[
            int | None, typer.Option("--nodes", min=1, help="Nodes in all (GPUs from the profile).")
        ] = None,
        replicas: Annotated[
            int | None, typer.Option("--replicas", min=1, help="Model replicas (dp_replicate).")
        ] = None,
        gpus_per_replica: Annotated[
            int | None,
            typer.Option("--gpus-per-replica", min=1, help="GPUs sharing one replica."),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
        search: Annotated[
            bool,
            typer.Option(
                "--search",
                help="Plan every layout of the ranks given (ep, dense group, micro-batch, "
                "recomputation, offload, overlap, exchange levers) at the same global batch and "
                "print the fastest 5 that fit, with their -p/--set; if none fits, the smallest "
                "replica that fits the config as given.",
            ),
        ] = False,
        measure_hardware: Annotated[
            bool,
            typer.Option(
                "--measure-hardware",
                help="Measure this machine (matmul rates at the model's shapes, collectives "
                "within and across nodes, host-device copies) on parallel.nproc ranks, or the "
                "launcher's, and print or --out a profile with the keys of --hardware's.",
            ),
        ] = False,
        out: Annotated[
            str | None,
            typer.Option("--out", metavar="PATH.toml", help="Where --measure-hardware writes."),
        ] = None,
        execute: Annotated[
            str | None,
            typer.Option(
                "--execute",
                metavar="RANKS",
                help="Then run each of these global ranks' real program of one step (the "
                "best layout's, with --search) on fake tensors at the planned size, each in a "
                "process of its own, and print its memory and bytes beside the plan's: ranks "
                "comma separated, 'last' for the last one.",
            ),
        ] = None,
        runs: Annotated[
            str | None,
            typer.Option(
                "--runs",
                metavar="PATH.toml",
                help="Plan the runs of a runs file instead ([[gpu]], [[model]], [[run]] tables, "
                "as benchmarks/published_runs.toml): FLOPs, memory and step time from "
                "europa-plan, each against its published figures where the file gives them.",
            ),
        ] = None,
        run_id: Annotated[
            str | None,
            typer.Option("--run", metavar="ID", help="With --runs: only this run."),
        ] = None,
        routing: Annotated[
            str | None,
            typer.Option(
                "--routing",
                metavar="MODEL",
                help="With --execute: how tokens pick experts, which sizes the expert "
                "exchange: 'uniform' (the default; node-limited as the config sets it) or "
                "'skew:S' (Zipf popularity with exponent S).",
            ),
        ] = None,
    ) -> None:
        """Memory, communication and step time per rank, from the model on the meta device.
        Exit status: 0 fits, 1 does not fit, 2 bad input."""
        from europa.core.plan import load_profile, make_plan
        from europa.core.plan.report import plan_json, plan_table

        if runs is not None or run_id is not None:
            given = {
                "config": config, "-p": plugin, "--set": set_, "--hardware": hardware,
                "--nodes": nodes, "--replicas": replicas, "--gpus-per-replica": gpus_per_replica,
                "--search": search or None, "--measure-hardware": measure_hardware or None,
                "--out": out, "--execute": execute, "--routing": routing,
            }  # fmt: skip
            _plan_runs(runs, run_id, as_json, {k: v for k, v in given.items() if v})
            return

        overrides = list(set_ or [])
        if out is not None and not measure_hardware:
            raise ConfigError(f"--out = {out!r}: expected only with --measure-hardware")
        routing_model = _routing_model(execute, routing, measure_hardware)
        if measure_hardware:
            base = hardware or _nearest_shipped_profile()
            _measure(config, overrides, plugin or [], manager, load_profile(base), base, out)
            return
        profile = load_profile(hardware or "gh200-jupiter")
        if nodes is not None and (replicas or gpus_per_replica):
            raise ConfigError(
                "--nodes: expected either --nodes or --replicas/--gpus-per-replica, not both"
            )
        if (replicas is None) != (gpus_per_replica is None):
            raise ConfigError(
                "--replicas/--gpus-per-replica: expected both, or --nodes, or neither"
            )
        if replicas is not None:
            overrides += [f"parallel.dp_replicate={replicas}", "parallel.dp_shard=-1"]
        # A search replaces the layout keys, so the rules between keys wait for its layouts.
        resolved, plugins = open_session(
            config, overrides, plugin or [], manager, cross_field_rules=not search
        )
        if replicas is not None:
            world = replicas * gpus_per_replica
        elif nodes is not None:
            world = nodes * profile.gpus_per_node
        else:
            world = resolved.parallel.nproc
        if execute is not None:
            from europa.core.execute.runner import parse_ranks

            ranks = parse_ranks(execute, world)
        from europa.core.job import Job
        from europa.core.plan.shapes import ModelShapes

        shaped = resolved
        if search:  # the routing groups a layout gives the router change no parameter shape
            shaped = dataclasses.replace(
                resolved,
                parallel=dataclasses.replace(resolved.parallel, ep=1, ep_max_nodes_per_token=0),
            )
        model = plugins.hook.europa_build_model(
            job=Job(
                config=shaped, run_dir=".", world_size=world, ranks_per_node=profile.gpus_per_node
            )
        )

        shapes = ModelShapes.of(model)

        def plan_for(cfg, ranks):
            return make_plan(cfg, plugins, profile, ranks, shapes=shapes)

        if not search:
            plan = plan_for(resolved, world)
            document, text = plan_json(plan), plan_table(plan)
            document["europa_plan"] = _checked_plan(resolved, profile.name, world)
            text += "\n" + _checked_line(document["europa_plan"])
        else:
            plan, document, text = _search(
                config, overrides, plugin or [], manager, resolved, profile, world, shapes, plan_for
            )
        if execute is not None:
            document["execution"] = _execute(plan, ranks, routing_model)
            text += "\n\n" + _execution_text(document["execution"])
        print(json.dumps(document, indent=2) if as_json else text)
        if not plan.fits:
            raise typer.Exit(DOES_NOT_FIT)


def _checked_plan(config, hardware: str, world: int) -> dict:
    """The same run planned by europa-plan, the planner checked on published runs, where
    it can price the config; else why not."""
    from europa.core.plan.plan_record import run_record
    from europa.plan.plan import plan_run

    try:
        run = run_record(config, hardware, world)
    except ConfigError as err:
        return {"priced": False, "why": str(err)}
    planned = plan_run(run)
    return {"priced": True, "time": planned["time"], "memory_gib": planned["memory_gib"],
            "fits": planned["fits"], "layout": planned["layout"]}  # fmt: skip


def _checked_line(checked: dict) -> str:
    head = "  europa-plan (checked on published runs):"
    if not checked["priced"]:
        return f"{head} not priced: {checked['why']}"
    memory = checked["memory_gib"]
    return (
        f"{head} {checked['time']['predicted_step_s']:.2f} s a step, "
        f"{memory['planned']:.1f} of {memory['hbm']:.0f} GiB a GPU ({checked['layout']})"
    )


def _plan_runs(path: str | None, run_id: str | None, as_json: bool, others: dict) -> None:
    """``--runs``: each run of a runs file planned by europa-plan, the planner checked on
    published runs; exit 1 when one does not fit its GPU."""
    from europa.plan import load_runs
    from europa.plan.plan import plan_run
    from europa.plan.table import plans_table

    if path is None:
        raise ConfigError(f"--run = {run_id!r}: expected only with --runs")
    if others:
        key, value = next(iter(others.items()))
        raise ConfigError(f"{key} = {value!r}: expected nothing else with --runs (a run file "
                          "states its model, layout and GPU)")  # fmt: skip
    runs_file = load_runs(path)
    plans = [plan_run(run) for run in ([runs_file.run(run_id)] if run_id else runs_file.runs)]
    print(json.dumps({"runs": plans}, indent=2) if as_json else plans_table(plans))
    if not all(plan["fits"] for plan in plans):
        raise typer.Exit(DOES_NOT_FIT)


def _routing_model(execute, routing, measure_hardware):
    from europa.spec.execution import RoutingModel

    if execute is None:
        if routing is not None:
            raise ConfigError(f"--routing = {routing!r}: expected only with --execute")
        return None
    if measure_hardware:
        raise ConfigError(f"--execute = {execute!r}: expected without --measure-hardware")
    return RoutingModel.parse(routing) if routing is not None else RoutingModel()


def _execute(plan, ranks, routing_model) -> list[dict]:
    import sys

    from europa.core.execute.compare import compare_rank
    from europa.core.execute.runner import execute_plan

    if not plan.fits:
        raise ConfigError(f"--execute: {plan.refusal()}; expected a layout that fits")

    def say(rank: int) -> None:
        print(
            f"europa plan: executing rank {rank} of {plan.world_size}", file=sys.stderr, flush=True
        )

    return [compare_rank(plan, r) for r in execute_plan(plan, ranks, routing_model, say)]


def _execution_text(comparisons) -> str:
    from europa.core.execute.report import execution_table

    return execution_table(comparisons)


def _search(source, overrides, plugins, manager, resolved, profile, world, shapes, plan_for):
    """``--search``: the fastest layouts that fit; (the best plan, or, when none fits, the
    smallest replica's for the config as given; its JSON document; its text)."""
    from europa.core.plan.report import plan_json, plan_table
    from europa.core.plan.search import (
        plan_inputs,
        proposals_json,
        proposals_table,
        search_layouts,
        smallest_replica,
        staged_json,
    )

    per_node = resolved.parallel.ranks_per_node or profile.gpus_per_node
    result = search_layouts(
        source=source,
        overrides=overrides,
        plugins=plugins,
        manager=manager,
        plan_for=lambda cfg, _manager: plan_for(cfg, world),  # the same manager, re-enabled
        world_size=world,
        ranks_per_node=per_node,
        plan_inputs=plan_inputs(shapes, profile, world, per_node),
    )
    note = result.note(world, profile.name)
    if result.proposals:
        plan = result.best.plan
        found = {"note": note, "proposals": proposals_json(result), "stages": staged_json(result)}
        text = "\n".join([plan_table(plan), note, proposals_table(result)])
        return plan, plan_json(plan) | {"search": found}, text
    searchable = dataclasses.replace(
        resolved, parallel=dataclasses.replace(resolved.parallel, dp_shard=-1)
    )
    found_plan, replica_note = smallest_replica(searchable, plan_for, profile.gpus_per_node)
    plan = found_plan or plan_for(resolved, world)
    note = f"{note}; {replica_note}"
    found = {"note": note, "proposals": []}
    return plan, plan_json(plan) | {"search": found}, "\n".join([plan_table(plan), note])


def _measure(source, overrides, plugins, manager, base, hardware, out) -> None:
    import shlex
    import sys
    from pathlib import Path

    from europa.core.plan.measure import run_measurement

    if out is not None and (not out.endswith(".toml") or not Path(out).parent.is_dir()):
        raise ConfigError(f"--out = {out!r}: expected a .toml path in an existing folder")
    config, _ = open_session(source, overrides, plugins, manager)
    command = " ".join(["europa", *map(shlex.quote, sys.argv[1:])])
    command += f"  (what it does not measure: profile {hardware})"
    run_measurement(config, base, out, command)


def _nearest_shipped_profile() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    return "gh200-jupiter" if "GH200" in name else "h200" if "H200" in name else "h100-sxm"
