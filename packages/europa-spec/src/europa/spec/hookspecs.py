"""The europa hook specification: every hook, the phase of a run that calls it, and the
order of the phases. One place; a test checks the trainer calls them in this order.

A plugin implements any of these with ``hookimpl`` (``pluggy.HookimplMarker("europa")``);
it needs this package only, never europa-core. Pick-one hooks are ``firstresult``: the
first non-None answer wins, and two *enabled* plugins implementing the same one is
refused at start-up (built-in defaults are registered ``trylast`` and yield). Every
other hook is "all run": each enabled implementation is called. (No hook is
``historic``: plugins are all registered before the first call.)

Phases, in order (``PHASES``):

* declare: ``europa_config_sections``, ``europa_register_commands`` and
  ``europa_search_levers`` are asked of every installed plugin, enabled or not;
* plan: ``europa_plan``, for ``europa plan`` and ``europa train``'s pre-flight check, in
  the launcher, with a ``PlanningJob`` (no devices, no mesh, no run directory);
* then on each rank, with a ``RunningJob``: build (``europa_build_model``) → shard
  (``europa_shard_model``) → wrap (``europa_wrap_model``) → materialise
  (``europa_init_parameters``) → optimizer (``europa_build_optimizer``,
  ``europa_checkpoint_state``, ``europa_wrap_optimizer``) → every step
  (``europa_step_context`` around forward, backward, ``europa_clip_gradients`` and
  the optimizer step, then ``europa_scale_rows`` for QK-clip; then
  ``europa_after_step``) → teardown (``europa_teardown``,
  once, after the last step or after an error).

The wrap phase's order is part of the contract: activation checkpointing first
(``tryfirst``: it must see the bare blocks), then offload and other plain
implementations, then overlap's schedules last (``trylast``: they see the final module
tree).

Step numbering: a hook's ``step`` is the index of the step being taken, from 0; the
metrics record that step writes has ``"step": step + 1`` (``europa.spec.metrics``).

The layout that wins ``europa_shard_model`` decides where parameters live, so it also
answers the hooks that depend on that: ``europa_init_parameters``,
``europa_clip_gradients``, ``europa_scale_rows`` and ``europa_checkpoint_state``. Core's
defaults handle plain
tensors and DTensors (FSDP2); a layout with its own storage (europa-flexshard)
implements all four.

A plugin reports a user's mistake (a bad setting, an impossible layout) by raising an
exception whose class has ``europa_user_error = True`` (``europa.spec.errors.UserError``):
europa prints its message as one line and exits 2, as for its own errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch
    from torch.distributed.checkpoint.stateful import Stateful

    from europa.spec.init import InitMatrix
    from europa.spec.job import PlanningJob, RunningJob
    from europa.spec.plan_mapping import PlanMapping, SearchInputs

PROJECT = "europa"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("declare", ("europa_config_sections", "europa_register_commands", "europa_search_levers")),
    ("plan", ("europa_plan",)),
    ("build", ("europa_build_model",)),
    ("shard", ("europa_shard_model",)),
    ("wrap", ("europa_wrap_model",)),
    ("materialise", ("europa_init_parameters",)),
    ("optimizer", ("europa_build_optimizer", "europa_checkpoint_state", "europa_wrap_optimizer")),
    (
        "step",
        ("europa_step_context", "europa_clip_gradients", "europa_scale_rows", "europa_after_step"),
    ),
    ("teardown", ("europa_teardown",)),
)

# --------------------------------------------------------------------------------------
# declare: asked of every installed plugin, enabled or not
# --------------------------------------------------------------------------------------


@hookspec
def europa_config_sections() -> dict[str, type] | None:
    """Declare this plugin's TOML tables.

    Each table is a plain ``@dataclass``; each field is a key, typed by its annotation
    (bool, int, float, str or a list of one of them), with its default. Bounds and docs
    go in ``dataclasses.field(metadata={...})`` as a plain dict with any of the keys
    ``doc``, ``ge``, ``gt``, ``le``, ``choices``, so a plugin needs only the standard
    library.

    :returns: ``{"table": SomeDataclass}``, or None for no table.

    All run. The manager asks each plugin separately, so it records which plugin owns
    which table; a table set for a plugin that is not enabled is refused. Installed
    plugins are all asked, enabled or not, so ``europa config show`` knows every table.
    """


@hookspec
def europa_register_commands(app: Any) -> None:
    """Add sub-commands to the ``europa`` command.

    :param app: The ``europa`` typer application; add commands with ``@app.command()``.

    All run, for every installed plugin, enabled or not.
    """


@hookspec
def europa_search_levers(
    config: Any, world_size: int, ranks_per_node: int, plan: SearchInputs
) -> list[list[dict[str, Any]]] | None:
    """The layout levers this plugin offers ``europa plan --search``.

    :param config: The user's resolved config; leave alone what it fixes that changes
        the model.
    :param world_size: The ranks of the searched run.
    :param ranks_per_node: The ranks each node holds.
    :param plan: The model and machine every layout is planned for
        (``europa.spec.plan_mapping.SearchInputs``), for a plugin to leave out
        alternatives that cannot fit.
    :returns: A list of levers, or None for none. A lever is a list of alternatives, one
        of which each searched layout takes; an alternative is ``{"plugins": [names to
        enable], "set": {"table.key": value}}`` (plain Python values, as a TOML ``--set``
        would give). Say "without this plugin" as an alternative with no plugins.

    All run, for every installed plugin, enabled or not. Core plans the product of every
    plugin's levers and its own; a combination that the config rules or a plugin refuse
    is skipped, not reported.
    """


# --------------------------------------------------------------------------------------
# plan: in the launcher (europa plan, europa train's pre-flight check), no devices
# --------------------------------------------------------------------------------------


@hookspec
def europa_plan(job: PlanningJob, plan: PlanMapping) -> None:
    """State what this plugin changes in the analytic plan, so ``europa plan`` and
    ``europa train``'s pre-flight check compose plugins as ``europa train`` does.

    :param job: The job being planned: config and rank counts, no devices.
    :param plan: The mapping to change in place (``europa.spec.plan_mapping.PlanMapping``).
        Core fills in ``world_size``, ``parameter_shapes``, ``parameter_itemsize``,
        ``hardware`` (when planning for a machine) and ``layout`` (core's FSDP2), then
        reads back ``layout`` (checked by ``europa.spec.plan_layout.Layout.parse``),
        ``host_offload`` (``europa.spec.offload.HostOffload``), ``overlapped_kinds`` and
        ``reshard_after_forward``. Any other key a plugin adds (its own name, by
        convention) is reported as is.

    All run. ``europa import-hf`` reads the same layout for the bytes each rank would read.
    """


# --------------------------------------------------------------------------------------
# build: on each rank from here on (and while planning, for the shapes)
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def europa_build_model(job: PlanningJob) -> torch.nn.Module | None:
    """Build the model on the meta device; core's MoE is the default.

    Stops at first non-None result.

    :param job: The job; also called while planning (for the parameter shapes), so an
        implementation may rely on a ``PlanningJob`` only.
    :returns: The model, its parameters on the meta device.

    Parameters must not be allocated here: sharding comes first, then the layout
    allocates them and core initialises every matrix (see ``europa_init_parameters``)
    from torchtitan's ``param_init`` of its module or, for a module without one, from its
    ``reset_parameters()``.
    """


# --------------------------------------------------------------------------------------
# shard
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def europa_shard_model(job: RunningJob, model: torch.nn.Module) -> torch.nn.Module | None:
    """Lay the model out across the data-parallel mesh.

    Stops at first non-None result: exactly one layout wins, FlexShard when enabled,
    else core's FSDP2.

    :param job: The rank's job; the layout records the parameters it owns in
        ``job.claims`` (``job.claim(owner, names)``), so two plugins claiming the same
        parameter fail with an error naming both.
    :param model: The model on the meta device.
    :returns: The (possibly new) root module.
    """


# --------------------------------------------------------------------------------------
# wrap
# --------------------------------------------------------------------------------------


@hookspec
def europa_wrap_model(job: RunningJob, model: torch.nn.Module) -> None:
    """Wrap submodules in place.

    :param job: The rank's job.
    :param model: The root module ``europa_shard_model`` returned, still on the meta
        device.

    All run, in a stated order: activation checkpointing (``tryfirst``), then offload
    and other plain implementations, then overlap schedules (``trylast``), which see the
    final module tree.
    """


# --------------------------------------------------------------------------------------
# materialise
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def europa_init_parameters(
    job: RunningJob, model: torch.nn.Module, init_matrix: InitMatrix
) -> bool | None:
    """Allocate this rank's parameters on ``job.device`` and fill them. Called after wrap.

    Stops at first non-None result.

    :param job: The rank's job.
    :param model: The wrapped model, parameters still on the meta device.
    :param init_matrix: ``init_matrix(name, index, out)`` fills the tensor ``out`` with
        matrix ``index`` of parameter ``name`` (the expert index of a stacked
        ``[E, rows, cols]`` tensor, 0 for any other tensor), with the same numbers for
        every layout and world size; call it for each matrix this rank holds. It may
        also be a ``europa.spec.init.RegionInitMatrix``, with ``fill_region(name, index,
        out, region)`` filling ``out`` with ``region`` (a tuple of slices) of that
        matrix: a layout holding only part of a matrix should call it when present.
        With ``model.init_from = "hf:DIR"`` it reads the checkpoint, so a layout that
        asks for just what it holds reads just that from disk.
    :returns: True once this rank's parameters are allocated and filled: the non-None
        answer that stops the call, so core's default (registered ``trylast``) does not
        allocate them a second time. None leaves them to the next implementation.

    Core's default handles plain and DTensor parameters; buffers are core's and are
    filled afterwards.
    """


# --------------------------------------------------------------------------------------
# optimizer
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def europa_build_optimizer(job: RunningJob, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    """Build the optimizer for the materialised, sharded model.

    Stops at first non-None result.

    :param job: The rank's job; ``job.config.section("optimizer")`` holds ``[optimizer]``.
    :param model: The materialised model.
    :returns: The optimizer. Core's default reads ``[optimizer]``: AdamW, or Muon on 2-D
        matrices with AdamW on the rest.
    """


@hookspec(firstresult=True)
def europa_checkpoint_state(
    job: RunningJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Stateful | None:
    """The model and optimizer state that checkpoints hold.

    Stops at first non-None result.

    :param job: The rank's job.
    :param model: The materialised model.
    :param optimizer: The optimizer ``europa_build_optimizer`` returned (not a wrapper of
        it).
    :returns: A ``Stateful`` (torch.distributed.checkpoint's protocol): ``state_dict()``,
        giving ``{"model": {...}, "optim": {...}}`` for DCP (tensors as DTensors,
        ShardedTensors, or plain tensors equal on every rank; model tensors keyed by
        parameter name with their full shape), and ``load_state_dict(state)``, which
        takes that mapping back after DCP has filled it in place.

    Core's default uses torch's ``get_state_dict``/``set_state_dict``.
    """


@hookspec
def europa_wrap_optimizer(job: RunningJob) -> None:
    """Wrap the built optimizer, after ``europa_build_optimizer``.

    :param job: The rank's job: ``job.optimizer`` holds the optimizer; an implementation
        may replace it with a wrapper that delegates to it (europa-offload keeps its
        state in host memory).

    All run, in hook order. Core steps ``job.optimizer``; checkpoints and the schedule
    use the built one.
    """


# --------------------------------------------------------------------------------------
# step: every training step
# --------------------------------------------------------------------------------------


@hookspec
def europa_step_context(job: RunningJob, step: int) -> AbstractContextManager[Any] | None:
    """A context manager to hold around one training step.

    :param job: The rank's job.
    :param step: The index of the step being taken, from 0.
    :returns: A context manager, or None for none.

    All run: every returned manager is entered, in hook order, around forward, backward
    and the optimizer step of ``step``; exits run in reverse order.
    """


@hookspec(firstresult=True)
def europa_clip_gradients(job: RunningJob, model: torch.nn.Module, max_norm: float) -> float | None:
    """Clip all gradients to a total 2-norm of ``max_norm``.

    Stops at first non-None result.

    :param job: The rank's job.
    :param model: The model whose gradients backward has just filled.
    :param max_norm: The total norm to clip to; 0 only measures.
    :returns: The total norm before clipping, the same on every rank: the norm of the
        whole model's gradient, each parameter counted once however it is laid out.

    Core's default handles plain and DTensor parameters.
    """


@hookspec(firstresult=True)
def europa_scale_rows(
    job: RunningJob, model: torch.nn.Module, factors: dict[str, torch.Tensor]
) -> int | None:
    """Scale rows of parameters in place, after the optimizer step (QK-clip,
    ``europa.spec.qk_clip``).

    Stops at first non-None result.

    :param job: The rank's job.
    :param model: The model the optimizer has just stepped.
    :param factors: ``{parameter name: float64 factor of each of its global rows}``, the
        same on every rank. Scale the rows this rank holds with
        ``europa.spec.qk_clip.scale_rows_``, which leaves the rows whose factor is 1
        untouched.
    :returns: The rows this rank scaled.

    Core's default handles plain and DTensor parameters.
    """


@hookspec
def europa_after_step(job: RunningJob, step: int, metrics: dict[str, Any]) -> None:
    """Called on every rank after the optimizer step.

    :param job: The rank's job.
    :param step: The index of the step just taken, from 0 (its record's ``"step"`` is
        ``step + 1``).
    :param metrics: The record about to be written to ``metrics.jsonl``; a plugin may
        add keys of its own (prefix them with its name).

    All run.
    """


# --------------------------------------------------------------------------------------
# teardown: once per rank, after the last step or after an error
# --------------------------------------------------------------------------------------


@hookspec
def europa_teardown(job: RunningJob, error: BaseException | None) -> None:
    """Undo what this plugin installed process-wide, once per rank at the end of a run.

    :param job: The rank's job.
    :param error: The exception that ended the run, or None: it ended well.

    All run: every implementation runs even if one raises; the first error is re-raised
    after all have run. It must not depend on the step that failed having finished.
    """


__all__ = [
    "PHASES",
    "PROJECT",
    "europa_after_step",
    "europa_build_model",
    "europa_build_optimizer",
    "europa_checkpoint_state",
    "europa_clip_gradients",
    "europa_config_sections",
    "europa_init_parameters",
    "europa_plan",
    "europa_register_commands",
    "europa_scale_rows",
    "europa_search_levers",
    "europa_shard_model",
    "europa_step_context",
    "europa_teardown",
    "europa_wrap_model",
    "europa_wrap_optimizer",
    "hookimpl",
    "hookspec",
]
