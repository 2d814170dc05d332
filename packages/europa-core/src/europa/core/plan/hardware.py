"""Hardware profiles: the figures the planner needs about a machine, as TOML.

Shipped profiles live beside this file (``profiles/<name>.toml``); a user's own
is any TOML file with the same keys. Bandwidths are GB/s per GPU in one
direction; memory is GiB per GPU.

The host-device link is planned one direction at a time: ``host_to_device`` (offloaded
tensors brought back) and ``device_to_host`` (offloaded tensors and checkpoint staging
copied out). Each takes its own ``*_gbps`` and ``*_efficiency`` where the profile gives
them, else ``host_device_gbps`` and ``host_device_efficiency`` (else ``link_efficiency``),
so a profile with one figure for both ways plans as it always did.

``fitted_gpu`` names a GPU of europa-plan's (``europa.plan.builtins``): its links within
and across nodes are then europa-plan's figures at its generation's fitted efficiencies,
and bfloat16 compute is europa-plan's kernel model fitted on published runs
(``europa.core.plan.timing``), so such a profile states neither. The shipped GPU profiles
name theirs; a measured profile names none (its rates are measured).

``failures_per_gpu_hour`` and ``restart_s`` are the machine's reliability and how long a
restart takes; each has a default (the Llama 3 paper's failure rate; two minutes, an
assumption) and goes into the plan's goodput (``europa.core.plan.goodput``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from europa.core.config import toml
from europa.core.errors import ConfigError
from europa.core.plan.goodput import LLAMA3_FAILURES_PER_GPU_HOUR, RESTART_S
from europa.spec.units import GIB

_SHIPPED = "europa.core.plan.profiles"
HOST_TO_DEVICE, DEVICE_TO_HOST = "host_to_device", "device_to_host"
# "point_to_point": each rank's pieces sent straight to every other rank (europa-flexshard's
# gathers and reduce-scatters on gloo), which gloo runs at a rate of its own
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "point_to_point")


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    name: str
    device: str  # "cuda" or "cpu": which attention kernels run
    gpus_per_node: int
    device_memory_gib: float
    device_reserved_gib: float
    host_memory_gib: float
    peak_tflops: dict[str, float]  # by training.dtype
    matmul_efficiency: float
    intra_node_gbps: float
    inter_node_gbps: float
    host_device_gbps: float
    link_efficiency: float
    shared_memory: bool = False  # CPU ranks of a node share device_memory_gib
    # Per link, where one is known (measured, or published for that link); else link_efficiency.
    intra_node_efficiency: float | None = None
    inter_node_efficiency: float | None = None
    host_device_efficiency: float | None = None
    # Per link and collective ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"),
    # where measured: libraries run each at its own share of the link (gloo's all-reduce
    # beats its reduce-scatter several times over). A collective not listed uses the link's.
    intra_node_collectives: dict[str, float] | None = None
    inter_node_collectives: dict[str, float] | None = None
    # GB/s one node writes to the file system checkpoints go to (where known)
    filesystem_gbps: float | None = None
    # The host-device link one direction at a time, where the two differ (GB/s per GPU);
    # unset, a direction takes host_device_gbps and host_device_efficiency.
    host_to_device_gbps: float | None = None
    device_to_host_gbps: float | None = None
    host_to_device_efficiency: float | None = None
    device_to_host_efficiency: float | None = None
    # Failures a GPU-hour, all causes (the job's MTBF: 1 / (this × its GPUs)); by default
    # Llama 3's 419 interruptions in 54 days on 16,384 H100s (about one a 50,000 GPU-hours)
    failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    # Seconds from a failure to the ranks (of the job, or of one replica group) running
    # again, before any checkpoint read or heal; by default an assumption, two minutes
    restart_s: float = RESTART_S
    fitted_gpu: str | None = None

    def bandwidth(self, link: str, collective: str | None = None) -> float:
        """Bytes/s per rank one way on ``link`` ("intra_node", "inter_node", "host_device",
        "host_to_device", "device_to_host"), its efficiency (for ``collective``, where the
        profile has one) applied."""
        peak = getattr(self, f"{link}_gbps")
        efficiency = getattr(self, f"{link}_efficiency")
        if link in (HOST_TO_DEVICE, DEVICE_TO_HOST):  # unset: the link's, both ways
            peak = self.host_device_gbps if peak is None else peak
            efficiency = self.host_device_efficiency if efficiency is None else efficiency
        peak *= 1e9
        by_collective = getattr(self, f"{link}_collectives", None) or {}
        if collective in by_collective:
            efficiency = by_collective[collective]
        return peak * (self.link_efficiency if efficiency is None else efficiency)

    def device_bytes_per_rank(self, ranks_per_node: int) -> int:
        share = ranks_per_node if self.shared_memory else 1
        return int(self.device_memory_gib * GIB / share)

    def host_bytes_per_rank(self) -> int:
        return int(self.host_memory_gib * GIB)

    @property
    def reserved_bytes(self) -> int:
        return int(self.device_reserved_gib * GIB)

    def peak_flops(self, dtype: str) -> float:
        return self.peak_tflops[dtype] * 1e12

    @property
    def attention_kernel(self) -> str:
        return "fused" if self.device == "cuda" else "block_causal"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def shipped_profiles() -> list[str]:
    names = resources.files(_SHIPPED).iterdir()
    return sorted(p.name.removesuffix(".toml") for p in names if p.name.endswith(".toml"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name, or a TOML file by path."""
    label = f"--hardware = {name_or_path!r}"
    if name_or_path.endswith(".toml") or os.sep in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"{label}: no such file; expected a TOML file")
        table = toml.read_file(path, label)
    else:
        if name_or_path not in shipped_profiles():
            raise ConfigError(
                f"{label}: unknown profile; expected one of "
                f"{', '.join(shipped_profiles())} or a path to a .toml file"
            )
        data = resources.files(_SHIPPED).joinpath(f"{name_or_path}.toml").read_bytes()
        table = toml.from_bytes(data, label)
    return profile_from_table(table, name_or_path)


