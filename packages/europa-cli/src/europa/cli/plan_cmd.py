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
            str,
            typer.Option(
                "--hardware",
                metavar="NAME|PATH.toml",
                help="gh200-jupiter, h100-sxm, h200, cpu, or your own TOML profile.",
            ),
        ] = "gh200-jupiter",
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
                help="Find the largest micro-batch that fits, or the smallest replica if none.",
            ),
        ] = False,
    ) -> None:
        """Memory, communication and step time per rank, from the model on the meta device.
        Exit status: 0 fits, 1 does not fit, 2 bad input."""
        from europa.core.plan import load_profile, make_plan
        from europa.core.plan.report import plan_json, plan_table
        from europa.core.plan.search import search as search_plan

        profile = load_profile(hardware)
        overrides = list(set_ or [])
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
        resolved, plugins = open_session(config, overrides, plugin or [], manager)
        if replicas is not None:
            world = replicas * gpus_per_replica
        elif nodes is not None:
            world = nodes * profile.gpus_per_node
        else:
            world = resolved.parallel.nproc
        from europa.core.job import Job

        model = plugins.hook.europa_build_model(
            job=Job(
                config=resolved, run_dir=".", world_size=world, ranks_per_node=profile.gpus_per_node
            )
        )

        def plan_for(cfg, ranks):
            return make_plan(cfg, plugins, profile, ranks, model=model)

        note = None
        if search:
            searchable = dataclasses.replace(
                resolved, parallel=dataclasses.replace(resolved.parallel, dp_shard=-1)
            )
            plan, note = search_plan(searchable, plan_for, world, profile.gpus_per_node)
        else:
            plan = plan_for(resolved, world)
        if as_json:
            print(json.dumps(plan_json(plan) | ({"search": note} if note else {}), indent=2))
        else:
            print(plan_table(plan))
            if note:
                print(note)
        if not plan.fits:
            raise typer.Exit(DOES_NOT_FIT)
