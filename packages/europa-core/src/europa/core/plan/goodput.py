"""Goodput: the share of a run's wall time that trains, predicted under failures, without
and with replica fault tolerance (torchft's replica groups). Pure arithmetic, no torch.

Knobs (a design note). Two figures, both keys of the hardware profile with a default:
``failures_per_gpu_hour`` (the Llama 3 paper's rate, below) and ``restart_s`` (seconds from
a failure to ranks running again: detection, replacing or re-admitting the node, starting
the processes, the process group and the model; 120 s by default, an assumption, not a
measurement). They describe the machine and its operations (its parts' reliability, its
scheduler, its spares), not the model or the layout, so they sit in the profile beside
``filesystem_gbps`` rather than in the run's config; ``--hardware my.toml`` sets them for
another cluster. Everything else is derived from what the plan knows: the job's mean time
between failures ``M = 1 / (rate × GPUs)``; the training time a save loses, ``C``
(``checkpoint_cost.lost_per_save`` for ``checkpoint.mode``); the checkpoint's read
(``read_seconds``); a replica group's heal (``heal_seconds``). One ``restart_s`` serves a
whole job and one group: a group restarts fewer ranks and requeues nothing, so for fault
tolerance the figure errs slow.

Without fault tolerance (first order, Young 1974; Daly 2006). ``τ`` training seconds
between saves, each save losing ``C``, so a period ``T = τ + C``. Failures arrive at ``1/M``
over wall time, uniformly within a period; each stops every rank, which restart and read
the last checkpoint on disk (``R = restart + read``) and redo the work since it: half a
period on average, and with ``checkpoint.mode = "async"`` the write still in flight too
(the save being written is not on disk yet: ``L = write``; ``L = 0`` for "sync")::

    G(τ) = τ / T × (1 − (R + L + T/2) / M)          clamped to [0, 1]

For a fixed ``C`` it peaks at ``T* = sqrt(2 C (M − R − L))``, ``τ* = T* − C``: Young's
``sqrt(2 C M)`` when ``C`` and ``R`` are small against ``M`` (``young_daly_interval``). An
async save loses ``C = staging + max(0, write − τ)``: below ``τ = write`` the period is
``staging + write`` whatever ``τ`` and ``G`` grows with ``τ``, so its optimum is
``max(write, τ*(C = staging))``. With ``checkpoint.every = 0`` (only the final save) ``τ``
is the whole run and ``G`` tends to 0: a failure loses everything since the start.

With fault tolerance (``r`` > 1 replica groups). Failures arrive at the same rate over the
same GPUs; each takes down one group, whose ranks restart and heal (each receives its own
parameters and optimizer state from the same rank of a healthy group: ``H``) while the
other ``r − 1`` groups keep stepping, each step carrying ``(r − 1)/r`` of the tokens.
Nothing is rolled back; every group loses the step in flight (its sum across groups fails
and is not committed). Checkpoints are still written (for a full stop) and cost ``C``::

    G_ft(τ) = τ / T × (1 − ((restart + H) / r + step) / M)          clamped to [0, 1]

``G_ft ≥ G`` whenever ``H ≤ R``, ``r ≥ 2`` and ``τ ≥ 2 × step``: then
``(restart + H)/r ≤ restart + read/2`` and ``step ≤ τ/2``.

Not modelled (second order, or not the plan's to know): a failure during a restart or a
heal; two groups down at once; a failure of the coordinator; the healthy peer's sends
slowing its own steps; torchft's per-step quorum and the speed of its reduction across
groups (the step is the plan's, with or without fault tolerance); what a smaller global
batch does to learning (goodput counts tokens). These are predictions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from europa.core.plan.checkpoint_cost import lost_per_save

# The Llama 3 Herd of Models (Meta, 2024), section 3.3.4: 419 unexpected interruptions in
# 54 days of pre-training on 16,384 H100 GPUs, about one per 50,000 GPU-hours.
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
# Seconds from a failure to ranks running again: an assumption (set the profile's
# restart_s from your cluster's restarts).
RESTART_S = 120.0


def job_mtbf_s(failures_per_gpu_hour: float, gpus: int) -> float:
    """The whole job's mean time between failures, in seconds: any of its GPUs failing."""
    return 3600.0 / (failures_per_gpu_hour * gpus)


def read_seconds(
    rank_state_bytes: int, ranks_per_node: int, filesystem_gbps: float | None
) -> float | None:
    """A full restart's read of the last checkpoint: each node reads what its ranks hold
    (their parameters and optimizer state, copies included: every replica reads its own)
    at the file system's rate, as ``checkpoint_cost.write_seconds`` writes; None without
    the rate. ``checkpoint.max_write_mbps`` caps writes only."""
    if filesystem_gbps is None:
        return None
    return rank_state_bytes * ranks_per_node / (filesystem_gbps * 1e9)


def heal_seconds(rank_state_bytes: int, link_bytes_per_s: float) -> float:
    """A restarted group's heal with fault tolerance: each of its ranks receives its own
    parameters and optimizer state from the same rank of a healthy group, all at once, one
    peer each, at ``link_bytes_per_s`` (the link between the two, point to point)."""
    return rank_state_bytes / link_bytes_per_s


def _useful(interval_s: float, save_s: float) -> float:
    """The share of a period that trains, ``τ / (τ + C)``."""
    if math.isinf(interval_s):
        return 1.0
    period = interval_s + save_s
    return interval_s / period if period > 0 else 1.0


