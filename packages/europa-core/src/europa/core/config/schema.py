"""The core config tables. Plugins add their own tables through the
``europa_config_sections`` hook; this file only knows europa-core's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from europa.core.config.fields import ConfigSection, setting
from europa.core.seeds import MAX_SEED
from europa.plan.schedules import SCHEDULE_NAMES
from europa.spec.lanes import OVERLAP_F_B_MODES

CP_EXCHANGES = ("latent", "kv")


@dataclass(kw_only=True)
class RunConfig:
    name: str = setting("europa", doc="run name; the default run directory is runs/<name>-<time>")
    seed: int = setting(0, ge=0, le=MAX_SEED, doc="seed for initialisation")


@dataclass(kw_only=True)
class ModelConfig:
    """A DeepSeek-V3 / Kimi-K2 style MoE decoder (MLA attention, shared + routed experts)."""

    vocab_size: int = setting(gt=0)
    dim: int = setting(gt=0)
    n_layers: int = setting(gt=0)
    n_dense_layers: int = setting(ge=0, doc="the first n layers use a dense FFN instead of MoE")
    n_heads: int = setting(gt=0)
    q_lora_rank: int = setting(ge=0, doc="0: full-rank query projection")
    kv_lora_rank: int = setting(gt=0)
    qk_nope_head_dim: int = setting(gt=0)
    qk_rope_head_dim: int = setting(gt=0)
    v_head_dim: int = setting(gt=0)
    dense_hidden_dim: int = setting(gt=0)
    moe_hidden_dim: int = setting(gt=0)
    num_experts: int = setting(gt=0)
    num_shared_experts: int = setting(ge=0)
    top_k: int = setting(gt=0)
    score_func: str = setting("sigmoid", choices=("sigmoid", "softmax"))
    route_norm: bool = setting(True, doc="renormalise the top-k scores to sum to one")
    route_scale: float = setting(1.0, gt=0)
    num_expert_groups: int = setting(0, ge=0, doc="0: no group-limited routing")
    num_limited_groups: int = setting(0, ge=0)
    load_balance_coeff: float = setting(
        1e-3, ge=0, doc="step of the auxiliary-loss-free expert bias; 0 disables it"
    )
    max_seq_len: int = setting(gt=0)
    rope_theta: float = setting(10000.0, gt=0)
    rope_factor: float = setting(1.0, ge=1, doc="YaRN context extension factor; 1 disables it")
    rope_original_seq_len: int = setting(4096, gt=0)
    mscale: float = setting(1.0, gt=0, doc="YaRN attention-scale multiplier")
    rope_beta_fast: float = setting(32.0, gt=0, doc="YaRN extrapolation boundary (rotations)")
    rope_beta_slow: float = setting(1.0, gt=0, doc="YaRN interpolation boundary (rotations)")
    norm_eps: float = setting(1e-5, gt=0, doc="epsilon of every RMSNorm")
    init_from: str = setting(
        "", doc='"hf:DIR": start from a Hugging Face DeepSeek-V3 checkpoint; empty: random init'
    )


@dataclass(kw_only=True)
class TrainingConfig:
    steps: int = setting(gt=0)
    batch_size: int = setting(gt=0, doc="sequences per rank per micro-batch")
    seq_len: int = setting(gt=0)
    grad_accum_steps: int = setting(1, gt=0)
    max_grad_norm: float = setting(1.0, ge=0, doc="0 disables clipping")
    dtype: str = setting("float32", choices=("float32", "bfloat16"))
    deterministic: bool = setting(True, doc="deterministic torch algorithms")
    max_skipped_steps: int = setting(
        10,
        ge=0,
        doc="steps skipped for a non-finite loss or gradient before the run stops; 0: none",
    )


@dataclass(kw_only=True)
class OptimizerConfig:
    name: str = setting("adamw", choices=("adamw", "muon"))
    lr: float = setting(3e-3, gt=0)
    weight_decay: float = setting(0.1, ge=0)
    beta1: float = setting(0.9, ge=0, le=1)
    beta2: float = setting(0.95, ge=0, le=1)
    eps: float = setting(1e-8, gt=0)
    muon_momentum: float = setting(0.95, ge=0, le=1)
    muon_ns_steps: int = setting(5, gt=0)
    qk_clip: bool = setting(
        False,
        doc="MuonClip's QK-clip (Kimi-K2): after each step, scale the query and key weights "
        "of every head whose largest pre-softmax logit exceeded qk_clip_tau; needs muon",
    )
    qk_clip_tau: float = setting(100.0, gt=0, doc="the logit QK-clip holds each head to")


@dataclass(kw_only=True)
class LRScheduleConfig:
    warmup_steps: int = setting(0, ge=0)
    min_lr_ratio: float = setting(0.1, ge=0, le=1, doc="cosine decays to lr × this")


@dataclass(kw_only=True)
class ParallelConfig:
    nproc: int = setting(1, gt=0, doc="local worker processes when not under torchrun/SLURM")
    dp_replicate: int = setting(1, gt=0)
    dp_shard: int = setting(-1, ge=-1, doc="-1: every rank not used by other axes")
    ep: int = setting(
        1, gt=0, doc="expert-parallel degree: routed experts split over this many ranks"
    )
    ranks_per_node: int = setting(
        0,
        ge=0,
        doc="ranks sharing one node's fast link, numbered node by node; 0: the launcher's "
        "LOCAL_WORLD_SIZE (europa plan: the hardware profile's gpus_per_node)",
    )
    ep_dispatch: str = setting(
        "auto",
        choices=("auto", "flat", "two_level"),
        doc="expert exchange: flat sends one row per (token, expert); two_level sends each "
        "token once per destination node, then fans out inside the node; auto: two_level "
        "when an ep group spans more than one node",
    )
    ep_dispatch_dtype: str = setting(
        "compute",
        choices=("compute", "bfloat16", "float8_e4m3fn"),
        doc="dtype of the tokens sent towards the experts (forward dispatch, backward of "
        "combine); float8_e4m3fn carries a scale per 128 values; the combine direction "
        "travels in bfloat16 when this is lower than the compute dtype",
    )
    ep_max_nodes_per_token: int = setting(
        0,
        ge=0,
        doc="route each token to experts on at most this many nodes of its ep group (the "
        "router's groups become the nodes); changes the model's routing; 0: off",
    )
    ep_keep_exchanges: bool = setting(
        False,
        doc="under full activation checkpointing, keep the expert exchanges' results as saved "
        "tensors so the recomputed forward sends nothing",
    )
    cp: int = setting(
        1,
        gt=0,
        doc="context-parallel ranks: each sequence is cut over this many data-parallel ranks "
        "(2·cp chunks, rank r holding chunks r and 2·cp−1−r), whose attention gathers what "
        "it attends to from the others; training.seq_len must be a multiple of 2·cp",
    )
    cp_exchange: str = setting(
        "latent",
        choices=CP_EXCHANGES,
        doc="what context parallelism gathers: latent, MLA's normed latent and rotary key "
        "(kv_lora_rank + qk_rope_head_dim a token), up-projected on every rank; kv: every "
        "head's keys and values, as ring attention moves them (35× more for Kimi-K2)",
    )
    pp: int = setting(
        1,
        gt=0,
        doc="pipeline ranks: the model's layers cut into stages over this many ranks (the "
        "outermost mesh axis); each stage's ranks run torch's pipeline schedule",
    )
    pp_schedule: str = setting(
        "1f1b",
        choices=SCHEDULE_NAMES,
        doc="torch.distributed.pipelining schedule; its micro-batches are "
        "training.grad_accum_steps",
    )
    pp_stages_per_rank: int = setting(
        0,
        ge=0,
        doc="stages each pipeline rank holds; 0: the schedule's (1 for 1f1b, 2 for the "
        "others); interleaved-1f1b takes 2 or more, zbv and dualpipev exactly 2",
    )
    pp_overlap_f_b: str = setting(
        "off",
        choices=OVERLAP_F_B_MODES,
        doc="dualpipev: run each paired chunk's forward and backward side by side (two "
        "threads), so one micro-batch's expert exchange travels while the other computes; "
        "off: one after the other, as torch runs them; auto: side by side where the layout's "
        "collectives take lanes of their own (flexshard's) or a stage has one rank; on: "
        "refused where they cannot",
    )
    pp_layers: list[int] = setting(
        [],
        doc="layers per stage, in order (as many as stages); empty: cut balanced by each "
        "layer's compute, the embedding and the head counted too",
    )
    backend: str = setting("auto", choices=("auto", "gloo", "nccl"))
    device: str = setting("auto", choices=("auto", "cpu", "cuda"))
    collective_timeout_s: float = setting(
        600.0,
        gt=0,
        doc="seconds a collective waits for the other ranks before this rank gives up; "
        "leave room for the first step and for checkpoint saves",
    )


@dataclass(kw_only=True)
class DataConfig:
    path: str = setting(
        "",
        doc="a directory made by `europa data prepare`, or .txt/.jsonl/.jsonl.gz/.parquet "
        "files or a folder of them (prepared into the run directory's cache); empty: embedded "
        "corpus",
    )
    tokenizer: str = setting(
        "", doc="a tokenizers JSON file; empty: a prepared corpus's own, else the embedded one"
    )
    text_field: str = setting("text", doc="the field holding the text in .jsonl and .parquet")
    seed: int = setting(0, ge=0, le=MAX_SEED, doc="shuffling seed")
    validation_path: str = setting(
        "", doc="held-out text or prepared corpus for val_loss, like data.path; empty: none"
    )
    validation_fraction: float = setting(
        0.0, ge=0, le=0.5, doc="share of data.path's documents held out by a stable text hash"
    )


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = setting(0, ge=0, doc="save every N steps; 0: only at the end")
    keep: int = setting(0, ge=0, doc="keep the newest N checkpoints; 0 keeps all")
    mode: str = setting(
        "sync",
        choices=("sync", "async"),
        doc='"async": copy the state to host memory and write it while training goes on '
        '(one save in flight); "sync": training waits for the write',
    )
    max_write_mbps: float = setting(
        0.0,
        ge=0,
        doc="cap each rank's checkpoint writing at this many MB/s (a shared file system's "
        "fair share, or a slow one emulated); 0: no cap",
    )


@dataclass(kw_only=True)
class FaultToleranceConfig:
    enabled: bool = setting(
        False,
        doc="each of parallel.dp_replicate replica groups trains as its own job; torchft "
        "sums gradients over the groups in each step's quorum, steps the optimizer only when "
        "they commit, and heals a group that (re)joins from a healthy peer",
    )
    lighthouse: str = setting(
        "",
        doc="address of the torchft Lighthouse (http://host:port); empty: europa train starts "
        "one on 127.0.0.1 for the replica groups it launches on this machine",
    )
    min_replicas: int = setting(1, gt=0, doc="replica groups a step needs to commit")
    check_every: int = setting(
        0,
        ge=0,
        doc="every N steps (and after a heal), record a digest of each rank's parameters "
        "and optimizer state in metrics.jsonl: every group's must agree; 0: only after a heal",
    )
    process_group_timeout_s: float = setting(
        30.0, gt=0, doc="a cross-replica collective that takes longer fails the step"
    )
    step_timeout_s: float = setting(
        60.0, gt=0, doc="the commit vote and a heal's transfer: longer fails the step"
    )
    join_timeout_s: float = setting(
        90.0,
        gt=0,
        doc="how long the Lighthouse waits for a live group to ask for the next quorum",
    )
    quorum_timeout_s: float = setting(
        120.0, gt=0, doc="how long a group waits for a quorum before it gives up"
    )
    # 2 s (benchmarks/fault_tolerance.py, docs/operations.md): a failure costs about 3.5 s
    # less than at torchft's own 5 s and 0.8 s more than at 1 s, with 20 beats of margin.
    heartbeat_timeout_s: float = setting(
        2.0,
        gt=0,
        doc="the Lighthouse drops a group it has not heard from this long (each group's "
        "manager beats every 0.1 s) from the next quorum",
    )
    quorum_tick_s: float = setting(
        0.1, gt=0, doc="how often the Lighthouse looks whether a quorum can form"
    )


@dataclass(kw_only=True)
class MetricsConfig:
    log_every: int = setting(1, gt=0)
    progress: bool = setting(True, doc="progress bar on rank 0")
    tensorboard: bool = setting(
        False, doc="also write TensorBoard event files under the run directory's tensorboard/"
    )
    eval_every: int = setting(
        0, ge=0, doc="val_loss every N steps (and at the end) when data has a validation set"
    )
    eval_sequences: int = setting(
        64, gt=0, doc="validation sequences per evaluation: the first N of the held-out stream"
    )


@dataclass(kw_only=True)
class PluginsConfig:
    enabled: list[str] = setting([], doc="technique plugins to switch on, by name")


CORE_SECTIONS: tuple[ConfigSection, ...] = (
    ConfigSection("run", RunConfig),
    ConfigSection("model", ModelConfig),
    ConfigSection("training", TrainingConfig),
    ConfigSection("optimizer", OptimizerConfig),
    ConfigSection("lr_schedule", LRScheduleConfig),
    ConfigSection("parallel", ParallelConfig),
    ConfigSection("data", DataConfig),
    ConfigSection("checkpoint", CheckpointConfig),
    ConfigSection("fault_tolerance", FaultToleranceConfig),
    ConfigSection("metrics", MetricsConfig),
    ConfigSection("plugins", PluginsConfig),
)


@dataclass(kw_only=True)
class EuropaConfig:
    """The resolved config: every table typed and checked."""

    preset: str
    run: RunConfig
    model: ModelConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    lr_schedule: LRScheduleConfig
    parallel: ParallelConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    fault_tolerance: FaultToleranceConfig
    metrics: MetricsConfig
    plugins: PluginsConfig
    extensions: dict[str, Any] = field(default_factory=dict)

    def section(self, name: str) -> Any:
        """Any table by name, core or plugin."""
        if name in self.extensions:
            return self.extensions[name]
        return getattr(self, name)
