"""``europa train``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from europa.cli.nodes_options import (
    MaxRestartsOpt,
    NnodesOpt,
    NodeRankOpt,
    RdzvEndpointOpt,
    RdzvTimeoutOpt,
)
from europa.cli.options import ConfigArg, PluginOpt, SetOpt
from europa.core.errors import ConfigError
from europa.core.launch.nodes import RDZV_TIMEOUT_SECONDS, Nodes
from europa.core.plugins import EuropaPluginManager
from europa.core.run_dir import CONFIG_FILE, SUMMARY_FILE
from europa.core.session import open_session


def register(app: typer.Typer, manager: EuropaPluginManager) -> None:
    @app.command("train")
    def train_command(
        config: ConfigArg = None,
        plugin: PluginOpt = None,
        set_: SetOpt = None,
        nproc: Annotated[
            int | None,
            typer.Option(
                "--nproc", min=1, help="Local worker processes (default: parallel.nproc)."
            ),
        ] = None,
        run_dir: Annotated[
            Path | None,
            typer.Option("--run-dir", help="Where config, metrics and checkpoints go."),
        ] = None,
        resume: Annotated[
            bool,
            typer.Option(
                "--resume", help="Continue the run in --run-dir from its last checkpoint."
            ),
        ] = False,
        resume_from_older: Annotated[
            bool,
            typer.Option(
                "--resume-from-older",
                help="With --resume: when the newest checkpoint is damaged, continue from "
                "the newest intact one.",
            ),
        ] = False,
        nnodes: NnodesOpt = 1,
        node_rank: NodeRankOpt = 0,
        rdzv_endpoint: RdzvEndpointOpt = None,
        rdzv_timeout: RdzvTimeoutOpt = RDZV_TIMEOUT_SECONDS,
        max_restarts: MaxRestartsOpt = 0,
        replica_group: Annotated[
            int | None,
            typer.Option(
                "--replica-group",
                min=0,
                help="With fault_tolerance.enabled: train this replica group only, in "
                "RUN_DIR/replica-I (one launch per group, e.g. a Slurm job step).",
            ),
        ] = None,
    ) -> None:
        """Train a model: the tiny preset on 2 local CPU processes by default."""
        if resume_from_older and not resume:
            raise typer.BadParameter("--resume-from-older needs --resume: expected both")
        if resume and run_dir is None:
            raise typer.BadParameter("--resume needs --run-dir: expected the run to continue")
        source = config
        if resume and source is None:
            source = str(run_dir / CONFIG_FILE)
            if not Path(source).is_file():
                raise ConfigError(
                    f"--run-dir = {str(run_dir)!r}: holds no {CONFIG_FILE}; expected the "
                    "directory of an earlier run to --resume"
                )
        resolved, plugins = open_session(source, set_ or [], plugin or [], manager)
        from europa.core.launch.launcher import train  # torch and torchtitan: only when training

        nodes = Nodes(nnodes, node_rank, rdzv_endpoint, max_restarts, rdzv_timeout)
        done = train(
            resolved,
            plugins,
            run_dir=run_dir,
            resume=resume,
            nproc=nproc,
            from_older=resume_from_older,
            nodes=nodes,
            replica_group=replica_group,
        )
        print(_finished(done), file=sys.stderr)


def _finished(run_dir: Path) -> str:
    from europa.core.fault.launch import GROUP_DIR

    summary_file = run_dir / SUMMARY_FILE
    if not summary_file.is_file():  # a fault-tolerant run's groups: each stopped as the first
        summary_file = run_dir / GROUP_DIR.format(0) / SUMMARY_FILE
    if not summary_file.is_file():  # another rank of a torchrun job wrote nothing here
        return f"europa: run finished; results in {run_dir}"
    summary = json.loads(summary_file.read_text())
    if summary["first_loss"] is None:
        return f"europa: nothing left to train at step {summary['steps']}; results in {run_dir}"
    if summary["stopped_by"]:
        return (
            f"europa: stopped by {summary['stopped_by']} after step {summary['steps']} of "
            f"{summary['target_steps']}, checkpoint saved; continue with: "
            f"europa train --resume --run-dir {run_dir}"
        )
    return (
        f"europa: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> "
        f"{summary['final_loss']:.3f} in {summary['seconds']:.0f} s; results in {run_dir}"
    )
