"""The planner's input, typed and immutable: a GPU, a model and a run (layout, batch,
precision), as a runs file states them. ``europa.plan.reader`` builds and checks them;
everything after it trusts them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

Family = Literal["mla-moe", "gqa-moe", "gqa-dense"]
FAMILIES: tuple[Family, ...] = ("mla-moe", "gqa-moe", "gqa-dense")

# A run's precision -> the peak (``Gpu.peak_tflops`` key) its GEMMs run at.
PRECISION_PEAK = MappingProxyType(
    {
        "bfloat16": "bfloat16",
        "float8-tensorwise": "float8",
        "float8-blockwise": "float8",
        "mxfp8": "mxfp8",
    }
)
SCHEDULES = ("1f1b", "interleaved", "zbv", "dualpipev", "dualpipe")
# ddp: every rank holds all state; zero1: Megatron's distributed optimizer (optimizer
# state and fp32 master weights sharded); fsdp: ZeRO-3 (everything sharded); hsdp: fsdp
# within groups of ``dp_shard``, replicated across them.
DP_KINDS = ("ddp", "zero1", "fsdp", "hsdp")
# europa-flexshard's whole-matrix ownership: a europa run whose plugins state their own
# memory and transfers, which europa-plan prices (``europa.plan.exposure``); europa-plan
# keeps no model of it, so a runs file cannot name it and its memory is not asked for.
FLEXSHARD = "flexshard"
OPTIMIZERS = ("adam", "muon")
# float32: bf16 weights with a fp32 master copy, fp32 gradients and moments (Megatron,
# torchtitan); bfloat16: the bf16 weights trained directly, bf16 gradients and moments.
STATE_DTYPES = ("float32", "bfloat16")
ROUTINGS = ("balanced", "learned")
# How the expert exchange moves tokens: an all-to-all of one row per (token, expert), or
# DeepEP's (and its NVL72 variant HybridEP's) kernels, which send a token across the
# network once per destination node and fan it out there.
EP_DISPATCHERS = ("alltoall", "deepep", "hybridep")
# How a source counts its "model FLOPs" (``europa.plan.flops`` says what each counts).
FLOPS_CONVENTIONS = MappingProxyType(
    {
        "megatron": "Megatron-LM and Megatron-Bridge: 3x forward, causal attention halved, "
        "MTP counted",
        "nemo-automodel": "NeMo AutoModel: 3x forward, causal attention halved",
        "llama3-paper": "not stated by the Llama 3 paper: counted as Megatron counts",
    }
)
# Megatron-LM's names for selective recompute (``--recompute-modules``).
RECOMPUTE_MODULES = (
    "core_attn",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "moe_act",
    "shared_experts",
)


@dataclass(frozen=True, kw_only=True)
class Efficiencies:
    """The share of the vendor's peak a GPU generation's kernels and links reach in a
    training step, one set for every GPU of the generation, fitted on the published runs
    (``fitted`` says how: the command that fits them again)."""

    id: str  # the generation: "hopper", "blackwell"
    gemm: MappingProxyType[str, float]  # dense matrix multiplies, by peak (bfloat16, float8…)
    grouped_gemm: float  # the experts' grouped multiplies: this share of the dense ones'
    # efficiency (per-expert blocks are smaller, launched together, with uneven rows)
    attention: float  # FlashAttention against the bf16 peak
    memory: float  # memory-bound kernels against the HBM bandwidth
    nvlink: float  # collectives inside the NVLink domain
    network: float  # collectives across it
    overlap: float  # the share of an overlapped expert exchange that compute hides
    fitted: str | None = None


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """One GPU and the links around it. Bandwidths are GB/s per GPU in one direction."""

    id: str
    peak_tflops: MappingProxyType[str, float]  # dense, by ``PRECISION_PEAK`` value
    hbm_gb: float  # vendors' HBM "GB" are binary: an 80 GB H100 shows 79.6 GiB to CUDA
    hbm_tbps: float
    gpus_per_node: int  # the NVLink domain (72 for an NVL72 rack)
    nvlink_gbps: float
    network_gbps: float
    generation: str  # an ``Efficiencies`` id
    sm_count: int  # streaming multiprocessors: how many matrix-multiply tiles run at once
    source: str | None = None
    efficiencies: Efficiencies | None = None  # the generation's, set by the reader


@dataclass(frozen=True, kw_only=True)
class Model:
    """A decoder-only transformer of one of ``FAMILIES``. Keys a family does not use stay 0."""

    id: str
    family: Family
    n_layers: int  # transformer layers, MTP modules not included
    dim: int
    n_heads: int
    vocab_size: int
    # gqa-*: grouped-query attention
    n_kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False
    # mla-*: multi-head latent attention (q_lora_rank 0: queries straight from the input)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # feed-forward: gqa-dense's every layer, a MoE model's leading dense layers
    ffn_hidden_dim: int = 0
    n_dense_layers: int = 0
    # *-moe
    moe_hidden_dim: int = 0
    num_experts: int = 0
    top_k: int = 0
    num_shared_experts: int = 0
    mtp_modules: int = 0
    tied_embeddings: bool = False
    source: str | None = None

    @property
    def moe(self) -> bool:
        return self.family.endswith("-moe")

    @property
    def mla(self) -> bool:
        return self.family == "mla-moe"

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers if self.moe else 0


@dataclass(frozen=True, kw_only=True)
class Recompute:
    """What backward recomputes: nothing, every layer, or the named modules."""

    kind: Literal["none", "full", "selective"] = "none"
    modules: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if (self.kind == "selective") != bool(self.modules):
            raise ValueError("selective recompute names its modules; none and full name none")

    def covers(self, module: str) -> bool:
        return self.kind == "full" or module in self.modules


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a run's GPUs split the work: gpus = tp × cp × pp × dp. Experts are split over
    ``ep`` × ``etp`` ranks carved out of each stage's tp × cp × dp ranks, as Megatron does."""

    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    # What context parallelism gathers for MLA: "kv", the up-projected keys and values
    # (Megatron's, ring attention's); "latent", the kv latent and rotary key, up-projected
    # on every rank for the whole sequence (europa's).
    cp_exchange: str = "kv"
    pp: int = 1
    vp: int = 1  # virtual stages a pipeline rank holds
    schedule: str = "1f1b"
    dp: int = 1
    dp_kind: str = "ddp"
    dp_shard: int = 0  # hsdp's shard group; 0 otherwise
    ep: int = 1
    etp: int = 1
    recompute: Recompute = field(default_factory=Recompute)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard within a stage (Megatron's expert data parallel)."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def modelled_data_parallel(self) -> str:
        """``dp_kind``, which europa-plan's memory and data-parallel traffic model; a
        FlexShard run's state and transfers are stated by its trainer instead."""
        if self.dp_kind == FLEXSHARD:
            raise ValueError(
                "dp_kind = 'flexshard': europa-plan keeps no model of its state or "
                "data-parallel traffic; europa-core's plugins state them"
            )
        return self.dp_kind

    def layers_per_stage(self, n_layers: int) -> int:
        """Layers the fullest pipeline rank holds (the others hold as many or one fewer)."""
        return math.ceil(n_layers / self.pp)


@dataclass(frozen=True, kw_only=True)
class Published:
    """What a source reports for a run (each figure as it states it, or derived as its
    row's ``notes`` say)."""

    tokens_per_s_per_gpu: float | None = None
    step_s: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None

    @property
    def flops_per_token(self) -> float | None:
        """The source's own FLOP count per token: its FLOP rate over its token rate."""
        if self.tflops_per_gpu is None or self.tokens_per_s_per_gpu is None:
            return None
        return self.tflops_per_gpu * 1e12 / self.tokens_per_s_per_gpu


@dataclass(frozen=True, kw_only=True)
class Run:
    """One training run to plan. ``assumed`` names each setting the file left out and
    the planner filled in (printed with the plan: nothing is silently guessed)."""

    id: str
    model: Model
    gpu: Gpu
    gpus: int
    precision: str  # a ``PRECISION_PEAK`` key
    seq_len: int
    global_batch: int  # sequences a step
    micro_batch: int
    layout: Layout
    optimizer: str = "adam"
    state_dtype: str = "float32"  # of master weights, gradients and moments (``STATE_DTYPES``)
    routing: str = "balanced"
    ep_dispatcher: str = "alltoall"
    ep_overlap: bool = False  # the exchange runs beside another micro-batch's compute
    # fsdp, hsdp: the weights gathered for a micro-batch's forward are freed after it and
    # gathered again for its backward (torch's FSDP2 and Megatron-FSDP by default); false:
    # once gathered they stay whole for the step (Llama 3's FSDP: optimizer state and
    # gradients sharded, the weights not resharded)
    reshard_after_forward: bool = True
    flops_convention: str = "megatron"
    published: Published = field(default_factory=Published)
    assumed: tuple[str, ...] = ()
    source: str | None = None
    quote: str | None = None
    notes: str | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def micro_batch_tokens(self) -> float:
        """Tokens of a micro-batch a GPU multiplies: its cp chunk, gathered over tp."""
        return self.micro_batch * self.seq_len / self.layout.cp

    @property
    def local_tokens(self) -> float:
        """Tokens of a micro-batch a GPU holds between the tp regions: split over tp
        with sequence parallelism."""
        sp = self.layout.tp if self.layout.sequence_parallel else 1
        return self.micro_batch_tokens / sp

    @property
    def micro_batches(self) -> int:
        """Micro-batches each pipeline runs a step (gradient accumulation steps)."""
        return self.global_batch // (self.micro_batch * self.layout.dp)
