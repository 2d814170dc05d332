"""``europa import-hf``, ``europa export-hf`` and ``europa config from-hf / to-hf``:
Hugging Face DeepSeek-V3 checkpoints in and out."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from europa.cli.options import ConfigArg, PluginOpt, SetOpt
from europa.core.errors import ConfigError
from europa.core.plugins import EuropaPluginManager
from europa.core.session import open_session

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``5GB``, ``500MiB`` or a number of bytes."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"--max-shard-size = {text!r}: expected a size such as 5GB or 500MiB")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").upper()])


def model_overrides(table: dict) -> list[str]:
    """``--set model.KEY=VALUE`` strings for a derived ``[model]`` table."""
    from europa.core.config.values import show

    return [f"model.{key}={show(value)}" for key, value in table.items()]


def _derived_table(directory: Path) -> dict:
    from europa.core.hf.config_map import model_table_from_hf, read_config

    return model_table_from_hf(read_config(directory), str(directory / "config.json"))


def register(app: typer.Typer, manager: EuropaPluginManager, config_app: typer.Typer) -> None:
    @config_app.command("from-hf")
    def from_hf_command(
        directory: Annotated[Path, typer.Argument(help="A Hugging Face checkpoint folder.")],
    ) -> None:
        """Print the [model] table of a Hugging Face DeepSeek-V3 checkpoint (with init_from)."""
        import tomli_w

        table = _derived_table(directory) | {"init_from": f"hf:{directory.resolve()}"}
        print(f"# [model] of {directory.resolve() / 'config.json'}")
        print(tomli_w.dumps({"model": table}), end="")

    @config_app.command("to-hf")
    def to_hf_command(
        config: ConfigArg = None,
        plugin: PluginOpt = None,
        set_: SetOpt = None,
        dtype: Annotated[str, typer.Option("--dtype", help="torch_dtype to declare.")] = "float32",
    ) -> None:
        """Print the Hugging Face config.json of a config's [model]."""
        from europa.core.hf.config_map import hf_config_from_model

        resolved, _ = open_session(config, set_ or [], plugin or [], manager)
        print(json.dumps(hf_config_from_model(resolved.model, dtype), indent=2))

    @app.command("import-hf")
    def import_hf_command(
        directory: Annotated[Path, typer.Argument(help="A Hugging Face checkpoint folder.")],
        config: ConfigArg = None,
        plugin: PluginOpt = None,
        set_: SetOpt = None,
        nproc: Annotated[
            int | None, typer.Option("--nproc", min=1, help="Ranks to plan for.")
        ] = None,
        as_json: Annotated[
            bool, typer.Option("--json", help="Print the plan, tensor by tensor, as JSON.")
        ] = False,
    ) -> None:
        """Check a checkpoint against [model] and plan its import on the meta device.

        Without CONFIG the [model] table is derived from the checkpoint. Nothing
        is allocated; load it with the `europa train` line this prints."""
        from europa.core.hf.plan import describe, plan_import
        from europa.core.job import Job

        sets = list(set_ or [])
        if config is None:
            sets = model_overrides(_derived_table(directory)) + sets
        resolved, plugins = open_session(config, sets, plugin or [], manager)
        world = nproc or resolved.parallel.nproc
        job = Job(config=resolved, run_dir=Path("."), world_size=world)
        result = plan_import(directory, job, plugins, world, per_tensor=as_json)
        if as_json:
            print(json.dumps(result, indent=1))
            return
        print(describe(result))
        if config is None:
            how = f"europa config from-hf {directory} > model.toml && europa train model.toml"
        else:
            how = f"europa train {config} --set model.init_from='\"hf:{directory.resolve()}\"'"
        print(f"load it: {how}", file=sys.stderr)

    @app.command("export-hf")
    def export_hf_command(
        run_dir: Annotated[Path, typer.Argument(help="A run directory with checkpoints.")],
        out: Annotated[Path, typer.Option("--out", help="A new folder for the checkpoint.")],
        step: Annotated[
            int | None, typer.Option("--step", help="Checkpoint step (default: the newest).")
        ] = None,
        max_shard_size: Annotated[
            str, typer.Option("--max-shard-size", help="Largest safetensors file, e.g. 5GB.")
        ] = "5GB",
        dtype: Annotated[
            str, typer.Option("--dtype", help="float32 (as trained) or bfloat16.")
        ] = "float32",
    ) -> None:
        """Write a run's checkpoint as a Hugging Face DeepSeek-V3 checkpoint."""
        from europa.core.hf.export import export_hf

        done = export_hf(
            run_dir, out, step=step, max_shard_bytes=parse_size(max_shard_size), dtype=dtype
        )
        print(
            f"europa: step {done['step']} of {run_dir}: {done['tensors']} tensors, "
            f"{done['bytes'] / 2**20:.1f} MiB in {done['files']} file(s) at {out}",
            file=sys.stderr,
        )
