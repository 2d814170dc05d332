"""Two emulated nodes on one machine: two network namespaces joined by a veth pair whose
two ends are rate-limited with ``tc ... tbf`` (``netem`` is missing on these machines;
the burst must exceed the MTU).

Ranks started in one namespace reach each other over that namespace's loopback (fast:
traffic to a local address never leaves through the veth), and the other namespace's
ranks over the veth (throttled). An MTU of 65000 keeps the kernel's per-packet work off
the 2 cores. Needs root for ``ip netns`` and ``tc``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class TwoNodes:
    namespaces: tuple[str, str]
    addresses: tuple[str, str]  # one per namespace, on its end of the veth

    @property
    def devices(self) -> tuple[str, str]:
        return self.namespaces  # each veth end is named after its namespace

    def command(self, node: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def environment(self, node: int) -> dict[str, str]:
        """Where a rank of ``node`` binds gloo, and where rank 0 (on node 0) listens."""
        return {"GLOO_SOCKET_IFNAME": self.devices[node], "MASTER_ADDR": self.addresses[0]}


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def teardown(nodes: TwoNodes) -> None:
    for ns in nodes.namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def emulated_link(
    nodes: TwoNodes, rate_mbit: float, burst_kb: int, latency_ms: int, mtu: int
) -> str | None:
    """Set up the namespaces and the rate-limited veth pair; None, or why not."""
    if os.geteuid() != 0:
        return "not root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "ip or tc missing"
    teardown(nodes)
    try:
        for ns in nodes.namespaces:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", nodes.devices[0], "type", "veth", "peer", "name", nodes.devices[1])
        for ns, dev, addr in zip(nodes.namespaces, nodes.devices, nodes.addresses, strict=True):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "mtu", str(mtu), "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", f"{rate_mbit}mbit", "burst", f"{burst_kb}kb", "latency",
                f"{latency_ms}ms")  # fmt: skip
    except (subprocess.CalledProcessError, OSError) as err:
        teardown(nodes)
        detail = getattr(err, "stderr", "") or str(err)
        return f"network namespace set-up failed: {' '.join(detail.split())}"
    return None
