"""``europa lighthouse``: the torchft Lighthouse a fault-tolerant run's replica groups join."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command("lighthouse")
    def lighthouse_command(
        bind: Annotated[
            str,
            typer.Option(
                "--bind",
                help="host:port to listen on; 127.0.0.1 keeps it on this machine, a "
                "cluster's groups need an address they reach.",
            ),
        ] = "127.0.0.1:29510",
        min_replicas: Annotated[
            int, typer.Option("--min-replicas", min=1, help="Groups a quorum needs.")
        ] = 1,
        join_timeout_s: Annotated[
            float,
            typer.Option(
                "--join-timeout-s",
                min=0,
                help="How long a quorum waits for a live group that has not asked yet "
                "(fault_tolerance.join_timeout_s).",
            ),
        ] = 90.0,
    ) -> None:
        """Form the quorums of fault-tolerant runs (fault_tolerance.enabled) until stopped."""
        from europa.core.fault.launch import lighthouse

        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        with lighthouse(bind, min_replicas, join_timeout_s) as address:
            joins = f'--set fault_tolerance.lighthouse="{address}"'
            print(f"europa: lighthouse at {address}; every group's {joins}", file=sys.stderr,
                  flush=True)  # fmt: skip
            stop.wait()