def _kept(lost_s: float, mtbf_s: float) -> float:
    return min(1.0, max(0.0, 1.0 - lost_s / mtbf_s))


def goodput_without_ft(interval_s: float, save_s: float, recovery_s: float, mtbf_s: float) -> float:
    """``G(τ)`` (module docstring): ``recovery_s`` is ``R + L``, restart, read and, for
    async saves, the write in flight. ``interval_s`` may be ``math.inf`` (no saves)."""
    if math.isinf(interval_s):
        return 0.0
    period = interval_s + save_s
    return _useful(interval_s, save_s) * _kept(recovery_s + period / 2, mtbf_s)


def goodput_with_ft(
    interval_s: float,
    save_s: float,
    group_recovery_s: float,
    replicas: int,
    step_s: float,
    mtbf_s: float,
) -> float:
    """``G_ft(τ)`` (module docstring): ``group_recovery_s`` is a group's restart and heal."""
    lost = group_recovery_s / replicas + step_s
    return _useful(interval_s, save_s) * _kept(lost, mtbf_s)


def optimum_interval(save_s: float, recovery_s: float, mtbf_s: float) -> float:
    """The ``τ`` at which ``goodput_without_ft`` peaks for a fixed ``save_s``:
    ``sqrt(2 C (M − R − L)) − C`` (0 where no interval trains at all)."""
    room = mtbf_s - recovery_s
    if room <= 0 or save_s <= 0:
        return 0.0
    return max(0.0, math.sqrt(2 * save_s * room) - save_s)


def save_seconds(mode: str, write_s: float, staging_s: float, interval_s: float) -> float:
    """Training seconds one save loses ``interval_s`` after the last (one step of that
    length, through ``lost_per_save``)."""
    return lost_per_save(write_s, staging_s, 1, interval_s)[mode]


def young_daly_interval(
    mode: str, write_s: float, staging_s: float, recovery_s: float, mtbf_s: float
) -> float:
    """The interval that maximises ``G`` in either mode (module docstring)."""
    if mode == "sync":
        return optimum_interval(write_s, recovery_s, mtbf_s)
    return max(write_s, optimum_interval(staging_s, recovery_s, mtbf_s))


@dataclass(frozen=True)
class Goodput:
    """A plan's goodput figures (predictions). ``None``: not known (the write or read
    needs the profile's ``filesystem_gbps``), or, for the fault-tolerant ones, one group."""

    failures_per_gpu_hour: float
    gpus: int
    mtbf_s: float  # the whole job's
    restart_s: float
    read_s: float | None  # the checkpoint, on a full restart
    heal_s: float | None  # a group's, with fault tolerance (None: one group)
    heal_link: str | None
    replicas: int
    every: int  # checkpoint.every, as configured (0: only the final save)
    interval_s: float | None  # every × step (None: every = 0)
    young_daly_s: float | None
    young_daly_steps: int | None  # the whole steps nearest it (at least 1)
    without_ft: float | None  # at checkpoint.every
    without_ft_at_young_daly: float | None  # at young_daly_steps
    with_ft: float | None
    with_ft_at_young_daly: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def estimate(
    *,
    failures_per_gpu_hour: float,
    gpus: int,
    restart_s: float,
    read_s: float | None,
    heal_s: float,
    heal_link: str,
    replicas: int,
    mode: str,
    every: int,
    step_s: float,
    write_s: float | None,
    staging_s: float,
) -> Goodput:
    """A plan's goodput: at ``checkpoint.every`` and at the Young–Daly interval (rounded to
    whole steps), without and (``replicas`` > 1) with fault tolerance."""
    mtbf = job_mtbf_s(failures_per_gpu_hour, gpus)
    tolerant = replicas > 1
    group = restart_s + heal_s
    recovery = None
    if write_s is not None and read_s is not None:
        recovery = restart_s + read_s + (write_s if mode == "async" else 0.0)

    def with_ft(interval: float, save: float | None) -> float | None:
        if not tolerant or save is None:
            return None
        return goodput_with_ft(interval, save, group, replicas, step_s, mtbf)

    def without(interval: float, save: float | None) -> float | None:
        if save is None or recovery is None:
            return None
        return goodput_without_ft(interval, save, recovery, mtbf)

    if every == 0:  # only the final save: nothing to go back to
        interval, at_every, at_every_ft = None, 0.0, with_ft(math.inf, 0.0)
    else:
        interval = every * step_s
        save = lost_per_save(write_s, staging_s, every, step_s)[mode]
        at_every, at_every_ft = without(interval, save), with_ft(interval, save)
    best_s = best_steps = at_best = at_best_ft = None
    if recovery is not None:
        best_s = young_daly_interval(mode, write_s, staging_s, recovery, mtbf)
        best_steps = max(1, round(best_s / step_s))
        save = lost_per_save(write_s, staging_s, best_steps, step_s)[mode]
        at_best = without(best_steps * step_s, save)
        at_best_ft = with_ft(best_steps * step_s, save)
    return Goodput(
        failures_per_gpu_hour=failures_per_gpu_hour,
        gpus=gpus,
        mtbf_s=mtbf,
        restart_s=restart_s,
        read_s=read_s,
        heal_s=heal_s if tolerant else None,
        heal_link=heal_link if tolerant else None,
        replicas=replicas,
        every=every,
        interval_s=interval,
        young_daly_s=best_s,
        young_daly_steps=best_steps,
        without_ft=at_every,
        without_ft_at_young_daly=at_best,
        with_ft=at_every_ft,
        with_ft_at_young_daly=at_best_ft,
    )
