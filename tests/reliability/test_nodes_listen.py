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


def test_fault_tolerant_groups_on_two_nodes_listen_on_their_own_addresses_alone(
    tmp_path, two_nodes
):
    """A Lighthouse on node 0's address, a replica group on each node (one rank each):
    each group's torchft manager server listens on its node's address toward the
    Lighthouse, which it advertises, not on every interface."""
    run_dir, port = tmp_path / "run", 29518
    lighthouse = f"http://{ADDRESSES[0]}:{port}"
    server = ["ip", "netns", "exec", NAMESPACES[0], sys.executable, "-m", "europa.cli",
              "lighthouse", "--bind", f"{ADDRESSES[0]}:{port}", "--min-replicas", "2"]  # fmt: skip
    ft = [f'fault_tolerance.lighthouse="{lighthouse}"', "fault_tolerance.enabled=true",
          "parallel.dp_replicate=2", "training.steps=400", "training.seq_len=32",
          "training.batch_size=2", "metrics.progress=false"]  # fmt: skip
    group = [sys.executable, "-m", "europa.cli", "train", "tiny", "--nproc", "1",
             "--run-dir", str(run_dir), *(arg for key in ft for arg in ("--set", key))]  # fmt: skip
    started = []
    try:
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        started.append(subprocess.Popen(server, **quiet))
        deadline = time.monotonic() + 60
        while f"{ADDRESSES[0]}:{port}" not in _listening_in(started[0].pid).values():
            assert started[0].poll() is None and time.monotonic() < deadline, "no Lighthouse"
            time.sleep(0.1)
        for node in (0, 1):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": DEVICES[node]}
            where = ["ip", "netns", "exec", NAMESPACES[node]]
            command = [*where, *group, "--replica-group", str(node)]
            log = (tmp_path / f"group{node}.log").open("w")
            started.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + 150
        while not all(_committed(run_dir / f"replica-{g}" / "metrics.jsonl") for g in (0, 1)):
            for node, process in enumerate(started[1:]):
                assert process.poll() is None, (tmp_path / f"group{node}.log").read_text()
            assert time.monotonic() < deadline, "the groups did not both step within 150 s"
            time.sleep(0.2)
        for node, process in enumerate(started[1:]):
            pids = _descendants(process.pid)
            listening = _listening_in(process.pid)
            ours = {listening[i] for i in _sockets_of(pids) if i in listening}
            assert ours, f"group {node} listens nowhere: the test sees none of its sockets"
            wide = sorted(a for a in ours if a.rsplit(":", 1)[0] in WILDCARDS)
            assert not wide, f"group {node} listens on every interface: {wide} ({sorted(ours)})"
            hosts = {a.rsplit(":", 1)[0] for a in ours}
            assert hosts <= {ADDRESSES[node], "127.0.0.1"}, (node, sorted(ours))
    finally:
        for process in started:
            process.kill()
            process.wait(30)
        subprocess.run(["pkill", "-f", str(run_dir)], capture_output=True)


def _committed(metrics: Path) -> bool:
    """Both groups in a committed step: each has healed or stepped with the other."""
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return any('"replicas": 2' in line and '"committed": true' in line for line in lines)
