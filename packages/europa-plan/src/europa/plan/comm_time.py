"""Communication time, per collective and link, and what of it the step waits for.

Per micro-batch, on one pipeline rank, forward and backward:

* **tp** (with sequence parallelism): an all-gather before and a reduce-scatter after
  each tp region, the attention block and a feed-forward with tp-split weights (a dense
  one, shared experts, or experts split over etp), in forward and again in backward.
  Exposed: Megatron's tp overlap is not assumed.
* **ep**: the expert exchange, dispatch and combine in forward and both again in
  backward, each GPU's rows (its tokens × top_k) spread over the ep group, once a node
  with DeepEP or HybridEP (``remote_share``). Exposed, as Megatron's dispatchers run
  it on the compute stream, unless the run overlaps it with another micro-batch's
  compute (``ep_overlap``, DualPipe's pairs): then only what is longer than that.
* **cp**: the keys and values of the other cp ranks' chunks, gathered in forward and
  their gradients returned in backward; hidden behind attention, which it overlaps.

Once a step (``dp_seconds``): the gradients' reduction over the data-parallel group (an
all-reduce for ddp; a reduce-scatter and the updated weights' all-gather for zero1;
fsdp and hsdp, ZeRO-3 as torch's FSDP2 and Megatron-FSDP run it, gather the weights for
each micro-batch's forward and again for its backward, and reduce-scatter its gradients;
with ``reshard_after_forward = false`` the weights, once gathered, stay whole for the step
and only the gradients are reduced each micro-batch, as Llama 3's FSDP did). A reduction
and a backward's gather hide behind that backward, a forward's gather behind its forward
(zero1's behind the first); what is longer is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from europa.plan.compute_time import ComputeTerms, compute_by_rank, efficiencies
from europa.plan.links import Group, all_to_all_seconds, ring_seconds
from europa.plan.memory import rank_params
from europa.plan.record import Run
from europa.plan.stages import RankStage, rank_stages

BF16 = 2


@dataclass(frozen=True)
class CommTerms:
    """Seconds one pipeline rank's GPU waits on each collective for one micro-batch."""

    tp: float
    ep: float
    cp: float

    @property
    def total(self) -> float:
        return self.tp + self.ep + self.cp


def groups(run: Run) -> dict[str, Group]:
    lay, per_node = run.layout, run.gpu.gpus_per_node
    return {
        "tp": Group(lay.tp, 1, per_node),
        "cp": Group(lay.cp, lay.tp, per_node),
        "dp": Group(lay.dp * lay.cp, lay.tp, per_node),
        "ep": Group(lay.ep, lay.etp, per_node),
        "expert_dp": Group(lay.expert_dp, lay.ep * lay.etp, per_node),
    }


def rank_comm(run: Run, stage: RankStage, compute: ComputeTerms) -> CommTerms:
    model, lay, gpu, eff = run.model, run.layout, run.gpu, efficiencies(run)
    group = groups(run)
    tokens, local = run.micro_batch_tokens, run.local_tokens
    dense_layers, moe_layers = stage.layer_counts(model)
    layers = dense_layers + moe_layers
    hidden = tokens * model.dim * BF16
    one = ring_seconds("all_gather", hidden, group["tp"], gpu, eff)
    one += ring_seconds("reduce_scatter", hidden, group["tp"], gpu, eff)
    tp_split_moe = model.num_shared_experts > 0 or lay.etp > 1
    regions = 2 * dense_layers + (2 if tp_split_moe else 1) * moe_layers
    tp = 2 * regions * one  # forward, then backward
    ep = 0.0
    if moe_layers and lay.ep > 1:
        rows = local * model.top_k
        remote = remote_share(run, group["ep"])
        exchange = all_to_all_seconds(rows * model.dim * BF16, group["ep"], gpu, eff, remote)
        redone = 2 if run.layout.recompute.covers("moe") else 0
        ep = moe_layers * (4 + redone) * exchange
    cp = 0.0
    if lay.cp > 1:
        kv = model.n_heads * (model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim)
        kv /= lay.tp
        if not model.mla:
            kv = 2 * model.n_kv_heads * model.head_dim / lay.tp
        elif lay.cp_exchange == "latent":  # one latent a token, whatever the heads' split
            kv = model.kv_lora_rank + model.qk_rope_head_dim
        gathered = ring_seconds("all_gather", tokens * lay.cp * kv * BF16, group["cp"], gpu, eff)
        cp = max(0.0, 3 * layers * gathered - compute.attention)
    return CommTerms(tp, ep, cp)


