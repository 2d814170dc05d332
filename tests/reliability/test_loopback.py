"""A run on one machine listens on loopback alone: torch's stores (the lone process's, the
elastic agent's two, the background writers'), gloo, torchft's manager servers and the
Lighthouse. The test lists the listening sockets of every process of the run from
``/proc/net/tcp*`` while it trains and saves in the background."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import EuropaProcess

QUIET = ["--set", "metrics.progress=false", "--set", "training.steps=100000"]
SAVES = ["--set", "checkpoint.every=2", "--set", 'checkpoint.mode="async"']
FT = ["--set", "fault_tolerance.enabled=true", "--set", "parallel.dp_replicate=2"]
RUNS = {
    "plain": ([], "metrics.jsonl"),
    "flexshard": (["-p", "flexshard", "--set", "parallel.ep=2"], "metrics.jsonl"),
    "fault-tolerant": (FT, "replica-0/metrics.jsonl"),
}
WILDCARDS = {"0.0.0.0", "::"}


def _address(hex_address: str) -> str:
    """``/proc/net/tcp*``'s local address (hex, in the kernel's byte order) as text."""
    import ipaddress

    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped or address)


def _listening() -> dict[int, str]:
    """Every listening TCP socket on this machine: its inode, and its address:port."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                host, port = fields[1].split(":")
                found[int(fields[9])] = f"{_address(host)}:{int(port, 16)}"
    return found


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _sockets_of(pids: set[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = str(fd.readlink()) if fd.is_symlink() else ""
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        except OSError:  # ended, or a descriptor closed, while we looked
            continue
    return inodes


def _saved(metrics: Path) -> bool:
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return any(line.endswith("}") and "checkpoint_s" in json.loads(line) for line in lines)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_on_one_machine_listens_on_loopback_alone(tmp_path, name):
    extra, metrics = RUNS[name]
    run_dir = tmp_path / "run"
    launcher = EuropaProcess(["train", "--nproc", "2", "--run-dir", str(run_dir), *QUIET,
                              *SAVES, *extra], stderr=tmp_path / "err")  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not _saved(run_dir / metrics):  # a background save written: the writers ran
            assert launcher.poll() is None, (tmp_path / "err").read_text()
            assert time.monotonic() < deadline, "no save within 120 s"
            time.sleep(0.1)
        pids = _descendants(launcher.pid)
        listening = _listening()
        ours = {listening[i] for i in _sockets_of(pids) if i in listening}
        assert ours, "the run listens nowhere: the test sees none of its sockets"
        wide = sorted(a for a in ours if a.rsplit(":", 1)[0] in WILDCARDS)
        assert not wide, f"listening on every interface: {wide} (all: {sorted(ours)})"
        assert {a.rsplit(":", 1)[0] for a in ours} == {"127.0.0.1"}, sorted(ours)
    finally:
        launcher.kill()  # its processes end with it
        launcher.wait(30)
