"""``europa lighthouse``: the torchft Lighthouse a fault-tolerant run's replica groups join."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Annotated

import typer

from europa.core.config.rules import TIMEOUT_LADDERS, first_unclimbed
from europa.core.config.schema import FaultToleranceConfig
from europa.core.errors import LaunchError

DEFAULTS = FaultToleranceConfig()


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
        ] = DEFAULTS.join_timeout_s,
        heartbeat_timeout_s: Annotated[
            float,
            typer.Option(
                "--heartbeat-timeout-s",
                min=0,
                help="A group silent this long leaves the next quorum "
                "(fault_tolerance.heartbeat_timeout_s).",
            ),
        ] = DEFAULTS.heartbeat_timeout_s,
        quorum_tick_s: Annotated[
            float,
            typer.Option(
                "--quorum-tick-s",
                min=0,
                help="How often a quorum is looked for (fault_tolerance.quorum_tick_s).",
            ),
        ] = DEFAULTS.quorum_tick_s,
    ) -> None:
        """Form the quorums of fault-tolerant runs (fault_tolerance.enabled) until stopped."""
        from europa.core.fault.launch import lighthouse

        timings = FaultToleranceConfig(join_timeout_s=join_timeout_s,
                                       heartbeat_timeout_s=heartbeat_timeout_s,
                                       quorum_tick_s=quorum_tick_s)  # fmt: skip
        _check_ladder(timings)

        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        with lighthouse(bind, min_replicas, timings) as address:
            joins = f'--set fault_tolerance.lighthouse="{address}"'
            print(f"europa: lighthouse at {address}; every group's {joins}", file=sys.stderr,
                  flush=True)  # fmt: skip
            stop.wait()


def _check_ladder(timings: FaultToleranceConfig) -> None:
    """The Lighthouse's rungs of ``fault_tolerance``'s ladder, named as its options."""
    unclimbed = first_unclimbed(timings, TIMEOUT_LADDERS[1])
    if unclimbed is not None:
        lower, higher = unclimbed
        raise LaunchError(
            f"{_option(higher)} = {getattr(timings, higher)}: expected more than "
            f"{_option(lower)} ({getattr(timings, lower)})"
        )


def _option(key: str) -> str:
    return "--" + key.replace("_", "-")
