"""``europa train``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from europa.cli.options import ConfigArg, PluginOpt, SetOpt
from europa.core.plugins import EuropaPluginManager
from europa.core.session import open_session
from europa.core.train.launch import train
from europa.core.train.run_dir import CONFIG_FILE


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
    ) -> None:
        """Train a model: the tiny preset on 2 local CPU processes by default."""
        if resume and run_dir is None:
            raise typer.BadParameter("--resume needs --run-dir: expected the run to continue")
        source = config
        if resume and source is None:
            source = str(run_dir / CONFIG_FILE)
        resolved, plugins = open_session(source, set_ or [], plugin or [], manager)
        done = train(resolved, plugins, run_dir=run_dir, resume=resume, nproc=nproc)
        print(f"europa: run finished; results in {done}", file=sys.stderr)
