"""The keys of core's metrics records (``metrics.jsonl``), one place for the trainer
that writes them and for every reader (europa-report). A plugin's own keys start with
its name (``offload_bytes_offloaded``).

Step numbering: a record's ``step`` counts optimizer steps done, from 1; a hook's
``step`` argument is the index of the step being taken, from 0, so the record that
step writes has ``step + 1``."""

from __future__ import annotations

STEP = "step"
LOSS = "loss"
LR = "lr"
GRAD_NORM = "grad_norm"
TOKENS_SEEN = "tokens_seen"
TOKENS_PER_S = "tokens_per_s"
STEP_TIME_S = "step_time_s"
MEMORY_PEAK_BYTES = "memory_peak_bytes"
EXPERT_IMBALANCE_MAX = "expert_imbalance_max"
EXPERT_IMBALANCE = "expert_imbalance"  # {layer: max / mean share}
EXPERT_LOAD = "expert_load"  # {layer: [share per expert]}
SKIPPED = "skipped"
SKIPPED_STEPS = "skipped_steps"
# The save after the step before this record's: the seconds training stopped for it, of
# which waiting for the save before it to finish ("async"), and rank 0's host copy.
CHECKPOINT_S = "checkpoint_s"
CHECKPOINT_WAIT_S = "checkpoint_wait_s"
CHECKPOINT_STAGING_BYTES = "checkpoint_staging_bytes"
# With optimizer.qk_clip: each layer's largest pre-softmax logit of the step (over its
# heads, before the clip; {layer: logit}) and the heads whose weights the clip scaled.
QK_LOGIT_MAX = "qk_logit_max"
QK_HEADS_CLIPPED = "qk_heads_clipped"
VAL_LOSS = "val_loss"
VAL_PERPLEXITY = "val_perplexity"
# With pipeline stages, one entry per pipeline rank: the bytes its stages sent to other
# ranks this step, and the share of the pipeline's step (the longest of the ranks' schedule
# runs) it did not compute (its bubble).
PIPELINE_SENT_BYTES = "pipeline_sent_bytes"
PIPELINE_BUBBLE = "pipeline_bubble"
# With parallel.cp > 1: the bytes this rank sent this step in context parallelism's
# exchanges (each gather and each reduce-scatter of its gradient sends this rank's rows to
# the cp - 1 others), the same on every rank.
CP_SENT_BYTES = "cp_sent_bytes"
# With fault_tolerance.enabled: the replica groups that took part in the step, whether it
# committed (else it is retried), the seconds this group spent receiving a healthy peer's
# state before it (a heal), and, every fault_tolerance.check_every steps and after a heal,
# a digest of each rank's parameters and optimizer state (one entry a rank of the group;
# every group's must agree).
REPLICAS = "replicas"
COMMITTED = "committed"
HEAL_S = "heal_s"
STATE_DIGEST = "state_digest"

TRAINING_KEYS = frozenset(
    {
        STEP,
        LOSS,
        LR,
        GRAD_NORM,
        TOKENS_SEEN,
        TOKENS_PER_S,
        STEP_TIME_S,
        MEMORY_PEAK_BYTES,
        EXPERT_IMBALANCE_MAX,
        EXPERT_IMBALANCE,
        EXPERT_LOAD,
        SKIPPED,
        SKIPPED_STEPS,
    }
)
VALIDATION_KEYS = frozenset({VAL_LOSS, VAL_PERPLEXITY})
CHECKPOINT_KEYS = frozenset({CHECKPOINT_S, CHECKPOINT_WAIT_S, CHECKPOINT_STAGING_BYTES})
PIPELINE_KEYS = frozenset({PIPELINE_SENT_BYTES, PIPELINE_BUBBLE})
REPLICA_KEYS = frozenset({REPLICAS, COMMITTED, HEAL_S, STATE_DIGEST})
QK_CLIP_KEYS = frozenset({QK_LOGIT_MAX, QK_HEADS_CLIPPED})
CONTEXT_PARALLEL_KEYS = frozenset({CP_SENT_BYTES})
CORE_KEYS = (
    TRAINING_KEYS
    | VALIDATION_KEYS
    | CHECKPOINT_KEYS
    | PIPELINE_KEYS
    | REPLICA_KEYS
    | QK_CLIP_KEYS
    | CONTEXT_PARALLEL_KEYS
)


__all__ = [
    "CHECKPOINT_KEYS",
    "CHECKPOINT_S",
    "CHECKPOINT_STAGING_BYTES",
    "CHECKPOINT_WAIT_S",
    "COMMITTED",
    "CONTEXT_PARALLEL_KEYS",
    "CORE_KEYS",
    "CP_SENT_BYTES",
    "EXPERT_IMBALANCE",
    "EXPERT_IMBALANCE_MAX",
    "EXPERT_LOAD",
    "GRAD_NORM",
    "HEAL_S",
    "LOSS",
    "LR",
    "MEMORY_PEAK_BYTES",
    "PIPELINE_BUBBLE",
    "PIPELINE_KEYS",
    "PIPELINE_SENT_BYTES",
    "QK_CLIP_KEYS",
    "QK_HEADS_CLIPPED",
    "QK_LOGIT_MAX",
    "REPLICAS",
    "REPLICA_KEYS",
    "SKIPPED",
    "SKIPPED_STEPS",
    "STATE_DIGEST",
    "STEP",
    "STEP_TIME_S",
    "TOKENS_PER_S",
    "TOKENS_SEEN",
    "TRAINING_KEYS",
    "VALIDATION_KEYS",
    "VAL_LOSS",
    "VAL_PERPLEXITY",
]
