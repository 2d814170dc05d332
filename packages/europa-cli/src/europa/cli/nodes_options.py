"""``europa train``'s options for several nodes and restarts (``europa.core.launch.nodes``)."""

from __future__ import annotations

from typing import Annotated

import typer

NnodesOpt = Annotated[
    int,
    typer.Option("--nnodes", min=1, help="Nodes in the job; run europa train once on each."),
]
NodeRankOpt = Annotated[
    int,
    typer.Option(
        "--node-rank", min=0, help="This node's index; node 0 hosts the rendezvous and run dir."
    ),
]
RdzvEndpointOpt = Annotated[
    str | None,
    typer.Option(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="Node 0's address and a free port, the same on every node (c10d rendezvous).",
    ),
]
RdzvTimeoutOpt = Annotated[
    int,
    typer.Option("--rdzv-timeout", min=1, help="Seconds to wait for every node to join."),
]
MaxRestartsOpt = Annotated[
    int,
    typer.Option(
        "--max-restarts",
        min=0,
        help="Restart the workers this many times after one fails; they resume by themselves.",
    ),
]
