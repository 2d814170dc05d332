"""Where this launcher's workers stand among the nodes of a job, and the rendezvous
that joins them: ``europa train --nnodes N --node-rank R --rdzv-endpoint HOST:PORT``.

One ``europa train`` per node starts ``--nproc`` workers through torch's elastic
agent; the agents meet at a c10d rendezvous whose store node 0 hosts at HOST:PORT
(as with ``torchrun --rdzv-backend c10d``; it has no authentication: keep it on the
cluster's private network). The rendezvous, not ``--node-rank``, numbers the ranks.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from europa.core.errors import LaunchError

RDZV_TIMEOUT_SECONDS = 600  # torch's default wait for every node to join


@dataclass(frozen=True)
class Nodes:
    count: int = 1
    rank: int = 0
    endpoint: str | None = None  # HOST:PORT of node 0's rendezvous store
    max_restarts: int = 0  # restarts of the whole worker group after a worker fails
    rdzv_timeout: int = RDZV_TIMEOUT_SECONDS

    def check(self) -> None:
        """One line for an inconsistent set of options."""
        if self.count < 1:
            raise LaunchError(f"--nnodes = {self.count}: expected an integer >= 1")
        if not 0 <= self.rank < self.count:
            raise LaunchError(
                f"--node-rank = {self.rank}: expected 0 <= node rank < --nnodes ({self.count})"
            )
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts = {self.max_restarts}: expected an integer >= 0")
        if self.rdzv_timeout < 1:
            raise LaunchError(f"--rdzv-timeout = {self.rdzv_timeout}: expected seconds >= 1")
        if self.count > 1 and not self.endpoint:
            raise LaunchError(
                f"--nnodes = {self.count}: expected --rdzv-endpoint HOST:PORT, the address of "
                "node 0, the same on every node"
            )
        if self.endpoint is not None:
            host, _, port = self.endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise LaunchError(
                    f"--rdzv-endpoint = {self.endpoint!r}: expected HOST:PORT with a port "
                    "between 1 and 65535"
                )

    @property
    def several(self) -> bool:
        return self.count > 1

    @property
    def prepares_run_dir(self) -> bool:
        """Node 0 checks and writes the shared run directory; the others only read it."""
        return self.rank == 0

    def run_id(self, run_dir: Path) -> str:
        """The rendezvous id: the same on every node of a job (its run directory's name)."""
        return f"europa-{run_dir.name}" if self.several else f"europa-{uuid.uuid4().hex[:8]}"

    def rdzv_configs(self) -> dict[str, object]:
        return {"is_host": self.rank == 0, "join_timeout": self.rdzv_timeout}
