"""``europa plan --measure-hardware``: a hardware profile measured on the machine it runs on.

Design note. A shipped profile holds vendor peaks and the share of them a step gets
(the efficiencies). A measured one holds the same keys, from runs here:

* ``peak_tflops[dtype]``: the best matrix-multiply rate seen, a large square one or
  one of the model's own GEMM shapes (every distinct ``tokens × in → out`` product of
  one micro-batch; their weighted rate is printed beside the profile);
  ``matmul_efficiency``: the model's own forward and backward on one micro-batch
  (model FLOPs over its time, no communication) against that peak, in the training
  dtype. So the attention, the elementwise work and the per-layer Python cost of the
  step are in it, as the planner's compute time needs them.
* per link, ``*_gbps``: the best bandwidth of all-gather, reduce-scatter, all-reduce
  and all-to-all at large messages (bytes sent per rank, as ``europa.core.plan.traffic``
  counts them); ``*_collectives``: each one's at the sizes one step sends (a block's
  gather, its gradient reduce-scatter and all-reduce, one MoE layer's token exchange)
  over it, and ``*_efficiency`` their mean (for a collective the table lacks).
  On gloo, ``point_to_point`` (europa-flexshard's direct transfers) is the slower of
  the lone transfer and the same transfer made inside the model's step, at each block's
  waiting points (``europa.core.plan.measure_direct``: the ranks share the cores).
  ``intra_node`` is measured among the ranks of this node; ``inter_node`` among one
  rank per node when the launcher started several nodes, else kept from the base
  profile (and the file says so).
* ``host_to_device_gbps`` and ``device_to_host_gbps``: pinned-memory copies each way on
  CUDA (a GH200's differ 2.5-fold), and ``host_device_gbps`` the two together (bytes over
  the mean of the two times); on CPU one copy between two host buffers, all three the
  same. Their efficiencies are 1.0: the copies measured are the ones offload makes.

Every rank takes part in the collectives; rank 0 writes the file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from europa.core.config.schema import ModelConfig
from europa.core.plan.hardware import HardwareProfile
from europa.core.plan.measure_direct import direct_exchanges, direct_rate_in_step
from europa.core.plan.shapes import ModelShapes
from europa.spec.units import GIB

MIN_SECONDS = 0.2  # each figure: repeated until this long, at least twice
MODEL_STEP_REPEATS = 5  # the model's own step, whose median a noisy machine sways most
LARGE_MESSAGE = 64 << 20
LARGE_GEMM = {"cpu": 1024, "cuda": 8192}
WHOLE_MODEL_PARAMETERS = 2_000_000_000


@dataclass
class Measured:
    """Raw figures, for the JSON printed beside the profile."""

    gemm_tflops: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> {...}
    model_step: dict[str, float] = field(default_factory=dict)
    links: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    host_device_gbps: float = 0.0
    host_to_device_gbps: float = 0.0
    device_to_host_gbps: float = 0.0
    notes: list[str] = field(default_factory=list)


def timed(
    fn: Callable[[], None], sync: Callable[[], None], group=None, min_repeats: int = 2
) -> float:
    """Median seconds of ``fn`` over repeats lasting at least ``MIN_SECONDS`` (and at
    least ``min_repeats``). With a ``group`` its ranks agree on the count, the most any
    needs, so they run side by side to the end."""
    fn()
    sync()  # warm-up
    start = time.perf_counter()
    fn()
    sync()
    times = [time.perf_counter() - start]
    repeats = torch.tensor([max(min_repeats, math.ceil(MIN_SECONDS / max(times[0], 1e-9)))])
    if group is not None:
        dist.all_reduce(repeats, op=dist.ReduceOp.MAX, group=group)
    for _ in range(int(repeats) - 1):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_gemms(shapes: ModelShapes, tokens: int, top_k: int, experts: int) -> dict:
    """``{(rows, in, out): count}`` of one micro-batch's forward products: 2-D weights
    ``[out, in]`` over every token (not the embedding lookup), each routed expert's 3-D
    stack over the tokens one expert receives on average."""
    gemms: dict[tuple[int, int, int], int] = {}
    for p in shapes.parameters:
        if len(p.shape) == 2 and "tok_embeddings" not in p.name and min(p.shape) > 1:
            key = (tokens, p.shape[1], p.shape[0])
            gemms[key] = gemms.get(key, 0) + 1
        elif len(p.shape) == 3:
            rows = max(1, tokens * top_k // experts)
            key = (rows, p.shape[2], p.shape[1])
            gemms[key] = gemms.get(key, 0) + p.shape[0]
    return gemms


def gemm_rate(rows: int, inner: int, out: int, dtype, device, sync) -> float:
    a = torch.randn(rows, inner, dtype=dtype, device=device)
    b = torch.randn(inner, out, dtype=dtype, device=device)
    seconds = timed(lambda: torch.mm(a, b), sync)
    return 2 * rows * inner * out / seconds


def measure_compute(gemms: dict, device, sync, dtypes: list[str]) -> dict:
    """Per dtype: the large square GEMM's rate and the model shapes' weighted rate."""
    out = {}
    n = LARGE_GEMM[device.type]
    for name in dtypes:
        dtype = getattr(torch, name)
        peak = gemm_rate(n, n, n, dtype, device, sync)
        flops = seconds = 0.0
        for (rows, inner, cols), count in gemms.items():
            rate = gemm_rate(rows, inner, cols, dtype, device, sync)
            peak = max(peak, rate)  # the best rate seen is the peak
            flops += count * 2 * rows * inner * cols
            seconds += count * 2 * rows * inner * cols / rate
        model = flops / seconds if seconds else peak
        out[name] = {"peak": peak / 1e12, "model_shapes": model / 1e12}
    return out


def model_step_of(config, device) -> tuple[Callable[[], None], nn.Module, ModelConfig]:
    """(the model's own forward and backward on one micro-batch of this rank, in the
    training dtype, no communication; the model; its config). A model of more than
    ``WHOLE_MODEL_PARAMETERS`` keeps one dense and one MoE block only."""
    import torch.nn.functional as F

    from europa.core.model import build_moe_model
    from europa.core.model.materialise import materialise

    m, training = config.model, config.training
    model = build_moe_model(m)
    if sum(p.numel() for p in model.parameters()) > WHOLE_MODEL_PARAMETERS:
        m = dataclasses.replace(m, n_layers=min(m.n_layers, m.n_dense_layers + 1))
        model = build_moe_model(m)
    materialise(model, device, seed=0)
    model.to(getattr(torch, training.dtype))
    inputs = torch.randint(0, m.vocab_size, (training.batch_size, training.seq_len), device=device)

    def step():
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1).float(), inputs.flatten()).backward()

    return step, model, m


def measure_model_step(built, training, sync) -> dict[str, float]:
    """The model's own step (``built``: ``model_step_of``'s): what its matrix multiplies,
    attention, elementwise work and per-layer Python cost really run at."""
    from europa.core.plan.timing import model_flops_per_token

    step, model, m = built
    dist.barrier()  # every rank computes at once, sharing the machine as training does
    seconds = timed(step, sync, dist.group.WORLD, min_repeats=MODEL_STEP_REPEATS)
    tokens = training.batch_size * training.seq_len
    flops = model_flops_per_token(ModelShapes.of(model), m, training.seq_len) * tokens
    return {"seconds": seconds, "tflops": flops / seconds / 1e12, "layers": m.n_layers}


def measure_direct_in_step(built, nbytes: int, group, device, sync) -> dict[str, float]:
    """``point_to_point`` at the step's cadence (``europa.core.plan.measure_direct``) in
    ``built``, ``model_step_of``'s step."""
    step, model, _ = built
    blocks = list(model.layers.values())

    def timed_step(fn, on):
        return timed(fn, sync, on, min_repeats=MODEL_STEP_REPEATS)

    found = direct_rate_in_step(step, blocks, nbytes, group, device, timed_step)
    rate = found.pop("bytes_per_s")
    return {**found, "gbps": rate / 1e9}


