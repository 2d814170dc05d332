"""Checks that involve more than one key. Each names the offending key, its
value and the bound another key sets."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from europa.core.config.values import fail
from europa.core.pipeline.kinds import fixed_stages_per_rank, stages_per_rank
from europa.spec.lanes import PAIRED_SCHEDULES

if TYPE_CHECKING:
    from europa.core.config.schema import EuropaConfig


# A file name on common file systems is at most 255 bytes; the run directory adds "-<time>".
MAX_RUN_NAME_BYTES = 200


def check_cross_field_rules(config: EuropaConfig) -> None:
    _check_run_name(config.run.name)
    _check_model(config)
    m, t, p = config.model, config.training, config.parallel
    if p.ep > m.num_experts:  # uneven splits are fine: 6 experts over 4 ranks is 2, 2, 1, 1
        raise fail("parallel.ep", p.ep, f"at most model.num_experts ({m.num_experts})")
    _check_expert_exchange(config)
    if p.dp_shard == 0:
        raise fail("parallel.dp_shard", p.dp_shard, "-1 (all remaining ranks) or an integer > 0")
    if t.seq_len > m.max_seq_len:
        raise fail("training.seq_len", t.seq_len, f"at most model.max_seq_len ({m.max_seq_len})")
    _check_pipeline(config)
    _check_context_parallel(config)
    _check_fault_tolerance(config)
    opt = config.optimizer
    if opt.qk_clip and opt.name != "muon":
        raise fail("optimizer.qk_clip", True,
                   f'false with optimizer.name = "{opt.name}" (QK-clip is MuonClip\'s: it needs '
                   'optimizer.name = "muon")')  # fmt: skip


def _check_context_parallel(config: EuropaConfig) -> None:
    cp, seq_len = config.parallel.cp, config.training.seq_len
    if cp > 1 and seq_len % (2 * cp):
        raise fail("training.seq_len", seq_len,
                   f"a multiple of 2 × parallel.cp = {2 * cp} (each rank holds two of "
                   f"{2 * cp} equal chunks of a sequence)")  # fmt: skip


# Each stage of a ladder must outlast the one below it: a slow collective fails the
# step before the step's own timeout, a live group still in its step is waited for before
# the quorum forms without it, and a quorum request outlasts that wait. The Lighthouse
# looks for a quorum more often than it drops a silent group, and drops it before it
# would stop waiting for it.
TIMEOUT_LADDERS = (
    ("process_group_timeout_s", "step_timeout_s", "join_timeout_s", "quorum_timeout_s"),
    ("quorum_tick_s", "heartbeat_timeout_s", "join_timeout_s"),
)


def _check_fault_tolerance(config: EuropaConfig) -> None:
    ft = config.fault_tolerance
    if not ft.enabled:
        return
    if ft.lighthouse and not is_http_host_port(ft.lighthouse):
        raise fail("fault_tolerance.lighthouse", ft.lighthouse,
                   "http://host:port, or empty for one on 127.0.0.1")  # fmt: skip
    for ladder in TIMEOUT_LADDERS:
        unclimbed = first_unclimbed(ft, ladder)
        if unclimbed is not None:
            lower, higher = unclimbed
            raise fail(f"fault_tolerance.{higher}", getattr(ft, higher),
                       f"more than fault_tolerance.{lower} ({getattr(ft, lower)})")  # fmt: skip


def first_unclimbed(timings, ladder: tuple[str, ...]) -> tuple[str, str] | None:
    """The first two neighbouring rungs of ``ladder`` (names of ``timings``' attributes)
    where the higher does not exceed the lower, or None."""
    for lower, higher in itertools.pairwise(ladder):
        if getattr(timings, higher) <= getattr(timings, lower):
            return lower, higher
    return None


def is_http_host_port(address: str) -> bool:
    where = urlsplit(address)
    try:
        port = where.port
    except ValueError:  # not a number, or out of range
        return False
    rest = (where.path, where.query, where.fragment, where.username)
    return where.scheme == "http" and bool(where.hostname) and port is not None and not any(rest)


def _check_pipeline(config: EuropaConfig) -> None:
    """A schedule's stages per rank and micro-batches (torch's own conditions, checked
    before any rank starts), and a stated cut."""
    m, t, p = config.model, config.training, config.parallel
    per_rank = stages_per_rank(p.pp_schedule, p.pp_stages_per_rank)
    fixed = fixed_stages_per_rank(p.pp_schedule)
    if fixed is not None and per_rank != fixed:
        raise fail("parallel.pp_stages_per_rank", per_rank, f"{fixed} for {p.pp_schedule}")
    if fixed is None and per_rank < 2:
        raise fail("parallel.pp_stages_per_rank", per_rank, f"2 or more for {p.pp_schedule}")
    if p.pp_overlap_f_b == "on" and (p.pp == 1 or p.pp_schedule not in PAIRED_SCHEDULES):
        raise fail(
            "parallel.pp_overlap_f_b",
            p.pp_overlap_f_b,
            f'"auto" or "off" unless parallel.pp > 1 with a schedule pairing chunks '
            f"({', '.join(PAIRED_SCHEDULES)})",
        )
    if p.pp == 1:
        if p.pp_layers:
            raise fail("parallel.pp_layers", p.pp_layers, "empty without pipeline stages")
        return
    stages, micro = p.pp * per_rank, t.grad_accum_steps
    if stages > m.n_layers:
        raise fail(
            "parallel.pp",
            p.pp,
            f"at most model.n_layers ({m.n_layers}) stages in all; {p.pp} ranks × "
            f"{per_rank} stages each is {stages}",
        )
    if p.pp_schedule in ("1f1b", "dualpipev") and micro < stages:
        raise fail(
            "training.grad_accum_steps",
            micro,
            f"at least the {stages} stages, as {p.pp_schedule} needs one micro-batch a stage",
        )
    rounds = max(1, micro // p.pp)
    if p.pp_schedule == "interleaved-1f1b" and micro % rounds:
        raise fail(
            "training.grad_accum_steps",
            micro,
            f"a multiple of its rounds ({rounds} = micro-batches // parallel.pp), as "
            "interleaved-1f1b needs",
        )
    if p.pp_layers and (
        len(p.pp_layers) != stages
        or any(n < 1 for n in p.pp_layers)
        or sum(p.pp_layers) != m.n_layers
    ):
        raise fail(
            "parallel.pp_layers",
            p.pp_layers,
            f"{stages} positive layer counts, one a stage, summing to model.n_layers "
            f"({m.n_layers})",
        )


_EXCHANGE_DEFAULTS = {
    "ep_dispatch": "auto",
    "ep_dispatch_dtype": "compute",
    "ep_max_nodes_per_token": 0,
    "ep_keep_exchanges": False,
}


def _check_expert_exchange(config: EuropaConfig) -> None:
    """The expert-exchange keys need expert parallelism; the node limit needs routing
    groups that follow the nodes. What needs the world size: ``europa.core.launch.distributed``."""
    m, p = config.model, config.parallel
    if p.ep == 1:
        for key, default in _EXCHANGE_DEFAULTS.items():
            if getattr(p, key) != default:
                raise fail(
                    f"parallel.{key}",
                    getattr(p, key),
                    "its default when parallel.ep = 1 (no token is exchanged)",
                )
    checkpointing = config.extensions.get("activation_checkpointing")
    if p.ep_keep_exchanges and getattr(checkpointing, "mode", "none") != "full":
        raise fail(
            "parallel.ep_keep_exchanges",
            True,
            'activation_checkpointing.mode = "full" (only a recomputed forward exchanges again)',
        )
    limit = p.ep_max_nodes_per_token
    if not limit:
        return
    if m.num_expert_groups:
        raise fail(
            "model.num_expert_groups",
            m.num_expert_groups,
            "0 when parallel.ep_max_nodes_per_token is set (the routing groups are the nodes)",
        )
    if m.num_experts % p.ep:
        raise fail(
            "parallel.ep_max_nodes_per_token",
            limit,
            f"0 unless model.num_experts ({m.num_experts}) is a multiple of parallel.ep "
            f"({p.ep}): an uneven split leaves a routing group straddling two nodes",
        )


def _check_model(config: EuropaConfig) -> None:
    m = config.model
    if m.top_k > m.num_experts:
        raise fail("model.top_k", m.top_k, f"at most model.num_experts ({m.num_experts})")
    if m.n_dense_layers >= m.n_layers:
        raise fail(
            "model.n_dense_layers",
            m.n_dense_layers,
            f"less than model.n_layers ({m.n_layers}) so that at least one layer is MoE",
        )
    if m.num_expert_groups == 0:
        if m.num_limited_groups:
            raise fail(
                "model.num_limited_groups",
                m.num_limited_groups,
                "0 when model.num_expert_groups is 0",
            )
        return
    if m.num_experts % m.num_expert_groups:
        raise fail(
            "model.num_expert_groups",
            m.num_expert_groups,
            f"a divisor of model.num_experts ({m.num_experts})",
        )
    if m.num_experts // m.num_expert_groups < 2:
        raise fail(
            "model.num_expert_groups",
            m.num_expert_groups,
            f"at most model.num_experts / 2 ({m.num_experts // 2}): each group needs 2 experts",
        )
    if not 1 <= m.num_limited_groups <= m.num_expert_groups:
        raise fail(
            "model.num_limited_groups",
            m.num_limited_groups,
            f"between 1 and model.num_expert_groups ({m.num_expert_groups})",
        )
    reachable = m.num_limited_groups * (m.num_experts // m.num_expert_groups)
    if m.top_k > reachable:
        raise fail(
            "model.top_k",
            m.top_k,
            f"at most the {reachable} experts the {m.num_limited_groups} limited groups hold",
        )


def _check_run_name(name: str) -> None:
    """The default run directory is ``runs/<name>-<time>``: the name must stay one folder."""
    if not name or "/" in name or "\0" in name:
        raise fail("run.name", name, 'a non-empty folder name without "/" or NUL')
    if len(name.encode("utf-8")) > MAX_RUN_NAME_BYTES:  # UTF-8: values.coerce checked it
        raise fail("run.name", name, f"at most {MAX_RUN_NAME_BYTES} bytes (a folder name)")
