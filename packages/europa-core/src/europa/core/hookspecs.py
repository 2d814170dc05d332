"""The europa hook specification, grouped by the phase of a run in which each hook is called.

A plugin implements any of these with ``pluggy.HookimplMarker("europa")``; it
never needs to import europa-core. Pick-one hooks are ``firstresult``: the first
non-None answer wins, and two *enabled* plugins implementing the same one is
refused at start-up (built-in defaults are registered ``trylast`` and yield).
Every other hook is "all run": each enabled implementation is called. (No
hook is ``historic``: plugins are all registered before the first call.)

Order within a run: config → build → shard → wrap → (materialise) →
optimizer → step ... → after_step; plan runs instead of build..step for
``europa plan``; cli runs when the command line is assembled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

    from europa.core.config.fields import ConfigSection
    from europa.core.job import Job

hookspec = pluggy.HookspecMarker("europa")
hookimpl = pluggy.HookimplMarker("europa")

# --------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------


@hookspec
def europa_config_sections() -> list[ConfigSection]:
    """Declare this plugin's TOML tables (all run).

    Return ``ConfigSection(name, dataclass)`` items; every field of the
    dataclass is a key with a typed default (declare fields with
    ``europa.core.config.setting`` for bounds and choices, or plain defaults).
    The manager asks each plugin separately, so it records which plugin owns
    which table; a table set for a plugin that is not enabled is refused.
    Installed plugins are all asked, enabled or not, so ``europa config show``
    knows every table.
    """


# --------------------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def europa_build_model(job: Job) -> torch.nn.Module | None:
    """Build the model on the meta device (firstresult; core's MoE is the default).

    Parameters must not be allocated here: sharding comes first, then the core
    materialises and initialises them with ``model.init_states()`` or
    ``reset_parameters()``.
    """


# --------------------------------------------------------------------------------------
# shard
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def europa_shard_model(job: Job, model: torch.nn.Module) -> torch.nn.Module | None:
    """Lay the model out across the data-parallel mesh (firstresult).

    Exactly one layout wins: FlexShard when enabled, else core's FSDP2. Return
    the (possibly new) root module. The layout records the parameters it owns
    in ``job.claims`` (``job.claim(owner, names)``), so two plugins claiming the
    same parameter fail with an error naming both.
    """


# --------------------------------------------------------------------------------------
# wrap
# --------------------------------------------------------------------------------------


@hookspec
def europa_wrap_model(job: Job, model: torch.nn.Module) -> None:
    """Wrap submodules in place (all implementations run).

    Stated order: activation checkpointing (``tryfirst``), then offload and
    other plain implementations, then overlap schedules (``trylast``), which
    see the final module tree.
    """


# --------------------------------------------------------------------------------------
# optimizer
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def europa_build_optimizer(job: Job, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    """Build the optimizer for the materialised, sharded model (firstresult).

    Core's default reads ``[optimizer]``: AdamW, or Muon on 2-D matrices with
    AdamW on the rest.
    """


# --------------------------------------------------------------------------------------
# step
# --------------------------------------------------------------------------------------


@hookspec
def europa_step_context(job: Job, step: int) -> AbstractContextManager[Any] | None:
    """A context manager to hold around one training step (all run).

    Every returned manager is entered, in hook order, around forward, backward
    and the optimizer step of ``step``; exits run in reverse order.
    """


@hookspec
def europa_after_step(job: Job, step: int, metrics: dict[str, Any]) -> None:
    """Called on every rank after the optimizer step (all run).

    ``metrics`` is the record about to be written to ``metrics.jsonl``; a
    plugin may add keys of its own (prefix them with its name).
    """


# --------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------


@hookspec
def europa_plan(job: Job, plan: dict[str, Any]) -> None:
    """State what this plugin changes in the analytic memory and communication
    plan (all run), so ``europa plan`` composes plugins as ``europa train`` does.
    ``plan`` is a mutable mapping of named memory and traffic terms."""


# --------------------------------------------------------------------------------------
# cli
# --------------------------------------------------------------------------------------


@hookspec
def europa_register_commands(app: Any) -> None:
    """Add sub-commands to the ``europa`` typer application (all run)."""
