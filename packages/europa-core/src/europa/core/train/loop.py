"""One training run on this process: build → shard → wrap → materialise →
optimizer → data → steps (with checkpoints) → final checkpoint and summary."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from europa.core.checkpoint import store as checkpoint
from europa.core.checkpoint.background import BackgroundSaves
from europa.core.checkpoint.global_batch import KEY as GLOBAL_BATCH
from europa.core.checkpoint.global_batch import check_global_batch, global_batch
from europa.core.config.schema import EuropaConfig
from europa.core.errors import DamagedCheckpoint, LaunchError
from europa.core.fault.launch import replica_from_environment
from europa.core.fault.state import (
    ReplicaPlace,
    load_replica_state,
    replica_state,
    state_digest,
)
from europa.core.hf.load import HFInitialiser, load_buffers, open_initialiser
from europa.core.job import Job
from europa.core.launch.distributed import (
    ProcessPlace,
    check_node_layout,
    check_node_numbering,
    data_group,
    data_parallel_coordinates,
    init_distributed,
    routed_model,
    sequence_coordinates,
    shutdown,
)
from europa.core.launch.faults import reporting_faults
from europa.core.launch.progress import LOST_CONTACT, RankProgress
from europa.core.model import count_parameters, model_spec
from europa.core.model.load_balance import move_expert_bias, summed_counts
from europa.core.model.materialise import MatrixInitialiser
from europa.core.pipeline.split import keep_rank_stages
from europa.core.plugins.manager import EuropaPluginManager
from europa.core.run_dir import JOB_FILE, SUMMARY_FILE, write_replacing
from europa.core.train import context_parallel, metrics
from europa.core.train.assemble import build_optimizer, place_model
from europa.core.train.batches import open_rank_batches
from europa.core.train.evaluate import validation_metrics
from europa.core.train.nonfinite import SkippedSteps
from europa.core.train.resources import check_fits
from europa.core.train.schedule import build_scheduler
from europa.core.train.stop import StopRequest
from europa.spec.metrics import (
    CHECKPOINT_S,
    CHECKPOINT_STAGING_BYTES,
    CHECKPOINT_WAIT_S,
    COMMITTED,
    CP_SENT_BYTES,
    HEAL_S,
    REPLICAS,
    STATE_DIGEST,
)
from europa.spec.qk_clip_step import QKClip
from europa.spec.replicas import LAYOUT_SUMS_REPLICAS, REPLICA_GROUPS


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)  # gloo has no AVG
        value /= dist.get_world_size()
    return value.item()


def _peak_memory_bytes(device: torch.device) -> int:
    """The largest over ranks of this step's peak device memory (CUDA), or of the
    process's peak resident memory so far (CPU, where host memory is the limit)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    value = torch.tensor(float(peak), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def next_token_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
    """One micro-batch's forward and its loss."""
    return logits_loss(model(inputs), labels)


