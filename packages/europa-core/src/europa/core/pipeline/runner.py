"""One rank's part of a pipeline: its stages of the model and torch's schedule over them.

Design note. The rank holds one module, ``model``: the whole model with every module
but its stages' deleted (``split_model``), placed, initialised and optimised like any
model, so its parameters keep the whole model's names and a checkpoint saved with one
cut loads with another. Each stage the schedule runs is a *view* of it: a shallow copy of
the decoder whose ``layers`` hold only that stage's layer objects (the same ones) and
whose embedding, norm and head are there only in the first and the last stage. The
schedule's forward and backward therefore fill the rank module's gradients.

The schedule takes the step's micro-batches in one batch and splits it into them along
the batch dimension, in order: the same micro-batches, in the same order, as the
trainer's own loop. Its loss function divides by their number and its gradients are
summed (``scale_grads=False``), as the trainer's ``(loss / accum).backward()`` does.
"""

from __future__ import annotations

import copy
import functools
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import OVERLAP_F_B

from europa.core.model.load_balance import ExpertLoad
from europa.core.pipeline.counters import StageCounters
from europa.core.pipeline.cut import LAYERS
from europa.core.pipeline.paired import paired_chunks
from europa.core.pipeline.schedules import build_schedule
from europa.core.pipeline.stages import rank_stages, stage_ranks
from europa.spec.job import DATA_AXES
from europa.spec.lanes import PAIRED_SCHEDULES, TWINS_MADE
from europa.spec.metrics import PIPELINE_BUBBLE, PIPELINE_SENT_BYTES


