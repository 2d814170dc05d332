"""A europa config as europa-plan's record of a run (``europa.plan.record.Run``), so that
europa-plan, the planner checked on published runs, can plan it.

Only what europa-plan can price is translated: europa's MLA-MoE model, its pipeline,
FSDP2 (HSDP with replicas) and expert parallelism, bf16 training on a GPU europa-plan
knows. A config beyond that (FlexShard's whole-matrix ownership, offload, a CPU profile,
fp32 training) is refused in one line naming what europa-plan does not price yet, never
planned as something else.
"""

from __future__ import annotations

from europa.core.config.schema import EuropaConfig
from europa.core.errors import ConfigError
from europa.core.plan.context import sequence_groups
from europa.plan import builtins
from europa.plan.record import FLEXSHARD, Layout, Model, Recompute, Run

SCHEDULES = {"1f1b": "1f1b", "interleaved-1f1b": "interleaved", "zbv": "zbv",
             "dualpipev": "dualpipev"}  # fmt: skip
PRICED_PLUGINS: tuple[str, ...] = ()  # technique plugins europa-plan prices: none yet


def model_record(config: EuropaConfig) -> Model:
    m = config.model
    return Model(
        id=config.run.name,
        family="mla-moe",
        n_layers=m.n_layers,
        dim=m.dim,
        n_heads=m.n_heads,
        vocab_size=m.vocab_size,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        ffn_hidden_dim=m.dense_hidden_dim if m.n_dense_layers else 0,
        n_dense_layers=m.n_dense_layers,
        moe_hidden_dim=m.moe_hidden_dim,
        num_experts=m.num_experts,
        top_k=m.top_k,
        num_shared_experts=m.num_shared_experts,
    )


def run_record(config: EuropaConfig, hardware: str, world_size: int) -> Run:
    """``config`` on ``world_size`` GPUs of europa-plan's built-in ``hardware``, for
    europa-plan to plan whole: memory, traffic and time by its own model."""
    known = builtins()
    if hardware not in known.gpus:
        raise ConfigError(
            f"--hardware = {hardware!r}: europa-plan prices only its own GPUs: "
            + ", ".join(known.gpus)
        )
    unpriced = [p for p in config.plugins.enabled if p not in PRICED_PLUGINS]
    if unpriced:
        raise ConfigError(
            f"plugins.enabled = {config.plugins.enabled!r}: europa-plan does not price "
            f"{unpriced[0]} yet"
        )
    if config.training.dtype != "bfloat16":
        raise ConfigError(
            f"training.dtype = {config.training.dtype!r}: europa-plan prices bfloat16 only"
        )
    return _run(config, hardware, world_size)


def compute_record(config: EuropaConfig, hardware: str, world_size: int) -> Run:
    """``config`` (bfloat16, on europa-plan's ``hardware``) for europa-plan to price its
    compute only: its plugins state their own memory and transfers (``europa_plan``), and
    a FlexShard run's data-parallel kind says so (europa-plan keeps no model of it)."""
    return _run(config, hardware, world_size)


def _run(config: EuropaConfig, hardware: str, world_size: int) -> Run:
    parallel, training = config.parallel, config.training
    dp = sequence_groups(parallel, world_size)
    per_rank = parallel.pp_stages_per_rank or (1 if parallel.pp_schedule == "1f1b" else 2)
    checkpointing = config.extensions.get("activation_checkpointing")
    full = checkpointing is not None and checkpointing.mode == "full"
    replicas = parallel.dp_replicate
    hsdp = replicas > 1 and "flexshard" not in config.plugins.enabled
    layout = Layout(
        cp=parallel.cp,
        cp_exchange=parallel.cp_exchange,
        pp=parallel.pp,
        vp=per_rank if parallel.pp > 1 else 1,
        schedule=SCHEDULES[parallel.pp_schedule] if parallel.pp > 1 else "1f1b",
        dp=dp,
        dp_kind=_dp_kind(config),
        dp_shard=dp // replicas if hsdp else 0,
        ep=parallel.ep,
        recompute=Recompute(kind="full") if full else Recompute(),
    )
    dispatch = parallel.ep_dispatch
    gpu = builtins().gpus[hardware]
    two_level = dispatch == "two_level" or (
        dispatch == "auto" and parallel.ep > (parallel.ranks_per_node or gpu.gpus_per_node)
    )
    return Run(
        id=config.run.name,
        model=model_record(config),
        gpu=gpu,
        gpus=world_size,
        precision="bfloat16",
        seq_len=training.seq_len,
        global_batch=training.batch_size * training.grad_accum_steps * dp,
        micro_batch=training.batch_size,
        layout=layout,
        optimizer="muon" if config.optimizer.name == "muon" else "adam",
        ep_dispatcher="deepep" if two_level else "alltoall",
    )


def _dp_kind(config: EuropaConfig) -> str:
    if "flexshard" in config.plugins.enabled:
        return FLEXSHARD
    return "hsdp" if config.parallel.dp_replicate > 1 else "fsdp"
