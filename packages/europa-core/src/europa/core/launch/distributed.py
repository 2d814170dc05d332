"""Where this process stands: rank and world from torchrun, SLURM or a lone
process; then the process group and the named device mesh.

Mesh axes are torchtitan's canonical names. ``dp_replicate × dp_shard × ep``
must equal the world size; ``dp_shard = -1`` takes whatever the other axes
leave.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from europa.core.config.schema import ParallelConfig
from europa.core.errors import LaunchError
from europa.core.launch.stores import store_server
from europa.spec.job import DATA_AXES, MESH_AXES


@dataclass(frozen=True)
class ProcessPlace:
    rank: int
    world_size: int
    local_rank: int
    source: str  # "torchrun", "slurm" or "single"
    local_world_size: int = 0  # ranks on this node as the launcher says (0: not said)
    node_rank: int | None = None  # this node's number among the job's nodes, if said


def _int_env(environ: dict[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name} = {value!r}: expected an integer") from None


def detect_launcher(environ: dict[str, str] | None = None) -> ProcessPlace | None:
    """The place torchrun or SLURM gave this process, or None when started alone."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env:
        _require_rendezvous(env, "torchrun")
        return ProcessPlace(
            _int_env(env, "RANK"),
            _int_env(env, "WORLD_SIZE"),
            _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            "torchrun",
            _int_env(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 0,
            _int_env(env, "GROUP_RANK") if "GROUP_RANK" in env else None,
        )
    if "SLURM_PROCID" in env and _int_env(env, "SLURM_NTASKS") > 1:
        _require_rendezvous(env, "slurm")
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        return ProcessPlace(
            _int_env(env, "SLURM_PROCID"),
            _int_env(env, "SLURM_NTASKS"),
            _int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            "slurm",
            int(per_node) if per_node.isdigit() else 0,
            _int_env(env, "SLURM_NODEID") if "SLURM_NODEID" in env else None,
        )
    return None


def _require_rendezvous(env: dict[str, str], source: str) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name):
            raise LaunchError(
                f"{name} is not set under {source}: expected the address and port of rank 0 "
                "(e.g. export MASTER_ADDR=<first node> MASTER_PORT=29500)"
            )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mesh_shape(parallel: ParallelConfig, world_size: int) -> tuple[int, int, int, int]:
    """(pp, dp_replicate, dp_shard, ep) for this many ranks, or a LaunchError."""
    others = parallel.pp * parallel.dp_replicate * parallel.ep
    # pp is named only where it is set: most runs have no pipeline
    pp = "parallel.pp × " if parallel.pp > 1 else ""
    if parallel.dp_shard == -1:
        if world_size % others:
            raise LaunchError(
                f"{pp}parallel.dp_replicate × parallel.ep = {others}: expected a divisor of "
                f"the {world_size} ranks"
            )
        shape = parallel.pp, parallel.dp_replicate, world_size // others, parallel.ep
    elif others * parallel.dp_shard != world_size:
        raise LaunchError(
            f"{pp}parallel.dp_replicate × parallel.dp_shard × parallel.ep = "
            f"{others * parallel.dp_shard}: expected the {world_size} ranks"
        )
    else:
        shape = parallel.pp, parallel.dp_replicate, parallel.dp_shard, parallel.ep
    data_ranks = world_size // parallel.pp
    if data_ranks % parallel.cp:
        raise LaunchError(
            f"parallel.cp = {parallel.cp}: expected a divisor of the {data_ranks} "
            f"data-parallel ranks{' of a pipeline stage' if pp else ''}, which it cuts into "
            "groups sharing each sequence"
        )
    return shape


def ranks_per_node(parallel: ParallelConfig, world_size: int, launcher_says: int = 0) -> int:
    """Ranks sharing one node: ``parallel.ranks_per_node``, else what the launcher says
    (``LOCAL_WORLD_SIZE``, or a profile's ``gpus_per_node`` when planning), else all."""
    return min(parallel.ranks_per_node or launcher_says or world_size, world_size)