def stage_view(model: nn.Module, keep: Sequence[str]) -> nn.Module:
    """A decoder sharing ``model``'s modules, holding only ``keep`` of them."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    wanted = set(keep)
    layers = getattr(model, LAYERS)
    view._modules[LAYERS] = type(layers)(
        {key: layer for key, layer in layers.items() if f"{LAYERS}.{key}" in wanted}
    )
    for name in view._modules:
        if name != LAYERS and name not in wanted:
            view._modules[name] = None
    return view


def bubbles(compute_s: Sequence[float], schedule_s: Sequence[float]) -> list[float]:
    """Each pipeline rank's bubble: the share of the pipeline's step it did not compute,
    the step being the longest of the ranks' schedule runs (they start together, after
    the last step's collectives). A rank done early waits for the others there, as the
    plan counts it."""
    step = max(schedule_s)
    return [1 - c / step for c in compute_s]


class PipelineRun:
    """This rank's stages of ``model`` (the rank module) and the schedule over them."""

    def __init__(self, job, model: nn.Module, names: Sequence[Sequence[str]], loss_fn) -> None:
        config = job.config
        self.group = job.mesh["pp"].get_group()
        pp_rank = job.mesh["pp"].get_local_rank()
        self.num_stages = num_stages = len(names)
        self.stages = rank_stages(config.parallel, pp_rank)
        self.first, self.last = 0 in self.stages, num_stages - 1 in self.stages
        micro = config.training.grad_accum_steps
        views = [(i, stage_view(model, names[i])) for i in self.stages]
        self.views = dict(views)
        self.pp_rank = pp_rank
        parallel = config.parallel
        self.owner = stage_ranks(parallel)  # by stage: the pipeline rank running it
        self.hidden_dtype = getattr(torch, config.training.dtype)  # what flows between stages
        self.dim = config.model.dim

        def scaled_loss(logits, labels):
            return loss_fn(logits, labels) / micro

        batch, dtype = config.training.batch_size, self.hidden_dtype
        seq = config.training.seq_len // config.parallel.cp  # a rank's rows of each sequence

        def shapes(index: int) -> dict[str, torch.Tensor | None]:
            hidden = torch.empty(batch, seq, self.dim, dtype=dtype, device="meta")
            first, last = index == 0, index == num_stages - 1
            out = hidden
            if last:
                vocab = config.model.vocab_size
                out = torch.empty(batch, seq, vocab, dtype=dtype, device="meta")
            tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
            return {  # a stage's hidden input needs its gradient: the stage before sends it
                "input_args": tokens if first else hidden.clone().requires_grad_(),
                "output_args": out,
                "input_grads": (None,) if first else hidden,
                "output_grads": (None,) if last else hidden,
            }

        self.schedule, stages = build_schedule(
            config.parallel.pp_schedule, views, num_stages, job.device, self.group, micro,
            scaled_loss, shapes,
        )  # fmt: skip
        self.counters = StageCounters(stages)
        self.counters.count_loss(self.schedule)
        self.paired_side_by_side = pairs_side_by_side(job)
        if parallel.pp_schedule in PAIRED_SCHEDULES and job.is_main:
            how = "side by side (two threads)" if self.paired_side_by_side else "in turn"
            print(f"pipeline: {parallel.pp_schedule}'s paired chunks run {how}",
                  file=sys.stderr, flush=True)  # fmt: skip
        if self.paired_side_by_side:
            self.schedule.register_custom_function(
                OVERLAP_F_B, functools.partial(paired_chunks, span=self.counters.pair_span)
            )

    def step_metrics(self) -> dict[str, list[float]]:
        """This step's bytes sent and bubble of every pipeline rank (a collective)."""
        counters = self.counters
        mine = torch.tensor(
            [float(counters.sent_bytes), counters.compute_s, self.schedule_s],
            dtype=torch.float64,
        )
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        return {
            PIPELINE_SENT_BYTES: [int(t[0]) for t in every],
            PIPELINE_BUBBLE: bubbles([float(t[1]) for t in every], [float(t[2]) for t in every]),
        }

    @torch.no_grad()
    def validation_metrics(self, model: nn.Module, batches, device) -> dict[str, float]:
        """``europa.core.train.evaluate.validation_metrics`` through the stages: each
        validation batch goes forward stage by stage (no schedule: nothing is saved for a
        backward), the hidden state sent to the next stage's rank; the last stage's ranks
        hold the losses. A collective over every rank."""
        from europa.core.train.evaluate import restoring_expert_counts, summed_metrics, token_losses

        sums = torch.zeros(2, dtype=torch.float64)
        last = self.num_stages - 1
        with restoring_expert_counts(model):
            for index in range(batches.num_batches):
                inputs, labels, weights = batches.batch(index)
                hidden = None
                for stage in range(self.num_stages):
                    if self.owner[stage] != self.pp_rank:
                        continue
                    if stage == 0:
                        hidden = inputs.to(device)
                    elif self.owner[stage - 1] != self.pp_rank:
                        hidden = self._receive(stage - 1, (*inputs.shape, self.dim), device)
                    hidden = self.views[stage](hidden)
                    if stage < last and self.owner[stage + 1] != self.pp_rank:
                        dist.send(hidden.contiguous(), group=self.group,
                                  group_dst=self.owner[stage + 1])  # fmt: skip
                if self.last:
                    sums += token_losses(hidden, labels.to(device), weights)
        return summed_metrics(sums, device)  # the other stages' ranks add zeros

    def _receive(self, stage: int, shape, device) -> torch.Tensor:
        hidden = torch.empty(shape, dtype=self.hidden_dtype, device=device)
        dist.recv(hidden, group=self.group, group_src=self.owner[stage])
        return hidden

    def whole_model_load(self, load: ExpertLoad) -> ExpertLoad:
        """Every stage's expert loads (each rank measured its own layers'), on every rank."""
        parts: list[dict] = [{} for _ in range(dist.get_world_size(self.group))]
        dist.all_gather_object(parts, load.shares, group=self.group)
        return ExpertLoad({layer: row for part in parts for layer, row in part.items()})

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The step's micro-batches (stacked along the batch) through the schedule; the
        step's loss (the mean over micro-batches) on every rank of the pipeline."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        self.counters.reset()
        started = time.perf_counter()
        self.schedule.step(*args, target=labels if self.last else None,
                           losses=losses if self.last else None)  # fmt: skip
        self.schedule_s = time.perf_counter() - started
        total = torch.zeros((), device=inputs.device)
        for loss in losses:
            total += loss.detach()
        dist.all_reduce(total, group=self.group)  # only the last stage's rank holds it
        return total


