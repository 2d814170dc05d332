"""A run across nodes listens on the addresses it was given alone: two emulated nodes
(network namespaces joined by a veth pair, each end an address of its own), a launcher in
each, the rendezvous endpoint on node 0's address. While they train and save in the
background, no socket of the run listens on a wildcard address."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.test_loopback import WILDCARDS, _address, _descendants, _saved, _sockets_of

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NAMESPACES = (f"europa-listen-{os.getpid()}-0", f"europa-listen-{os.getpid()}-1")
ADDRESSES = ("10.213.0.1", "10.213.0.2")
DEVICES = ("eulisten0", "eulisten1")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_nodes():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and ip")
    try:
        for ns in NAMESPACES:
            _ip("netns", "add", ns)
        _ip("link", "add", DEVICES[0], "type", "veth", "peer", "name", DEVICES[1])
        for ns, device, address in zip(NAMESPACES, DEVICES, ADDRESSES, strict=True):
            _ip("link", "set", device, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", ns, "link", "set", device, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in NAMESPACES:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _listening_in(pid: int) -> dict[int, str]:
    """The listening TCP sockets of ``pid``'s network namespace: inode -> address:port."""
    found = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                host, port = fields[1].split(":")
                found[int(fields[9])] = f"{_address(host)}:{int(port, 16)}"
    return found


def test_two_nodes_listen_on_their_own_addresses_alone(tmp_path, two_nodes):
    run_dir, port = tmp_path / "run", 29517
    train = [sys.executable, "-m", "europa.cli", "train", "tiny", "--nnodes", "2", "--nproc", "1",
             "--rdzv-endpoint", f"{ADDRESSES[0]}:{port}", "--run-dir", str(run_dir),
             "--set", "training.steps=400", "--set", "training.seq_len=32",
             "--set", "training.batch_size=2", "--set", "checkpoint.every=2",
             "--set", 'checkpoint.mode="async"', "--set", "metrics.progress=false"]  # fmt: skip
    launchers = []
    try:
        for node in (0, 1):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": DEVICES[node]}
            command = ["ip", "netns", "exec", NAMESPACES[node], *train, "--node-rank", str(node)]
            log = (tmp_path / f"node{node}.log").open("w")
            launchers.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + 150
        while not _saved(run_dir / "metrics.jsonl"):  # the background writers are up
            for node, launcher in enumerate(launchers):
                assert launcher.poll() is None, (tmp_path / f"node{node}.log").read_text()
            assert time.monotonic() < deadline, "no save within 150 s"
            time.sleep(0.2)
        for node, launcher in enumerate(launchers):
            pids = _descendants(launcher.pid)
            listening = _listening_in(launcher.pid)  # its node's namespace
            ours = {listening[i] for i in _sockets_of(pids) if i in listening}
            assert ours, f"node {node} listens nowhere: the test sees none of its sockets"
            wide = sorted(a for a in ours if a.rsplit(":", 1)[0] in WILDCARDS)
            assert not wide, f"node {node} listens on every interface: {wide} ({sorted(ours)})"
            hosts = {a.rsplit(":", 1)[0] for a in ours}
            assert hosts == {ADDRESSES[node]}, (node, sorted(ours))
    finally:
        for launcher in launchers:
            launcher.kill()
            launcher.wait(30)
        subprocess.run(["pkill", "-f", str(run_dir)], capture_output=True)