class Trainer:
    def __init__(
        self,
        job: Job,
        plugins: EuropaPluginManager,
        resume_from: Path | None = None,
        *,
        from_older: bool = False,
        progress: RankProgress | None = None,
        replica: ReplicaPlace | None = None,
    ) -> None:
        """``resume_from``: the checkpoint the launcher chose to continue from (None: a
        fresh start); ``from_older``: when loading finds it damaged, continue from the
        newest intact older one; ``replica``: with ``fault_tolerance.enabled``, this
        process's replica group (``job.config`` is then the group's own)."""
        self.job = job
        self.plugins = plugins
        self.resume_from = resume_from
        self.resume = resume_from is not None
        self.from_older = from_older
        self.progress = progress or RankProgress(job.run_dir, job.rank)
        cfg = job.config
        self.skipped = SkippedSteps(cfg.training.max_skipped_steps)
        hook = plugins.hook
        model = hook.europa_build_model(job=job)
        self.counts = count_parameters(model)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check_fits(cfg, plugins, job.device, job.world_size, local_ranks, model=model,
                   ranks_per_node=job.node_size)  # fmt: skip
        stage_names = None
        if cfg.parallel.pp > 1:  # this rank keeps only its stages' modules
            from europa.core.pipeline import runner as pipeline

            _, data_ranks = data_parallel_coordinates(job.mesh)
            pipeline.check_pipeline_plugins(cfg, plugins, data_ranks=data_ranks)
            model, stage_names = keep_rank_stages(job, model)
        self.data_group = data_group(job.mesh)
        init_matrix = self._initialiser(model)  # full shapes: before sharding
        model = place_model(job, plugins, model, init_matrix)
        self.imported_bytes = None  # bytes this rank read from model.init_from
        if isinstance(init_matrix, HFInitialiser):
            load_buffers(model, init_matrix)
            self.imported_bytes = init_matrix.bytes_read
        model.train()
        self.model = model
        self.context = context_parallel.enable(job, model) if cfg.parallel.cp > 1 else None
        opt = cfg.optimizer
        self.qk_clip = QKClip(model, cfg.model.n_layers, opt.qk_clip_tau) if opt.qk_clip else None
        self._stop: StopRequest | None = None  # run()'s, which a step with replicas agrees on
        self._stop_agreed = False
        self.pipeline = None
        if stage_names is not None:
            self.pipeline = pipeline.PipelineRun(job, model, stage_names, logits_loss)
        built, self.state = build_optimizer(job, plugins, model)
        self.optimizer = job.optimizer
        self.replicas = self._join_replica_groups(replica)
        self.replica_count = replica.count if replica is not None else 1
        self._first_quorum = replica is not None  # it may find the run ahead on disk
        # Tokens trained so far; None: as many as full steps before this one would hold
        # (a fresh start, a resume from disk). With fault tolerance a step trains only its
        # participating groups' sequences, and a heal brings the peer's count.
        self.tokens_seen: int | None = None
        self.background = (
            BackgroundSaves(
                job.device,
                max_bytes_per_s=cfg.checkpoint.max_write_mbps * 1e6,
                timeout_s=cfg.parallel.collective_timeout_s,
                on_lost_contact=lambda: self.progress.mark(LOST_CONTACT),
            )
            if cfg.checkpoint.mode == "async"
            else None
        )
        self.scheduler = build_scheduler(built, cfg.training.steps, cfg.lr_schedule)
        dp_rank, dp_world = sequence_coordinates(job.mesh, cfg.parallel.cp)
        if replica is not None:  # each group reads its own share of every step's batch
            dp_rank, dp_world = replica.index * dp_world + dp_rank, replica.count * dp_world
        self.data_ranks = dp_world
        self.batches = open_rank_batches(cfg, dp_rank, dp_world, job.run_dir, job.is_main)
        if self.context is not None:
            self.batches = context_parallel.cut_batches(self.batches, self.context)
        if job.is_main:
            print(self.describe(), file=sys.stderr, flush=True)

    def _join_replica_groups(self, replica: ReplicaPlace | None):
        """With ``fault_tolerance.enabled``, this group among the others (torchft)."""
        job = self.job
        if not job.config.fault_tolerance.enabled:
            return None
        if replica is None:
            raise LaunchError(
                "fault_tolerance.enabled = true: expected this process's replica group "
                "(europa train --replica-group I)"
            )
        from europa.core.fault.groups import TorchftReplicaGroups

        groups = TorchftReplicaGroups(
            job.config, replica.index, job.rank, job.world_size,
            lambda: replica_state(self.model, self.optimizer, self._heal_trainer_state()),
            self._heal,
        )  # fmt: skip
        job.state[REPLICA_GROUPS] = groups
        return groups

    def _heal_trainer_state(self) -> dict[str, Any]:
        return {**self._trainer_state(0), "tokens_seen": self.tokens_seen}

    def _heal(self, state: dict) -> None:
        trainer = load_replica_state(self.model, self.optimizer, state)
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.skipped.count = int(trainer["skipped_steps"])
        self.tokens_seen = trainer["tokens_seen"]

    def _initialiser(self, model: torch.nn.Module):
        """Random (from the run seed), or the checkpoint of ``model.init_from`` on a fresh
        start; a resumed run is about to be overwritten by its own checkpoint."""
        cfg = self.job.config
        if cfg.model.init_from and not self.resume:
            return open_initialiser(model, model_spec(cfg.model), cfg.model)
        return MatrixInitialiser(model, cfg.run.seed)

    def describe(self) -> str:
        job, counts = self.job, self.counts
        mesh = " × ".join(
            f"{n}={s}" for n, s in zip(job.mesh.mesh_dim_names, job.mesh.shape, strict=True)
        )
        stages = ""
        if self.pipeline is not None:
            schedule = job.config.parallel.pp_schedule
            stages = f"; {self.pipeline.num_stages} pipeline stages ({schedule})"
        if self.context is not None:
            cp = job.config.parallel
            stages += f"; each sequence over {cp.cp} ranks (context parallel, {cp.cp_exchange})"
        return (
            f"europa: {job.config.run.name}: {counts.total / 1e6:.2f} M parameters "
            f"({counts.active_per_token / 1e6:.2f} M active per token); {job.world_size} "
            f"rank(s), mesh {mesh}, {job.device.type}; run directory {job.run_dir}{stages}"
        )

    # -- state ---------------------------------------------------------------------------

    def _trainer_state(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "scheduler": self.scheduler.state_dict(),
            "skipped_steps": self.skipped.count,
        }

    def restore(self) -> int:
        """Load ``resume_from`` (the launcher's choice, or the newest checkpoint a replica
        group's first quorum found). Only a damaged piece that loading finds (a flipped
        bit, which no check before reading sees) makes rank 0 choose again: an older
        intact checkpoint with ``from_older``, else the error naming the damage."""
        path = self.resume_from
        damaged: dict[Path, str] = {}  # what loading found, by checkpoint
        while True:
            check_global_batch(path, self.job.config.training, self.data_ranks)
            try:
                state = checkpoint.load_checkpoint(path, self.state, self._trainer_state(0))
                break
            except DamagedCheckpoint as err:  # on every rank: DCP gathers read failures
                damaged[path] = f"its file {Path(err.file).name}: {err.problem}"
                if self.job.is_main and self.from_older:
                    print(
                        f"europa: {path.name} is damaged ({damaged[path]}); looking for "
                        "an older intact checkpoint",
                        file=sys.stderr,
                        flush=True,
                    )
                _, path = checkpoint.decided_on_rank_0(
                    lambda: checkpoint.checkpoint_to_resume(
                        self.job.run_dir,
                        self.job.config.training.steps,
                        from_older=self.from_older,
                        damaged=damaged,
                    )
                )
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped.count = int(state["skipped_steps"])
        return int(state["step"])

    def save(self, step: int) -> dict[str, float]:
        """Checkpoint ``step``; returns the seconds training waited for it: the whole
        write (``"sync"``), or the staging copy and any wait for the save before it."""
        if self.replicas is not None and not self.replicas.writes_checkpoints:
            return {}  # another group of the quorum writes it, into the run's checkpoints
        self.progress.mark("saving", step)
        cfg = self.job.config.checkpoint
        record = {GLOBAL_BATCH: global_batch(self.job.config.training, self.data_ranks)}
        started = time.perf_counter()
        if self.background is None:
            checkpoint.save_checkpoint(
                self.job.run_dir,
                step,
                self.state,
                self._trainer_state(step),
                keep=cfg.keep,
                record=record,
                max_bytes_per_s=cfg.max_write_mbps * 1e6,
            )
            return {CHECKPOINT_S: time.perf_counter() - started}
        times = self.background.save(
            self.job.run_dir, step, self.state, self._trainer_state(step),
            keep=cfg.keep, record=record,
        )  # fmt: skip
        return {
            CHECKPOINT_S: time.perf_counter() - started,
            CHECKPOINT_WAIT_S: times.waited_s,
            CHECKPOINT_STAGING_BYTES: self.background.staging_bytes,
        }

    def finish_saves(self) -> None:
        """Wait for the background save in flight, if any (raises its failure), and
        stop the writer."""
        if self.background is not None:
            self.background.wait()
            self.background.close()

    # -- one step -------------------------------------------------------------------------

    def _forward_backward(self, step: int) -> torch.Tensor:
        accum = self.job.config.training.grad_accum_steps
        if self.pipeline is not None:
            pairs = [self.batches.source.batch(step, micro) for micro in range(accum)]
            inputs, labels = (
                torch.cat(part).to(self.job.device) for part in zip(*pairs, strict=True)
            )
            return self.pipeline.forward_backward(inputs, labels)
        total = torch.zeros((), device=self.job.device)
        for micro in range(accum):
            inputs, labels = (t.to(self.job.device) for t in self.batches.source.batch(step, micro))
            loss = next_token_loss(self.model, inputs, labels)
            (loss / accum).backward()
            total += loss.detach() / accum
        return total

    def _continue_from_disk(self, step: int) -> int:
        """After a first quorum that healed this group from no one: the run's newest
        checkpoint, if it is past ``step``, loaded now (every group of a resumed run reads
        the same save; a group restarted while the others went on, or finished the run
        and left, reads what they saved last, not the checkpoint of its restart)."""
        run_dir, steps = self.job.run_dir, self.job.config.training.steps

        def newest() -> tuple[int, Path] | None:
            if not checkpoint.complete_checkpoints(run_dir):
                return None
            return checkpoint.checkpoint_to_resume(run_dir, steps, from_older=self.from_older)

        found = checkpoint.decided_on_rank_0(newest)
        if found is None or found[0] <= step:
            return step
        self.resume_from = found[1]
        step = self.restore()
        self.replicas.continue_from(step)
        if step >= steps and self.job.is_main:
            print(
                f"europa: the other replica groups finished the run ({found[1].name}) "
                "while this group started; nothing is left to train",
                file=sys.stderr,
                flush=True,
            )
        return step

    def _clip(self) -> float:
        return self.plugins.hook.europa_clip_gradients(
            job=self.job, model=self.model, max_norm=self.job.config.training.max_grad_norm
        )

    def _average_over_replicas(self) -> None:
        """Core's layouts: every gradient, averaged over the replica groups (a technique
        that sums over replicas itself asks ``job.state[REPLICA_GROUPS]``)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.replicas.average([g.to_local() if hasattr(g, "to_local") else g for g in grads])

    def step(self, step: int) -> dict[str, Any] | None:
        """One step (with fault tolerance, the quorum's step, which a heal or the run's
        newest checkpoint may have moved past ``step``); its record says which
        (``"step"``, the steps done after it) and whether it committed (without fault
        tolerance, always). None: this group's first quorum found the run already trained
        to ``training.steps`` by the other groups."""
        started = time.perf_counter()
        replicas = {}
        if self.replicas is not None:
            begun = self.replicas.start_step()
            step = begun.step
            if self._first_quorum:
                self._first_quorum = False
                if begun.healed_s is None:  # no group of the quorum was ahead of this one
                    step = self._continue_from_disk(step)
                    if step >= self.job.config.training.steps:
                        return None
            replicas[REPLICAS] = begun.participants
            if begun.healed_s is not None:
                replicas[HEAL_S] = begun.healed_s
        self.progress.mark("step", step + 1)
        with ExitStack() as stack:
            for manager in self.plugins.hook.europa_step_context(job=self.job, step=step):
                if manager is not None:
                    stack.enter_context(manager)
            loss = self._forward_backward(step)
            maxima = None
            if self.qk_clip is not None:  # before the vote: torchft's collectives end there
                maxima = self.qk_clip.agreed_maxima(self.job.device, self.replicas)
            if self.replicas is not None and self._stop is not None:  # before the vote too
                self._stop_agreed = self._stop.agreed(self.job.device, self.replicas)
            if self.replicas is not None and not self.job.state.get(LAYOUT_SUMS_REPLICAS):
                self._average_over_replicas()
            grad_norm = self._clip()
            counts = summed_counts(self.model, self.data_group, self.replicas)
            lr = self.scheduler.get_last_lr()[0]
            committed = self.replicas is None or self.replicas.commit()
            skipped = committed and self.skipped.skips(step, grad_norm)  # a retry counts once
            load = move_expert_bias(*counts, move=committed)
            staged = {}
            if self.pipeline is not None:
                load = self.pipeline.whole_model_load(load)
                staged = self.pipeline.step_metrics()
            if self.context is not None:
                staged[CP_SENT_BYTES] = self.context.sent.take()
            if committed and not skipped:
                self.optimizer.step()
                if maxima is not None:
                    self._clip_heads(maxima)
            self.optimizer.zero_grad(set_to_none=True)
            if committed:
                self.scheduler.step()
        elapsed = time.perf_counter() - started
        imbalance = load.imbalance()
        tokens = self.batches.tokens_per_step
        if self.replicas is not None:  # the groups that took part read their sequences
            tokens = tokens * replicas[REPLICAS] // self.replica_count
        if self.tokens_seen is None:
            self.tokens_seen = self.batches.tokens_per_step * step
        if committed:
            self.tokens_seen += tokens
        if self.replicas is not None:
            replicas[COMMITTED] = committed
            if committed and self._checks_state(step, replicas):
                replicas[STATE_DIGEST] = self._state_digests()
        return {
            "step": step + 1,
            "loss": _mean_over_ranks(loss),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_seen": self.tokens_seen,
            "tokens_per_s": tokens / elapsed,
            "step_time_s": elapsed,
            "memory_peak_bytes": _peak_memory_bytes(self.job.device),
            "expert_imbalance_max": max(imbalance.values(), default=0.0),
            "expert_imbalance": imbalance,
            "expert_load": load.shares,
            **staged,
            **replicas,
            **self.skipped.record(skipped),
            **self._clip_metrics(maxima, applied=committed and not skipped),
        }

    def _clip_metrics(self, maxima: torch.Tensor | None, applied: bool) -> dict[str, Any]:
        return {} if maxima is None else self.qk_clip.metrics(maxima, applied)

    def _clip_heads(self, maxima: torch.Tensor) -> None:
        """QK-clip after the optimizer step: the layout scales the rows it holds."""
        factors = self.qk_clip.row_factors(maxima)
        if factors:
            self.plugins.hook.europa_scale_rows(job=self.job, model=self.model, factors=factors)

    def _checks_state(self, step: int, replicas: dict) -> bool:
        every = self.job.config.fault_tolerance.check_every
        return HEAL_S in replicas or (every > 0 and (step + 1) % every == 0)

    def _state_digests(self) -> list[str]:
        """Every rank's digest of its state, on every rank of the group (a collective)."""
        mine = state_digest(self.model, self.optimizer)
        if not dist.is_initialized():
            return [mine]
        every: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return every

    # -- validation -----------------------------------------------------------------------

    def _evaluates_after(self, done: int) -> bool:
        every = self.job.config.metrics.eval_every
        if self.batches.validation is None:
            return False
        return done == self.job.config.training.steps or (every > 0 and done % every == 0)

    def evaluate(self) -> dict[str, float]:
        """val_loss and val_perplexity over the validation sequences, on every rank."""
        if self.pipeline is not None:
            measured = self.pipeline.validation_metrics(
                self.model, self.batches.validation, self.job.device
            )
        else:
            measured = validation_metrics(self.model, self.batches.validation, self.job.device)
        if self.context is not None:
            self.context.sent.take()  # cp_sent_bytes counts training steps only
        return measured

    # -- the run --------------------------------------------------------------------------

    def _write_job_file(self) -> None:
        """What a report of a run still going needs and the config does not say."""
        job = self.job
        routed = routed_model(job.config, job.world_size, job.node_size)
        info = {
            "world_size": job.world_size,
            "ranks_per_node": job.node_size,
            "mesh": dict(zip(job.mesh.mesh_dim_names, job.mesh.shape, strict=True)),
            "device": job.device.type,
            "parameters": self.counts.as_dict(),
            # the router's groups as trained (parallel.ep_max_nodes_per_token sets them)
            "routing_groups": {
                "num_expert_groups": routed.num_expert_groups,
                "num_limited_groups": routed.num_limited_groups,
            },
        }
        write_replacing(job.run_dir / JOB_FILE, json.dumps(info, indent=2) + "\n")

    def run(self) -> dict[str, Any]:
        job, cfg = self.job, self.job.config
        start = 0
        if self.resume and self.replicas is None:
            start = self.restore()
        elif self.resume:  # read after the first quorum, unless a peer heals this group
            start = checkpoint.checkpoint_step(self.resume_from)
        if job.is_main:
            metrics.truncate_after(job.run_dir, start)
            sink = metrics.MetricsSink(
                job.run_dir,
                total_steps=cfg.training.steps,
                start_step=start,
                progress=cfg.metrics.progress,
                tensorboard=cfg.metrics.tensorboard,
            )
            job.emit_metrics = sink
            self._write_job_file()
        first_loss = last_loss = None
        validation: dict[str, float] = {}
        began = time.perf_counter()
        done = saved_at = start
        stopped_by = None
        after_save: dict[str, float] = {}
        with StopRequest() as stop:
            self._stop = stop
            while done < cfg.training.steps:
                record = self.step(done)
                if record is None:  # its last checkpoint is the other groups'
                    done = saved_at = cfg.training.steps
                    break
                if not record.get(COMMITTED, True):
                    job.emit_metrics(record)  # the step is retried with the same data
                    continue
                step = record["step"] - 1  # a heal may have moved the group on
                self.plugins.hook.europa_after_step(job=job, step=step, metrics=record)
                done = step + 1
                first_loss = record["loss"] if first_loss is None else first_loss
                last_loss = record["loss"]
                stopping = stop.agreed(job.device) if self.replicas is None else self._stop_agreed
                if self._evaluates_after(done) and not stopping:
                    validation = self.evaluate()
                    record.update(validation)
                record.update(after_save)  # the save after the step before this one
                logged = done % cfg.metrics.log_every == 0 or done == cfg.training.steps
                if stopping or logged or "val_loss" in record or CHECKPOINT_S in record:
                    job.emit_metrics(record)  # before the save: a checkpoint's steps are logged
                after_save = {}
                if cfg.checkpoint.every and done % cfg.checkpoint.every == 0:
                    after_save = self.save(done)
                    saved_at = done
                if stopping:
                    stopped_by = stop.signal_name or "a signal to another rank"
                    break
            if saved_at != done:
                self.save(done)
            self.finish_saves()
        if self.replicas is not None:
            self.replicas.shutdown()
        self.progress.mark("finished", done)
        summary = {
            "steps": done,
            "target_steps": cfg.training.steps,
            "stopped_by": stopped_by,
            "resumed_from": start if self.resume else None,
            "first_loss": first_loss,
            "final_loss": last_loss,
            "val_loss": validation.get("val_loss"),
            "val_perplexity": validation.get("val_perplexity"),
            "seconds": time.perf_counter() - began,
            "parameters": self.counts.as_dict(),
            "world_size": job.world_size,
        }
        if job.is_main:
            job.emit_metrics.close()
            write_replacing(job.run_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
        return summary


def use_deterministic_algorithms(deterministic: bool) -> None:
    """torch's deterministic mode, without its fill of every new allocation with NaN.

    That fill (``fill_uninitialized_memory``) only makes a read of uninitialised memory
    visible, and our kernels write every element they read; it costs an ``aten::fill_``
    per allocation (``benchmarks/e2e.py``'s operator profile counts them)."""
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def run_training(
    config: EuropaConfig,
    run_dir: Path,
    place: ProcessPlace,
    plugins: EuropaPluginManager,
    *,
    resume_from: Path | None = None,
    from_older: bool = False,
) -> dict[str, Any]:
    """Everything one process does in ``europa train``; ``resume_from``: the checkpoint
    the launcher chose (rank 0's counts; see ``launch.resume``)."""
    use_deterministic_algorithms(config.training.deterministic)
    device, mesh = init_distributed(config.parallel, place)
    job, error = None, None
    try:
        resume_from = checkpoint.rank_0s_choice(resume_from)
        job = Job(
            config=config,
            run_dir=run_dir,
            rank=place.rank,
            world_size=place.world_size,
            local_rank=place.local_rank,
            ranks_per_node=place.local_world_size,
            device=device,
            mesh=mesh,
        )
        check_node_layout(config.parallel, job.world_size, job.node_size)
        check_node_numbering(place, job.node_size)
        with warnings.catch_warnings():
            # torchtitan's router asks for fp32 autocast around its gate; CPU autocast
            # knows only bf16/fp16 and warns on every forward. The gate runs in fp32.
            warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
            with reporting_faults(run_dir, place.rank) as progress:
                trainer = Trainer(
                    job, plugins, resume_from, from_older=from_older, progress=progress,
                    replica=replica_from_environment() if config.fault_tolerance.enabled else None,
                )  # fmt: skip
                return trainer.run()
    except BaseException as err:
        error = err
        raise
    finally:
        if job is not None and REPLICA_GROUPS in job.state:  # torchft's threads would keep
            job.state[REPLICA_GROUPS].shutdown()  # a failed process from exiting
        failed = plugins.teardown(job, error) if job is not None else None
        shutdown()
        if failed is not None and error is None:
            raise failed
