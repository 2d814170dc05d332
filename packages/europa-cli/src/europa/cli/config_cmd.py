"""``europa config show``: the resolved TOML, exactly what a run would use."""

from __future__ import annotations

import typer

from europa.cli.options import ConfigArg, PluginOpt, SetOpt
from europa.core.config import config_to_toml
from europa.core.plugins import EuropaPluginManager
from europa.core.session import open_session


def register(app: typer.Typer, manager: EuropaPluginManager) -> typer.Typer:
    config_app = typer.Typer(help="Inspect configuration.")
    app.add_typer(config_app, name="config")

    @config_app.command("show")
    def show_command(
        config: ConfigArg = None, plugin: PluginOpt = None, set_: SetOpt = None
    ) -> None:
        """Print the resolved config: preset ← file ← --set, checked."""
        resolved, _ = open_session(config, set_ or [], plugin or [], manager)
        print(config_to_toml(resolved), end="")

    return config_app