def collective_bandwidth(kind: str, nbytes: int, group, device, sync) -> float:
    """Bytes/s one rank sends in ``kind`` of a ``nbytes`` full tensor over ``group``."""
    n = dist.get_world_size(group)
    elements = max(n, nbytes // 4 // n * n)
    full = torch.ones(elements, device=device)
    piece = torch.ones(elements // n, device=device)
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single
    if kind == "all_gather":

        def run():
            gather(full, piece, group=group)
    elif kind == "reduce_scatter":

        def run():
            scatter(piece, full, group=group)
    elif kind == "all_reduce":

        def run():
            dist.all_reduce(full, group=group)
    elif kind == "point_to_point":  # every rank's piece to every other, as direct transfers
        run, _, _ = direct_exchanges(nbytes, group, device)
    else:
        received = torch.empty_like(full)

        def run():
            dist.all_to_all_single(received, full, group=group)

    seconds = timed(run, lambda: (sync(), dist.barrier(group=group)), group)
    # sent to the others: a ring all-gather's or reduce-scatter's share, an all-to-all's,
    # twice that for an all-reduce (as ``europa.core.plan.traffic`` counts them)
    return (2 if kind == "all_reduce" else 1) * elements * 4 * (n - 1) / n / seconds


def measure_link(group, step_bytes: dict[str, int], device, sync) -> dict:
    """Bandwidth (GB/s per rank) at a step's sizes and at a large message, per collective."""
    out: dict[str, dict[str, float]] = {}
    for kind, size in step_bytes.items():
        out[kind] = {
            "step_bytes": size,
            "step_gbps": collective_bandwidth(kind, size, group, device, sync) / 1e9,
            "large_gbps": collective_bandwidth(kind, LARGE_MESSAGE, group, device, sync) / 1e9,
        }
    return out


def link_figures(measured: dict) -> tuple[float, float, dict[str, float]]:
    """(the best bandwidth seen, the mean step-size efficiency against it, each
    collective's step-size efficiency against it)."""
    peak = max(m["large_gbps"] for m in measured.values())
    peak = max(peak, *(m["step_gbps"] for m in measured.values()))
    each = {kind: round(m["step_gbps"] / peak, 4) for kind, m in measured.items()}
    return peak, statistics.mean(each.values()), each


def measure_host_device(device, sync) -> tuple[float, float]:
    """GB/s (host to device, device to host)."""
    nbytes = LARGE_MESSAGE
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        there = timed(lambda: dev.copy_(host, non_blocking=True), sync)
        back = timed(lambda: host.copy_(dev, non_blocking=True), sync)
        return nbytes / there / 1e9, nbytes / back / 1e9
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    copy = nbytes / timed(lambda: b.copy_(a), sync) / 1e9  # one memory: both ways alike
    return copy, copy


def step_message_bytes(shapes: ModelShapes, config) -> dict[str, int]:
    """A step's typical messages: the largest block's gather (compute dtype) and its
    gradient reduce-scatter (fp32), and one MoE layer's dispatched tokens."""
    training, model = config.training, config.model
    compute = 2 if training.dtype == "bfloat16" else 4
    units: dict[str, int] = {}
    for p in shapes.parameters:
        if len(p.shape) != 3:
            units[p.unit] = units.get(p.unit, 0) + p.numel
    block = max(units.values())
    tokens = training.batch_size * training.seq_len
    return {
        "all_gather": block * compute,
        "reduce_scatter": block * 4,
        "all_reduce": block * 4,  # a block's gradients, as replicas sum them
        "all_to_all": tokens * model.top_k * model.dim * compute,
        "point_to_point": block * compute,  # a block's gather, as direct transfers
    }


def _memory(device) -> tuple[float, float]:
    """(device GiB per rank, host GiB per rank)."""
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if "MemTotal" in line)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return torch.cuda.mem_get_info(device)[1] / GIB, total / local / GIB
    return total / GIB, 0.0


def measure(
    config, model_shapes: ModelShapes, base: HardwareProfile, device, per_node: int
) -> tuple[HardwareProfile, Measured]:
    """This rank's part of the measurement; every rank returns the same profile."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    world, rank = dist.get_world_size(), dist.get_rank()
    nodes = world // per_node
    found = Measured()
    training = config.training
    tokens = training.batch_size * training.seq_len
    gemms = model_gemms(model_shapes, tokens, config.model.top_k, config.model.num_experts)
    found.gemm_tflops = measure_compute(gemms, device, sync, ["float32", "bfloat16"])
    built = model_step_of(config, device)  # one model for every step timed below
    found.model_step = measure_model_step(built, training, sync)
    messages = step_message_bytes(model_shapes, config)
    intra_group, inter_group = _node_groups(world, rank, per_node)
    profile = {
        "name": f"measured ({device.type}, {nodes} node(s) of {per_node})",
        "device": device.type,
        "gpus_per_node": per_node,
    }
    links = (
        ("intra_node", intra_group, per_node > 1, "one rank per node"),
        ("inter_node", inter_group, nodes > 1, "one node"),
    )
    for link, group, measurable, why_not in links:
        if not measurable:
            found.notes.append(f"{link}: {why_not}, kept from the base profile")
            continue
        found.links[link] = measure_link(group, messages, device, sync)
        if dist.get_backend(group) == dist.Backend.GLOO:  # the backend that sends direct
            direct = found.links[link]["point_to_point"]
            in_step = measure_direct_in_step(built, direct["step_bytes"], group, device, sync)
            direct |= {"alone_step_gbps": direct["step_gbps"], "in_step": in_step}
            direct["step_gbps"] = min(direct["step_gbps"], in_step["gbps"])
        gbps, efficiency, each = link_figures(found.links[link])
        profile[f"{link}_gbps"] = round(gbps, 4)
        profile[f"{link}_efficiency"] = round(efficiency, 4)
        profile[f"{link}_collectives"] = each
    there, back = measure_host_device(device, sync)
    found.host_to_device_gbps, found.device_to_host_gbps = there, back
    found.host_device_gbps = 2 / (1 / there + 1 / back)  # bytes over the mean time
    device_gib, host_gib = _memory(device)
    dtype = training.dtype
    rates = found.gemm_tflops
    profile |= {
        "device_memory_gib": round(device_gib, 3),
        "host_memory_gib": round(host_gib, 3),
        "shared_memory": device.type == "cpu",
        "peak_tflops": {k: round(v["peak"], 6) for k, v in rates.items()},
        "matmul_efficiency": round(min(1.0, found.model_step["tflops"] / rates[dtype]["peak"]), 4),
        "host_device_gbps": round(found.host_device_gbps, 3),
        "host_to_device_gbps": round(there, 3),
        "device_to_host_gbps": round(back, 3),
        # the copies measured are the ones offload makes (the base's are replaced)
        "host_device_efficiency": 1.0,
        "host_to_device_efficiency": 1.0,
        "device_to_host_efficiency": 1.0,
    }
    measured = dataclasses.replace(base, fitted_gpu=None, **profile)  # its rates measured
    return _agreed(measured), found


def _agreed(profile: HardwareProfile) -> HardwareProfile:
    """Rank 0's figures on every rank (each rank timed its own; one file is written)."""
    box = [profile]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _node_groups(world: int, rank: int, per_node: int):
    """(this rank's node group, its rail group: the same local rank on every node);
    every rank creates every group, as ``new_group`` asks."""
    intra = inter = None
    for node in range(world // per_node):
        group = dist.new_group(list(range(node * per_node, (node + 1) * per_node)))
        if rank // per_node == node:
            intra = group
    for local in range(per_node):
        group = dist.new_group(list(range(local, world, per_node)))
        if rank % per_node == local:
            inter = group
    return intra, inter


def profile_toml(profile: HardwareProfile, found: Measured, command: str) -> str:
    """The profile as TOML, the keys of a shipped one, with a header saying how."""
    import tomli_w

    table = {k: v for k, v in profile.as_dict().items() if v is not None}
    header = [
        f"# Measured by `{command}`.",
        "# peak_tflops: the best matmul rate seen; matmul_efficiency: the model's forward",
        "# and backward on one micro-batch over it. *_gbps: the best of all-gather,",
        "# reduce-scatter, all-reduce and all-to-all at 64 MiB; *_collectives: each at",
        "# one step's message sizes over that (point_to_point on gloo: the slower of alone",
        "# and inside the model's step); *_efficiency: their mean.",
        *(f"# {note}" for note in found.notes),
    ]
    return "\n".join(header) + "\n" + tomli_w.dumps(table)


# -- running it: on the launcher's ranks, or on ranks spawned here -------------------------


def launched() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_measurement(config, base: HardwareProfile, out: str | None, command: str) -> None:
    """Measure under the launcher that started this process, or on ``parallel.nproc``
    ranks of this machine (``parallel.ranks_per_node`` of them a node)."""
    import torch.multiprocessing as mp

    from europa.core.launch.distributed import check_node_layout, free_port, ranks_per_node

    here = launched()
    world = int(os.environ["WORLD_SIZE"]) if here else config.parallel.nproc
    per_node = ranks_per_node(config.parallel, world, int(os.environ.get("LOCAL_WORLD_SIZE", 0)))
    check_node_layout(config.parallel, world, per_node)  # before any rank starts
    if here:
        _rank_main(int(os.environ["RANK"]), world, per_node, config, base, out, command, None)
        return
    mp.start_processes(
        _rank_main,
        args=(world, per_node, config, base, out, command, free_port()),
        nprocs=world,
        start_method="spawn",
    )


def _rank_main(rank, world, per_node, config, base, out, command, store_port) -> None:
    """One rank; ``store_port``: where rank 0 hosts the store on loopback (None: the
    environment torchrun set)."""
    import json

    from europa.core.config import toml
    from europa.core.model import build_moe_model
    from europa.core.plan.hardware import profile_from_table

    cuda = torch.cuda.is_available() and config.parallel.device != "cpu"
    if not cuda:  # the ranks of this machine share its cores, as training's do
        here = int(os.environ.get("LOCAL_WORLD_SIZE", world if not launched() else 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // here))
    local = int(os.environ.get("LOCAL_RANK", rank % per_node))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if store_port is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    else:
        from europa.core.launch.stores import rank_store

        store = rank_store("127.0.0.1", store_port, rank, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        shapes = ModelShapes.of(build_moe_model(config.model))  # on the meta device
        profile, found = measure(config, shapes, base, device, per_node)
        if rank == 0:
            text = profile_toml(profile, found, command)
            profile_from_table(toml.loads(text), "measured")  # it loads back
            if out:
                with open(out, "w") as f:
                    f.write(text)
            print(text if not out else f"wrote {out}", flush=True)
            print(json.dumps(dataclasses.asdict(found), indent=2), flush=True)
    finally:
        dist.destroy_process_group()
