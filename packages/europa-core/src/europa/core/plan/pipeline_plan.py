"""Pipeline stages in the plan (``parallel.pp > 1``). Every figure is a prediction.

Design note. Each pipeline rank holds some stages' layers (``europa.core.pipeline.stages``,
the same cut the trainer makes) and trains them over its stage's data-parallel ranks
(``world / pp`` of them), so each is planned as a model of its own: the model's parameter
shapes cut to its modules, through every plugin's ``europa_plan``, over ``world / pp``
ranks, with only its blocks' activations and FLOPs. Two things differ from a model
trained alone:

* **Activations in flight.** A rank holds several micro-batches' saved activations at
  once (1F1B's first stage holds ``P``). The schedule's own order, played out
  (``europa.plan.simulate``, europa-plan's), gives the most any rank holds at once, stage by
  stage, on the device and in host memory (europa-offload's share).
* **The step.** Each stage's forward and backward of one micro-batch takes its rank's
  planned step (compute and the exposed traffic of its own layout) over the
  micro-batches, shared among the rank's stages by FLOPs. The schedule's order, with a
  hidden state (or its gradient) crossing between ranks at the point-to-point rate of
  the link it crosses, gives the step (the last action's end) and each rank's bubble (the
  share of the step it waits). DualPipeV's paired chunks run side by side
  (``parallel.pp_overlap_f_b``): one micro-batch's exposed expert exchange hides behind the
  other's compute (``simulate``'s design note), and the plan states the step saved.

The plan returned is the rank with the most device memory's, with the pipeline's step,
traffic and ``pipeline`` (every rank's figures) in it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from europa.core.job import Job
from europa.core.pipeline.cut import EMBEDDING, HEAD
from europa.core.pipeline.kinds import SPLIT_BACKWARD, STAGE_SEND_KIND, stages_per_rank
from europa.core.pipeline.stages import rank_module_names, rank_stages, stage_names
from europa.core.plan.assemble import StageScope, assemble, plugin_plan, stage_activations
from europa.core.plan.checkpoint_cost import write_seconds
from europa.core.plan.context import rows_per_micro_batch
from europa.core.plan.memory import unique_state_bytes
from europa.core.plan.record import PipelinePlan, PipelineRank
from europa.core.plan.traffic import EXCHANGE_KIND, INTER, INTRA, Traffic
from europa.plan.exposure import StepTime, Transfer, pipeline_step_time
from europa.plan.schedules import rank_orders
from europa.plan.simulate import Simulation, simulate
from europa.spec.lanes import lanes_wanted

ROOT = "<root>"  # the activations of the embedding, the final norm and the loss
STAGE_KIND = STAGE_SEND_KIND  # hidden states forward, their gradients back


def stage_link(pp_from: int, pp_to: int, data_ranks: int, per_node: int) -> str:
    """The link between the same data position of two pipeline ranks (``pp`` is the mesh's
    outermost axis: pipeline rank ``p`` holds global ranks ``p·D … p·D + D - 1``)."""
    same = all(
        (pp_from * data_ranks + k) // per_node == (pp_to * data_ranks + k) // per_node
        for k in range(data_ranks)
    )
    return INTRA if same else INTER


def plan_pipeline(config, plugins, hardware, world_size: int, shapes, per_node: int):
    """The plan of ``config`` with ``parallel.pp > 1`` stages (see the design note)."""
    from europa.core.launch.distributed import mesh_shape

    parallel, training = config.parallel, config.training
    pp, micro = parallel.pp, training.grad_accum_steps
    data_ranks = world_size // pp
    alone = replace(config, parallel=replace(parallel, pp=1))  # a stage's own layout
    names = stage_names(config, shapes.as_dict(), shapes.layer_keys())
    per_rank = stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)
    orders = rank_orders(parallel.pp_schedule, pp, per_rank, micro)
    rank_of = {a.stage: r for r, order in orders.items() for a in order}
    held_by = {r: rank_stages(parallel, r) for r in range(pp)}
    mode = "full" if config.section("activation_checkpointing").mode == "full" else "none"
    job = Job(config=alone, run_dir=Path("."), world_size=data_ranks, ranks_per_node=per_node)

    modules_of = {r: rank_module_names(names, stages) for r, stages in held_by.items()}
    shapes_of = {r: shapes.subset(modules) for r, modules in modules_of.items()}
    plugin_plans = {}
    per_stage = {}  # one micro-batch's saved activations, by stage
    recomputed = {}  # what a split backward's I recomputes and keeps to its W, by stage
    split_recomputed = mode == "full" and parallel.pp_schedule in SPLIT_BACKWARD
    for r, stages in held_by.items():
        plugin_plans[r] = plan = plugin_plan(job, plugins, shapes_of[r], hardware=hardware)
        for s in stages:
            by_mode = stage_activations(alone, hardware, plan, _blocks(names[s]))
            per_stage[s] = by_mode[mode]
            if split_recomputed:
                recomputed[s] = sum(b for n, b in by_mode["none"].per_block.items() if n != ROOT)
    held_device = _held(
        orders,
        lambda s: per_stage[s].device - per_stage[s].recompute,
        lambda s: recomputed.get(s, 0),  # on the device: offload moves what forward saves
    )
    held_host = _held(orders, lambda s: per_stage[s].host)

    plans = {}
    mesh = mesh_shape(alone.parallel, data_ranks)[1:]
    for r, modules in modules_of.items():
        scope = StageScope(
            blocks=_blocks(modules),
            layers=_layers(modules),
            head=any(h in modules for h in HEAD),
            held_device=round(held_device.peak_held[r]),
            held_host=round(held_host.peak_held[r]),
            run_world_size=world_size,
        )
        plans[r] = assemble(alone, hardware, data_ranks, mesh, shapes_of[r], plugin_plans[r],
                            per_node, scope)  # fmt: skip

    hidden = rows_per_micro_batch(config) * config.model.dim * _itemsize(training)
    crossings = {  # (from stage, to stage) on two ranks -> the link between them
        (a, b): stage_link(rank_of[a], rank_of[b], data_ranks, per_node)
        for a in rank_of
        for b in (a - 1, a + 1)
        if b in rank_of and rank_of[a] != rank_of[b]
    }
    link = INTER if INTER in crossings.values() else INTRA
    one_send = Transfer(STAGE_KIND, link, hidden, hardware.bandwidth(link, "point_to_point"), False)
    share = _compute_shares(config, shapes, names, held_by)

    def played(overlap: bool, side_by_side: bool) -> Simulation:
        def stage_s(stage: int, of_step) -> float:
            plan = plans[rank_of[stage]]
            return (
                of_step(plan.with_overlap if overlap else plan.without_overlap)
                / micro
                * share[stage]
            )

        return simulate(
            orders,
            lambda stage: stage_s(stage, lambda step: step.step_s - step.optimizer_s),
            lambda a, b: one_send.seconds if (a, b) in crossings else 0.0,
            exchange_s=(lambda stage: stage_s(stage, exposed_exchange_s)) if side_by_side else None,
        )

    side_by_side = lanes_wanted(parallel)
    with_overlap, without_overlap = played(True, side_by_side), played(False, side_by_side)
    overlapped = any(p.overlap_enabled for p in plans.values())
    step = with_overlap if overlapped else without_overlap
    in_turn = played(overlapped, False) if side_by_side else step
    sends = {
        r: micro * hidden * sum((s, b) in crossings for s in stages for b in (s - 1, s + 1))
        for r, stages in held_by.items()
    }
    ranks = tuple(
        PipelineRank(
            rank=r,
            stages=tuple(stages),
            modules=tuple(modules_of[r]),
            device_bytes=plans[r].device_total,
            held_micro_batches=_in_micro_batches(held_device.peak_held[r], stages, per_stage),
            send_bytes=sends[r],
            busy_s=step.busy_s[r],
            bubble=step.bubble(r),
        )
        for r, stages in held_by.items()
    )
    pipeline = PipelinePlan(
        schedule=parallel.pp_schedule,
        pp=pp,
        stages=len(names),
        micro_batches=micro,
        stage_modules=tuple(tuple(n) for n in names),
        ranks=ranks,
        hidden_bytes=hidden,
        link=link,
        step_s=step.step_s,
        paired_hidden_s=in_turn.step_s - step.step_s,
    )
    heaviest = max(plans, key=lambda r: plans[r].device_total)
    whole = _WholeRun(config, shapes, hardware, world_size, per_node, tuple(plans.values()))
    whole_plan = whole.plan(
        plans[heaviest], pipeline, (with_overlap, without_overlap), sends[heaviest]
    )
    reads = [p.checkpoint_read_s for p in plans.values()]  # every rank reads, heals at once
    return replace(
        whole_plan,
        pipeline_rank_plans=tuple(plans[r] for r in range(pp)),
        checkpoint_read_s=None if None in reads else max(reads),
        heal_s=max(p.heal_s for p in plans.values()),
    )


def exposed_exchange_s(step: StepTime) -> float:
    """The expert exchange's share of ``step``'s exposed traffic."""
    exchange = sum(s for (kind, _), s in step.link_s.items() if kind == EXCHANGE_KIND)
    return min(exchange, step.exposed_s)


def _blocks(modules) -> frozenset[str]:
    """The activation blocks of ``modules``: their layers, and the root's (embedding, final
    norm, loss) where they hold the embedding or the head."""
    root = EMBEDDING in modules or any(h in modules for h in HEAD)
    return frozenset([m for m in modules if m.startswith("layers.")] + [ROOT] * root)


def _layers(modules) -> int:
    return sum(m.startswith("layers.") for m in modules)


def _itemsize(training) -> int:
    return 2 if training.dtype == "bfloat16" else 4


def _held(orders, held_bytes, recomputed_bytes=lambda stage: 0) -> Simulation:
    """The order played out with unit compute: what each rank holds does not depend on
    when its actions run, only on their order."""
    return simulate(orders, lambda s: 1.0, lambda a, b: 0.0, held_bytes,
                    recomputed_bytes=recomputed_bytes)  # fmt: skip


def _in_micro_batches(held: float, stages, per_stage) -> float:
    one = sum(per_stage[s].device - per_stage[s].recompute for s in stages)
    return held / one if one else 0.0


def _compute_shares(config, shapes, names, held_by) -> dict[int, float]:
    """Each stage's share of its rank's FLOPs."""
    from europa.core.plan.timing import model_flops_per_token

    m, seq = config.model, config.training.seq_len
    flops = {
        s: model_flops_per_token(shapes.subset(names[s]), m, seq, _layers(names[s]))
        for s in range(len(names))
    }
    shares = {}
    for stages in held_by.values():
        total = sum(flops[s] for s in stages)
        for s in stages:
            shares[s] = flops[s] / total if total else 1 / len(stages)
    return shares


@dataclass(frozen=True)
class _WholeRun:
    config: object
    shapes: object
    hardware: object
    world_size: int
    per_node: int
    rank_plans: tuple  # every pipeline rank's plan: the slowest optimizer step ends the step

    def plan(self, rank_plan, pipeline: PipelinePlan, played, send: int):
        """The heaviest rank's plan as the whole run's: the pipeline's step and MFU, its
        stage transfers in the traffic, the whole model's FLOPs and checkpoint."""
        from europa.core.plan.timing import model_flops_per_token

        config, shapes, hardware = self.config, self.shapes, self.hardware
        training = config.training
        per_token = model_flops_per_token(shapes, config.model, training.seq_len)
        tokens = rows_per_micro_batch(config) * training.grad_accum_steps
        link = pipeline.link
        traffic = [*rank_plan.traffic]
        sends = []
        if send:
            traffic.append(Traffic(STAGE_KIND, link, send, overlappable=False, direct=True))
            rate = hardware.bandwidth(link, "point_to_point")
            sends.append(Transfer(STAGE_KIND, link, send, rate, overlapped=False))

        ranks = self.rank_plans

        def played_step(sim: Simulation, rank_step: StepTime) -> StepTime:
            return pipeline_step_time(
                rank_step,
                busy_s=max(sim.busy_s.values()),
                step_s=sim.step_s,
                extra=sends,
                model_flops=per_token * tokens,
                peak_flops=hardware.peak_flops(training.dtype) * config.parallel.pp,
                optimizer_s=max(p.with_overlap.optimizer_s for p in ranks),
            )

        with_overlap, without_overlap = played
        checkpoint = unique_state_bytes(shapes.parameters, config.optimizer.name)
        nodes = self.world_size // self.per_node
        return replace(
            rank_plan,
            config=config,
            world_size=self.world_size,
            shapes=shapes,
            traffic=traffic,
            with_overlap=played_step(with_overlap, rank_plan.with_overlap),
            without_overlap=played_step(without_overlap, rank_plan.without_overlap),
            model_flops_per_token=per_token,
            checkpoint_bytes=checkpoint,
            checkpoint_write_s=write_seconds(
                checkpoint,
                nodes,
                self.per_node,
                hardware.filesystem_gbps,
                config.checkpoint.max_write_mbps,
            ),
            pipeline=pipeline,
        )
