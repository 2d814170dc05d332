"""``europa checkpoint verify``: check a checkpoint's every byte without training."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from europa.cli.options import command_group

DAMAGED = 1  # a finding, not bad input (2)


def register(app: typer.Typer) -> None:
    checkpoint = command_group(app, "checkpoint", "Inspect a run's checkpoints.")

    @checkpoint.command("verify")
    def verify_command(
        run_dir: Annotated[Path, typer.Argument(help="A run directory with checkpoints.")],
        step: Annotated[
            int | None, typer.Option("--step", help="Checkpoint step (default: the newest).")
        ] = None,
        progress: Annotated[
            bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")
        ] = True,
    ) -> None:
        """Read every file of a checkpoint and compare it with the size and crc32c
        recorded when it was written. Exit 0 when intact, 1 when damaged."""
        from europa.core.checkpoint.verify import verify_checkpoint

        found = verify_checkpoint(run_dir, step, progress=progress)
        if found.problem is not None:
            print(
                f"europa: checkpoint {str(found.path)!r} is damaged ({found.problem}); "
                f"expected the bytes written: resume from an older one with --resume "
                "--resume-from-older",
                file=sys.stderr,
            )
            raise typer.Exit(DAMAGED)
        how = "size and crc32c" if found.checksummed else "size only (saved without checksums)"
        rate = found.bytes / found.seconds / 1e9 if found.seconds > 0 else float("inf")
        print(
            f"europa: checkpoint step {found.step} of {run_dir} is intact: {found.files} "
            f"files, {found.bytes / 2**20:.1f} MiB checked by {how} in {found.seconds:.2f} s "
            f"({rate:.2f} GB/s)",
            file=sys.stderr,
        )
