"""Options shared by several commands."""

from __future__ import annotations

from typing import Annotated

import typer

ConfigArg = Annotated[
    str | None,
    typer.Argument(
        metavar="[CONFIG]",
        help="A TOML file or a preset name (tiny, debug, kimi-k2). Default: tiny.",
        show_default=False,
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", metavar="KEY=VALUE", help="Override one key; the value is TOML."),
]
PluginOpt = Annotated[
    list[str] | None,
    typer.Option("--plugin", "-p", metavar="NAME", help="Switch on a technique plugin."),
]