def profile_from_table(table: dict, source: str) -> HardwareProfile:
    fields = {f.name: f for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(
            f"hardware {source!r}: unknown key {unknown[0]!r}; expected keys among "
            f"{', '.join(fields)}"
        )
    if "fitted_gpu" in table:
        table = _fitted_links(table, source)
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
    missing = [n for n in required if n not in table]
    if missing:
        raise ConfigError(f"hardware {source!r}: missing key {missing[0]!r}")
    for key, value in table.items():
        _check_value(source, key, value)
    return HardwareProfile(**table)


# What a profile naming ``fitted_gpu`` takes from europa-plan, and does not state itself.
FITTED_LINK_KEYS = (
    "intra_node_gbps",
    "inter_node_gbps",
    "intra_node_efficiency",
    "inter_node_efficiency",
    "intra_node_collectives",
    "inter_node_collectives",
)


def _fitted_links(table: dict, source: str) -> dict:
    """``table`` with its GPU links filled in from europa-plan's ``fitted_gpu``."""
    from europa.plan import builtins

    name = table["fitted_gpu"]
    gpus = builtins().gpus
    if not isinstance(name, str) or name not in gpus:
        raise ConfigError(
            f"hardware {source!r}: fitted_gpu = {name!r}; expected one of europa-plan's "
            f"GPUs: {', '.join(gpus)}"
        )
    stated = [k for k in FITTED_LINK_KEYS if k in table]
    if stated:
        raise ConfigError(
            f"hardware {source!r}: {stated[0]} = {table[stated[0]]!r}; expected none with "
            f"fitted_gpu = {name!r}, whose links are europa-plan's fitted figures"
        )
    gpu = gpus[name]
    eff = gpu.efficiencies
    return table | {
        "intra_node_gbps": gpu.nvlink_gbps,
        "inter_node_gbps": gpu.network_gbps,
        "intra_node_efficiency": eff.nvlink,
        "inter_node_efficiency": eff.network,
    }


def _check_value(source: str, key: str, value) -> None:
    if key == "fitted_gpu":
        return  # checked against europa-plan's GPUs (``_fitted_links``)
    if key in ("name", "device"):
        expected = ("cuda", "cpu") if key == "device" else None
        if not isinstance(value, str) or (expected and value not in expected):
            raise ConfigError(
                f"hardware {source!r}: {key} = {value!r}; expected "
                + ("'cuda' or 'cpu'" if expected else "a string")
            )
    elif key == "shared_memory":
        if not isinstance(value, bool):
            raise ConfigError(f"hardware {source!r}: {key} = {value!r}; expected true or false")
    elif key == "peak_tflops":
        if not isinstance(value, dict) or not {"float32", "bfloat16"} <= set(value):
            raise ConfigError(
                f"hardware {source!r}: peak_tflops = {value!r}; expected a table with "
                "float32 and bfloat16"
            )
        for dtype, tflops in value.items():
            _check_value(source, f"peak_tflops.{dtype}", tflops)
    elif key.endswith("_collectives"):
        if not isinstance(value, dict) or not set(value) <= set(COLLECTIVES):
            raise ConfigError(
                f"hardware {source!r}: {key} = {value!r}; expected a table of efficiencies "
                f"by collective, among {', '.join(COLLECTIVES)}"
            )
        for collective, efficiency in value.items():
            _check_value(source, f"{key}.{collective}", efficiency)
    elif key == "gpus_per_node":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"hardware {source!r}: {key} = {value!r}; expected an integer >= 1")
    else:
        positive = key not in ("device_reserved_gib", "host_memory_gib", "restart_s")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"hardware {source!r}: {key} = {value!r}; expected a number >= 0")
        if positive and value == 0:
            raise ConfigError(f"hardware {source!r}: {key} = {value!r}; expected a number > 0")
        if (key.endswith("efficiency") or "_collectives." in key) and value > 1:
            raise ConfigError(
                f"hardware {source!r}: {key} = {value!r}; expected a share of the peak, in (0, 1]"
            )


def this_machine(device_type: str, available_bytes: int, host_bytes: int = 0) -> HardwareProfile:
    """The machine a run is starting on: the shipped profile of its kind (its
    reserve included, so the figures match ``europa plan --hardware cpu`` or a
    CUDA profile) with the memory measured now, per rank."""
    base = load_profile("cpu" if device_type == "cpu" else "h100-sxm")
    return dataclasses.replace(
        base,
        name=f"this {device_type} machine",
        device=device_type,
        gpus_per_node=1,
        device_memory_gib=available_bytes / GIB,
        host_memory_gib=host_bytes / GIB,
        shared_memory=False,
    )