def check_node_layout(parallel: ParallelConfig, world_size: int, per_node: int) -> int:
    """Refuse, in one line, nodes that the mesh cannot follow; return the number of nodes
    each ``ep`` group spans. Ranks are numbered node by node and ``ep`` is the mesh's
    innermost axis, so an ep group is ``ep`` consecutive ranks: it must lie inside one
    node or hold whole nodes."""
    key = (
        "parallel.ranks_per_node" if parallel.ranks_per_node else "the launcher's LOCAL_WORLD_SIZE"
    )
    if world_size % per_node:
        raise LaunchError(
            f"{key} = {per_node}: expected a divisor of the {world_size} ranks (ranks are "
            "numbered node by node)"
        )
    ep = parallel.ep
    if (ep > per_node and ep % per_node) or (ep < per_node and per_node % ep):
        raise LaunchError(
            f"parallel.ep = {ep}: expected a divisor or a multiple of the {per_node} ranks per "
            f"node ({key}), so that each ep group lies inside one node or holds whole nodes"
        )
    nodes = max(1, ep // per_node)
    limit = parallel.ep_max_nodes_per_token
    if limit > nodes:
        raise LaunchError(
            f"parallel.ep_max_nodes_per_token = {limit}: expected at most the {nodes} node(s) "
            f"an ep group of {ep} ranks spans at {per_node} ranks per node"
        )
    return nodes


def check_node_numbering(place: ProcessPlace, per_node: int) -> None:
    """A launcher that numbers ranks otherwise than node by node breaks the mesh's
    assumption that an ep group's consecutive ranks share a node."""
    if place.node_rank is None or place.local_world_size != per_node:
        return
    if place.rank // per_node != place.node_rank or place.rank % per_node != place.local_rank:
        raise LaunchError(
            f"rank {place.rank} is local rank {place.local_rank} of node {place.node_rank}: "
            f"expected ranks numbered node by node ({per_node} a node), as the mesh's ep groups "
            "assume"
        )


def routed_model(config, world_size: int, per_node: int):
    """``[model]`` with ``parallel.ep_max_nodes_per_token`` applied: the router's groups are
    the nodes of an ep group, and a token may reach that many of them."""
    limit = config.parallel.ep_max_nodes_per_token
    if not limit:
        return config.model
    nodes = check_node_layout(config.parallel, world_size, per_node)
    m = config.model
    per_group = m.num_experts // nodes
    if per_group < 2:
        raise LaunchError(
            f"parallel.ep_max_nodes_per_token = {limit}: each of the {nodes} nodes would hold "
            f"{per_group} expert(s) of model.num_experts ({m.num_experts}); expected at least 2 "
            "(the router scores a group by its top two)"
        )
    if m.top_k > limit * per_group:
        raise LaunchError(
            f"model.top_k = {m.top_k}: expected at most the {limit * per_group} experts on "
            f"parallel.ep_max_nodes_per_token ({limit}) node(s)"
        )
    return dataclasses.replace(m, num_expert_groups=nodes, num_limited_groups=limit)


def pick_device(parallel: ParallelConfig, local_rank: int) -> torch.device:
    wants_cuda = parallel.device == "cuda" or (
        parallel.device == "auto" and torch.cuda.is_available()
    )
    if not wants_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LaunchError('parallel.device = "cuda": expected a CUDA device, found none')
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def pick_backend(parallel: ParallelConfig, device: torch.device) -> str:
    if parallel.backend != "auto":
        return parallel.backend
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(
    parallel: ParallelConfig, place: ProcessPlace
) -> tuple[torch.device, DeviceMesh]:
    """Start the process group and build the named mesh for this process."""
    shape = mesh_shape(parallel, place.world_size)
    device = pick_device(parallel, place.local_rank)
    # A lone process hosts its own store on loopback; launched ranks read
    # MASTER_ADDR/MASTER_PORT from the environment their launcher set.
    store = restarted_group_store(place.world_size)
    if place.source == "single":
        store = store_server("127.0.0.1", world_size=1)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=pick_backend(parallel, device),
            init_method=None if store is not None else "env://",
            store=store,
            rank=place.rank,
            world_size=place.world_size,
            device_id=device if device.type == "cuda" else None,
            # A rank that died on another node is noticed only as a collective timeout.
            timeout=timedelta(seconds=parallel.collective_timeout_s),
        )
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_AXES)
    return device, mesh


def restart_attempt(environ: dict[str, str] | None = None) -> int:
    """How many times torch's elastic agent has restarted this worker's group (0: first run)."""
    env = os.environ if environ is None else environ
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0")


def restarted_group_store(world_size: int, environ: dict[str, str] | None = None):
    """The store of a worker group that torch's elastic agent restarted, under a prefix of
    its own; None for a first attempt or a store this group hosts itself.

    The agent keeps one TCP store across restarts (``TORCHELASTIC_USE_AGENT_STORE``) and
    the process group's keys carry no attempt number, so without a prefix a restarted
    rank can read the failed group's keys, e.g. a dead peer's address, and fail to connect."""
    env = os.environ if environ is None else environ
    attempt = restart_attempt(env)
    if attempt == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed.constants import default_pg_timeout

    agent_store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=default_pg_timeout,
    )
    return dist.PrefixStore(f"europa/attempt-{attempt}", agent_store)


def sequence_coordinates(mesh: DeviceMesh, cp: int) -> tuple[int, int]:
    """(rank, size) of this process among the groups reading different sequences: the
    data-parallel ranks, ``cp`` consecutive ones sharing each sequence."""
    rank, size = data_parallel_coordinates(mesh)
    return rank // cp, size // cp


def context_parallel_group(mesh: DeviceMesh, cp: int):
    """This rank's context-parallel group (``cp`` consecutive data-parallel ranks of its
    pipeline stage) and its place in it; a collective: every rank makes every group."""
    stages = mesh.mesh.reshape(mesh.size(0), -1)  # (pp, data-parallel ranks)
    mine = None
    for stage in stages:
        for ranks in stage.reshape(-1, cp).tolist():
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group, ranks.index(dist.get_rank())
    return mine


def data_parallel_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this process among the ranks reading different data: all of them
    but a pipeline's, whose stages read the same.

    Expert parallelism splits the experts, not the data: as in torchtitan, where
    the ep ranks are data-parallel ranks too, each ep rank trains on its own
    sequences and sends their tokens to the ranks owning their experts."""
    replicate, shard, ep = (mesh[axis] for axis in DATA_AXES)
    rank = (replicate.get_local_rank() * shard.size() + shard.get_local_rank()) * ep.size()
    return rank + ep.get_local_rank(), replicate.size() * shard.size() * ep.size()


def data_group(mesh: DeviceMesh):
    """The process group of the ranks holding the same layers and reading different data:
    None (every rank) without pipeline stages, else this stage's data-parallel ranks."""
    if mesh["pp"].size() == 1:
        return None
    return mesh[DATA_AXES]._flatten("data").get_group()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