def remote_share(run: Run, group: Group) -> float | None:
    """The share of a GPU's exchanged rows that cross the network. An all-to-all spreads
    them evenly (None: the group's own spread); DeepEP and HybridEP send a token once
    to each other node its top-k experts sit on: (N − 1)(1 − (1 − 1/N)^k) of its k rows
    on N nodes, the experts chosen evenly (balanced routing)."""
    if run.ep_dispatcher == "alltoall" or not group.crosses:
        return None
    nodes, k = group.nodes, run.model.top_k
    return (nodes - 1) * (1 - (1 - 1 / nodes) ** k) / k


def comm_by_rank(run: Run, compute: list[ComputeTerms] | None = None) -> list[CommTerms]:
    compute = compute or compute_by_rank(run)
    return [rank_comm(run, s, c) for s, c in zip(rank_stages(run), compute, strict=True)]


@dataclass(frozen=True)
class DataParallelTime:
    """The data-parallel collectives of a step on the rank with the most state."""

    seconds: float  # all of it
    exposed: float  # what the step waits for


def dp_seconds(run: Run, compute: list[ComputeTerms] | None = None) -> DataParallelTime:
    lay, gpu, eff = run.layout, run.gpu, efficiencies(run)
    lay.modelled_data_parallel()
    compute = compute or compute_by_rank(run)
    group = groups(run)
    grad_bytes = 4 if run.state_dtype == "float32" else BF16
    worst = DataParallelTime(0.0, 0.0)
    for stage, work in zip(rank_stages(run), compute, strict=True):
        params = rank_params(run, stage)
        dense_part = params.dense + params.replicated + params.embedding
        expert_part = params.experts
        backward, forward = work.total * 2 / 3, work.total / 3
        if lay.dp_kind == "ddp":
            reduce = ring_seconds("all_reduce", dense_part * grad_bytes, group["dp"], gpu, eff)
            reduce += ring_seconds(
                "all_reduce", expert_part * grad_bytes, group["expert_dp"], gpu, eff
            )
            total, exposed = reduce, max(0.0, reduce - backward)
        else:
            reduce = ring_seconds("reduce_scatter", dense_part * grad_bytes, group["dp"], gpu, eff)
            reduce += ring_seconds(
                "reduce_scatter", expert_part * grad_bytes, group["expert_dp"], gpu, eff
            )
            gather = ring_seconds("all_gather", dense_part * BF16, group["dp"], gpu, eff)
            gather += ring_seconds("all_gather", expert_part * BF16, group["expert_dp"], gpu, eff)
            m = run.micro_batches
            if lay.dp_kind in ("fsdp", "hsdp") and run.reshard_after_forward:  # ZeRO-3
                total = m * (2 * gather + reduce)
                exposed = m * (max(0.0, gather - forward) + max(0.0, gather + reduce - backward))
            elif lay.dp_kind in ("fsdp", "hsdp"):  # weights kept whole once gathered
                total = gather + m * reduce
                exposed = max(0.0, gather - forward) + m * max(0.0, reduce - backward)
            else:
                total = reduce + gather
                exposed = max(0.0, reduce - backward) + max(0.0, gather - forward)
        if (exposed, total) > (worst.exposed, worst.seconds):
            worst = DataParallelTime(total, exposed)
    return worst
