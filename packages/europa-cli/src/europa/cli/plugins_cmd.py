"""``europa plugins``: what is installed, from which distribution, with which hooks."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from europa.core.plugins import DISABLE_ENV, EuropaPluginManager


def register(app: typer.Typer, manager: EuropaPluginManager) -> None:
    @app.command("plugins")
    def plugins_command(
        as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    ) -> None:
        """List every plugin: built-in defaults and installed technique packages."""
        infos = manager.plugins()
        if as_json:
            print(json.dumps([info.as_dict() for info in infos], indent=2))
            return
        for info in infos:
            kind = "built-in" if info.builtin else "installed"
            print(f"{info.name}  ({info.distribution} {info.version}, {kind})")
            for hook in info.hooks:
                print(f"    {hook}")
        if not any(not info.builtin for info in infos):
            print(f"no technique plugins installed (entry-point group 'europa'; {DISABLE_ENV})")