# The plugins whose hooks have run inside pipeline stages and been checked there
# (tests/europa_core/test_pipeline_techniques.py); any other is refused before it trains.
RUN_INSIDE_STAGES = ("flexshard", "offload", "overlap")


def check_pipeline_plugins(config, plugins, data_ranks: int) -> None:
    """Refuse, in one line, a plugin not known to work inside pipeline stages, or a layout
    the schedule cannot run over ``data_ranks`` data-parallel ranks a stage."""
    from europa.core.errors import ConfigError
    from europa.core.pipeline.kinds import SPLIT_BACKWARD

    enabled = [info.name for info in plugins.plugins() if info.enabled and not info.builtin]
    untried = [name for name in enabled if name not in RUN_INSIDE_STAGES]
    parallel = config.parallel
    pp = parallel.pp
    if untried:
        raise ConfigError(
            f"parallel.pp = {pp} with plugins {untried}: expected only "
            f"{list(RUN_INSIDE_STAGES)} beside core inside pipeline stages"
        )
    if parallel.pp_overlap_f_b == "on" and "flexshard" not in enabled:
        raise ConfigError(
            'parallel.pp_overlap_f_b = "on" without flexshard: expected a layout whose '
            'collectives take lanes of their own; core\'s do not ("auto" runs paired '
            "chunks side by side where a stage has one rank)"
        )
    if parallel.pp_schedule in SPLIT_BACKWARD and data_ranks > 1 and "flexshard" not in enabled:
        # torch's stage_backward_weight looks each weight up by its gradient accumulator;
        # FSDP2's graph ran on the gathered parameters, whose accumulators are not those of
        # the sharded parameters the stage holds (a KeyError in its weight half).
        raise ConfigError(
            f'parallel.pp_schedule = "{parallel.pp_schedule}" with core\'s FSDP2 over '
            f"{data_ranks} data-parallel ranks a stage: expected -p flexshard, or one "
            "data-parallel rank a stage; torch's split backward finds each weight by its "
            "gradient accumulator, which FSDP2's sharded parameters are not"
        )
    if "overlap" in enabled and "flexshard" not in enabled:
        # Each stage part is an FSDP2 root of its own; FSDP2 cannot prefetch one root's
        # gather from another (their communication state is set up on first use).
        raise ConfigError(
            f"parallel.pp = {pp} with plugin overlap over core's FSDP2: expected flexshard "
            "beside it; FSDP2's prefetch between pipeline stage parts is not built"
        )


def pairs_side_by_side(job) -> bool:
    """Whether this run's paired chunks (DualPipeV's) run side by side in two threads
    (``parallel.pp_overlap_f_b``): where every collective inside a stage can take a lane of
    its own (a technique made twins of its groups: ``europa.spec.lanes``) or a stage has no
    collective (one rank)."""
    from europa.core.errors import ConfigError

    parallel = job.config.parallel
    mode = parallel.pp_overlap_f_b
    if parallel.pp_schedule not in PAIRED_SCHEDULES or mode == "off":
        return False
    if job.state.get(TWINS_MADE) or job.mesh[DATA_AXES].size() == 1:
        return True
    if mode == "on":
        raise ConfigError(
            f'parallel.pp_overlap_f_b = "on" with {job.mesh[DATA_AXES].size()} ranks a '
            "stage: expected a layout whose collectives take lanes of their own (flexshard); "
            'core\'s do not: set "auto" or "off"'
        )
    return False
