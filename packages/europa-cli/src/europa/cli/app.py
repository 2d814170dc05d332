"""``europa``: train, plan, plugins, config, data, checkpoint. Every bad input ends in one
line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import sys

import typer

from europa.cli import (
    checkpoint_cmd,
    config_cmd,
    data_cmd,
    hf_cmd,
    lighthouse_cmd,
    plan_cmd,
    plugins_cmd,
    train_cmd,
)
from europa.core.errors import WorkerFailed, is_user_error, one_line
from europa.core.plugins import EuropaPluginManager

USAGE_ERROR = 2


def build_app(manager: EuropaPluginManager) -> typer.Typer:
    app = typer.Typer(
        name="europa",
        help="Train trillion-parameter-class mixture-of-experts models on shared supercomputers.",
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )
    train_cmd.register(app, manager)
    plan_cmd.register(app, manager)
    plugins_cmd.register(app, manager)
    config_app = config_cmd.register(app, manager)
    hf_cmd.register(app, manager, config_app)
    data_cmd.register(app, manager)
    checkpoint_cmd.register(app)
    lighthouse_cmd.register(app)
    manager.all_hooks.europa_register_commands(app=app)  # every installed plugin, enabled or not
    return app


def _fail(message: str, code: int = USAGE_ERROR) -> int:
    print(f"europa: error: {message}", file=sys.stderr)
    return code


def run(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        manager = EuropaPluginManager()
        command = typer.main.get_command(build_app(manager))
        result = command.main(args=args or ["--help"], prog_name="europa", standalone_mode=False)
    except typer.TyperException as err:  # usage errors: unknown option, bad value, ...
        return _fail(" ".join(err.format_message().split()), USAGE_ERROR)
    except typer.Exit as err:
        return err.exit_code
    except typer.Abort:
        return _fail("aborted", 130)
    except WorkerFailed as err:
        return _fail(str(err), err.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as err:  # a plugin's own user-facing errors carry europa_user_error
        if not is_user_error(err):
            raise
        return _fail(one_line(err))
    return result if isinstance(result, int) else 0


def main() -> None:
    from europa.core.process_exit import exit_now

    exit_now(run())
