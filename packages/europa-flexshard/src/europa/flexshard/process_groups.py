"""The process groups a FlexShard layout spans, built from a job's mesh
(``europa.spec.job.MESH_AXES``: ``[pp, dp_replicate, dp_shard, ep]``, ``ep`` innermost:
an ep group is consecutive ranks).

``process_groups(job)`` gives (shard group, replicate group, expert parallelism): the
ranks that split the non-expert matrices, those holding the same share elsewhere, and the
routed experts' group with its copies, nodes and exchange settings. With pipeline stages
each stage's ranks (its ``dp_replicate × dp_shard × ep``) lay out that stage's layers
alone; every rank builds every stage's groups (creating a group is collective). Imports
torch only when a group is built.
"""

from __future__ import annotations

from europa.flexshard.config import NAME
from europa.flexshard.errors import FlexShardError
from europa.spec.job import DATA_AXES, PIPELINE_AXIS, PlanningJob, RunningJob


def ranks_per_node(job: PlanningJob) -> int:
    """Ranks sharing a node, as the job resolved them (``parallel.ranks_per_node``, the
    launcher's, or a planned machine's); all of them for a job that does not say."""
    return getattr(job, "node_size", None) or job.world_size


def dispatch_of(parallel, per_node: int) -> str:
    """``parallel.ep_dispatch``, with "auto" resolved: two-level when an ep group spans
    more than one node."""
    if parallel.ep_dispatch != "auto":
        return parallel.ep_dispatch
    return "two_level" if parallel.ep > per_node else "flat"


def _expert_parallel(job: RunningJob, copies):
    from europa.flexshard.exchange.nodes import ExpertNodes, expert_node_groups, split_into_nodes
    from europa.flexshard.experts import ExpertParallel

    mesh, parallel = job.mesh, job.config.parallel
    per_node = ranks_per_node(job)
    ep_groups = mesh.mesh.reshape(-1, parallel.ep).tolist()  # ep innermost: consecutive ranks
    dispatch = dispatch_of(parallel, per_node)
    if dispatch == "two_level":
        nodes = expert_node_groups(ep_groups, per_node)
    else:
        for group in ep_groups:
            split_into_nodes(group, per_node)
        nodes = ExpertNodes(min(parallel.ep, per_node))
    execution = getattr(job, "execution", None)
    return ExpertParallel(
        group=mesh["ep"].get_group(),
        copies=copies,
        data_parallel_size=data_ranks(job).numel(),  # a pipeline stage's, not the world
        dispatch=dispatch,
        nodes=nodes,
        dispatch_dtype=parallel.ep_dispatch_dtype,
        keep_exchanges=parallel.ep_keep_exchanges,
        routing=execution.routing if execution is not None else None,
        max_nodes=parallel.ep_max_nodes_per_token,
    )


def check_dense_group(job: PlanningJob, group: int) -> None:
    if job.config.section(NAME).dense_group != "node":
        return
    per_node = ranks_per_node(job)
    if group > per_node and group % per_node:
        raise FlexShardError(
            f'flexshard.dense_group = "node": the {group} ranks of dp_shard × ep do not hold '
            f'whole nodes of {per_node}; expected flexshard.dense_group = "all" or ranks per '
            "node dividing them"
        )


def data_ranks(job: RunningJob):
    """``[dp_replicate, dp_shard, ep]`` -> global rank, for this rank's pipeline stage."""
    return job.mesh[DATA_AXES].mesh


def stages_data_ranks(job: RunningJob) -> list:
    """``data_ranks`` of every pipeline stage, in stage order (one without stages)."""
    return list(job.mesh.mesh)


def pipeline_group(job: RunningJob):
    """The ranks holding the other stages of this rank's pipeline (None: no stages)."""
    if job.mesh[PIPELINE_AXIS].size() == 1:
        return None
    return job.mesh[PIPELINE_AXIS].get_group()


def dense_ranks(job: RunningJob) -> tuple[list[list[int]], list[list[int]]]:
    """(the groups splitting the non-expert matrices, the replica groups holding the same
    share) as global ranks, every stage's. Each replica's ``dp_shard × ep`` ranks
    (consecutive) split them, or with ``flexshard.dense_group = "node"`` each node's ranks
    of those."""
    shards, replicas = [], []
    for ranks in stages_data_ranks(job):
        stage_shards, stage_replicas = _stage_dense_ranks(job, ranks)
        shards += stage_shards
        replicas += stage_replicas
    return shards, replicas


def _stage_dense_ranks(job: RunningJob, ranks) -> tuple[list[list[int]], list[list[int]]]:
    from europa.flexshard.exchange.nodes import split_into_nodes

    blocks = [r.flatten().tolist() for r in ranks]  # [dp_replicate][dp_shard × ep]
    check_dense_group(job, len(blocks[0]))
    dense_group = job.config.section(NAME).dense_group
    if dense_group == "node":
        per_node = ranks_per_node(job)
        blocks = [node for block in blocks for node in split_into_nodes(block, per_node)]
    elif dense_group == "rank":
        blocks = [[rank] for block in blocks for rank in block]
    replicas = [[block[i] for block in blocks] for i in range(len(blocks[0]))]
    return blocks, replicas


def process_groups(job: RunningJob):
    """(shard group, replicate group, expert parallelism) for ``job.mesh``.

    Without ``ep`` the owned layout spans ``dp_shard``. With ``ep > 1`` it spans
    ``dp_shard × ep`` (every rank reads its own data), the experts split over
    ``ep``, and their copies sit along ``dp_replicate × dp_shard``. With
    ``flexshard.dense_group = "node"`` the owned layout spans one node's ranks of those,
    and the other nodes hold copies."""
    import torch.distributed as dist

    mesh, parallel = job.mesh, job.config.parallel
    if parallel.ep == 1 and job.config.section(NAME).dense_group == "all":
        replicate = mesh["dp_replicate"].get_group() if parallel.dp_replicate > 1 else None
        return mesh["dp_shard"].get_group(), replicate, None
    shards, replica_ranks = dense_ranks(job)
    shard, _ = dist.new_subgroups_by_enumeration(shards)
    replicate = None
    if len(replica_ranks[0]) > 1:
        replicate, _ = dist.new_subgroups_by_enumeration(replica_ranks)
    if parallel.ep == 1:
        return shard, replicate, None
    copies = None
    if mesh["dp_replicate"].size() * mesh["dp_shard"].size() > 1:
        per_ep = [
            ranks[:, :, e].flatten().tolist()
            for ranks in stages_data_ranks(job)
            for e in range(parallel.ep)
        ]
        copies, _ = dist.new_subgroups_by_enumeration(per_ep)
    return shard, replicate, _expert_parallel(job, copies)


def every_group(shard, replicate, experts) -> list:
    """Every process group a layout from ``process_groups`` issues collectives on (the
    shard and expert groups: None is the world; the others: None is none)."""
    groups = [shard]
    optional = [replicate]
    if experts is not None:
        groups.append(experts.group)
        optional.append(experts.copies)
        if experts.nodes is not None:
            optional += [experts.nodes.node_group, experts.nodes.rail_group]
    return groups + [g for g in optional if g is not None]
