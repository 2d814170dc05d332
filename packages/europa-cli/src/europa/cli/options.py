"""Options, and the sub-command group, shared by several commands."""

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


def command_group(app: typer.Typer, name: str, help: str) -> typer.Typer:
    """``europa NAME``: a group of sub-commands added to ``app``, which prints its help when
    given no sub-command."""
    group = typer.Typer(
        name=name, help=help, no_args_is_help=True, add_completion=False, rich_markup_mode=None
    )
    app.add_typer(group)
    return group
