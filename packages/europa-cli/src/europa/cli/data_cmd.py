"""``europa data prepare``: tokenise text into memory-mapped shards for ``data.path``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from europa.cli.options import command_group
from europa.core.plugins import EuropaPluginManager


def register(app: typer.Typer, manager: EuropaPluginManager) -> None:
    data = command_group(app, "data", "Prepare training data.")

    @data.command("prepare")
    def prepare_command(
        inputs: Annotated[
            list[Path],
            typer.Argument(
                metavar="INPUT...",
                help=".txt, .jsonl, .jsonl.gz or .parquet files, or folders of them.",
                show_default=False,
            ),
        ],
        out: Annotated[Path, typer.Option("--out", help="The prepared directory (for data.path).")],
        tokenizer: Annotated[
            Path | None,
            typer.Option("--tokenizer", help="A tokenizers JSON file. Default: the embedded one."),
        ] = None,
        workers: Annotated[
            int | None,
            typer.Option("--workers", min=1, help="Worker processes (default: the CPU count)."),
        ] = None,
        text_field: Annotated[
            str, typer.Option("--text-field", help="The text field of .jsonl and .parquet rows.")
        ] = "text",
        progress: Annotated[
            bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")
        ] = True,
    ) -> None:
        """Tokenise INPUT... into token shards, a document index and a manifest in --out.

        Restartable: shards already complete are kept. Train on the result with
        --set data.path=OUT."""
        from europa.core.data.prepare import prepare_corpus

        manifest = prepare_corpus(
            inputs,
            out,
            tokenizer=tokenizer,
            workers=workers or os.cpu_count() or 1,
            text_field=text_field,
            progress=progress,
        )
        print(
            f"europa: prepared {manifest['documents']} documents, {manifest['tokens']} tokens "
            f"({manifest['dtype']}) in {len(manifest['shards'])} shard(s); train with "
            f"--set data.path={out}",
            file=sys.stderr,
        )
