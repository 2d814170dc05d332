"""Loading, listing and switching on plugins.

Built-in defaults (model, FSDP2 sharding, optimizer, activation checkpointing)
are always registered and implement pick-one hooks ``trylast``, so an enabled
technique plugin takes over their role. Plugins from the ``europa`` entry-point
group are loaded and registered with pluggy at start-up, all of them:

* ``all_hooks`` (pluggy's own ``pm.hook``) reaches every installed plugin; it
  serves declarations, which must not depend on what a run enables: config
  tables (``europa config show`` knows every table) and CLI commands.
* ``hook`` reaches the built-ins and the *enabled* plugins only (pluggy's
  ``subset_hook_caller``); it is what a run calls.
* Names in ``EUROPA_DISABLE_PLUGINS`` are never imported and are blocked in
  pluggy (``set_blocked``), so nothing can register them later.

Every call goes through pluggy's hook callers, never through attributes of a
plugin module, so ``tryfirst``/``trylast``, ``specname`` and wrappers hold.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from europa.core.config.declared import declared_sections
from europa.core.config.fields import ConfigSection
from europa.core.config.loader import CORE_OWNER
from europa.core.config.schema import CORE_SECTIONS
from europa.core.errors import PluginError
from europa.spec import hookspecs

ENTRY_POINT_GROUP = "europa"
DISABLE_ENV = "EUROPA_DISABLE_PLUGINS"

_BUILTIN_MODULES = (
    ("core.model", "europa.core.plugins.builtin.model"),
    ("core.fsdp2", "europa.core.plugins.builtin.fsdp"),
    ("core.optimizer", "europa.core.plugins.builtin.optimizer"),
    ("core.activation_checkpointing", "europa.core.plugins.builtin.activation_checkpointing"),
)


@dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]
    builtin: bool
    enabled: bool

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"hooks": list(self.hooks)}


def disabled_by_env(environ: dict[str, str] | None = None) -> set[str]:
    """Names listed in EUROPA_DISABLE_PLUGINS (comma separated); ``*`` means all."""
    raw = (environ if environ is not None else os.environ).get(DISABLE_ENV, "")
    return {name.strip() for name in raw.split(",") if name.strip()}


class _EnabledHooks:
    """``pm.hook`` minus the installed plugins that are not switched on."""

    def __init__(self, pm: pluggy.PluginManager, silenced: Sequence[object]) -> None:
        self._pm = pm
        self._silenced = list(silenced)
        self._callers: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        caller = self._callers.get(name)
        if caller is None:
            if not hasattr(self._pm.hook, name):
                raise AttributeError(f"no europa hook named {name!r}")
            caller = self._pm.subset_hook_caller(name, remove_plugins=self._silenced)
            self._callers[name] = caller
        return caller


class EuropaPluginManager:
    """Owns the pluggy manager. ``hook`` is what the trainer calls."""

    def __init__(
        self,
        *,
        load_entry_points: bool = True,
        extra_plugins: Sequence[tuple[str, object, str, str]] = (),
        environ: dict[str, str] | None = None,
    ) -> None:
        self._pm = pluggy.PluginManager("europa")
        self._pm.add_hookspecs(hookspecs)
        self._disabled = disabled_by_env(environ)
        self._external: dict[str, tuple[object, str, str]] = {}
        self._builtin: dict[str, object] = {}
        self._enabled: tuple[str, ...] = ()
        # What the registered plugins declare, worked out once per set of registrations
        # (a layout search opens a session for each of thousands of combinations).
        self._sections: tuple[tuple, list[ConfigSection]] = ((), [])
        self._roles_checked: set[tuple] = set()
        for name, module_path in _BUILTIN_MODULES:
            module = importlib.import_module(module_path)
            self._pm.register(module, name=name)
            self._builtin[name] = module
        for name in self._disabled - {"*"} - self._builtin.keys():
            self._pm.set_blocked(name)
        if load_entry_points and "*" not in self._disabled:
            for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
                if entry_point.name not in self._disabled:
                    self._load_entry_point(entry_point)
        for name, plugin, dist, version in extra_plugins:
            self._add_external(name, plugin, dist, version)
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as err:
            name = self._pm.get_name(err.plugin) or repr(err.plugin)
            dist = self._external.get(name, (None, CORE_OWNER))[1]
            raise self._invalid(name, dist, err) from None
        self._hooks = self._hooks_for(())

    # -- loading ------------------------------------------------------------------------

    def _load_entry_point(self, entry_point: metadata.EntryPoint) -> None:
        dist = entry_point.dist
        dist_name = dist.name if dist is not None else "unknown"
        version = dist.version if dist is not None else "unknown"
        try:
            plugin = entry_point.load()
        except Exception as err:
            raise PluginError(
                f"plugin {entry_point.name!r} from {dist_name} failed to load "
                f"({type(err).__name__}: {err}); expected an importable module "
                f"(set {DISABLE_ENV}={entry_point.name} to skip it)"
            ) from None
        self._add_external(entry_point.name, plugin, dist_name, version)

    def _add_external(self, name: str, plugin: object, dist: str, version: str) -> None:
        if name in self._external or name in self._builtin:
            other = self._external.get(name, (None, CORE_OWNER, ""))[1]
            raise PluginError(
                f"plugin name {name!r} is registered by both {other} and {dist}: "
                "expected unique plugin names"
            )
        try:
            registered = self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as err:
            raise self._invalid(name, dist, err) from None
        if registered is not None:  # None: blocked by EUROPA_DISABLE_PLUGINS
            self._external[name] = (plugin, dist, version)

    @staticmethod
    def _invalid(name: str, dist: str, err: pluggy.PluginValidationError) -> PluginError:
        return PluginError(
            f"plugin {name!r} from {dist} does not match the europa hook specs ({err}); "
            f"expected hooks as in europa.spec.hookspecs (set {DISABLE_ENV}={name} to skip it)"
        )

    # -- enabling -----------------------------------------------------------------------

    def _hooks_for(self, enabled: Sequence[str]) -> _EnabledHooks:
        silenced = [p for name, (p, _, _) in self._external.items() if name not in enabled]
        return _EnabledHooks(self._pm, silenced)

    def enable(self, names: Iterable[str]) -> None:
        """Switch on these technique plugins; silence every other installed one."""
        names = list(dict.fromkeys(names))
        for name in names:
            if name in self._disabled or ("*" in self._disabled and name not in self._builtin):
                raise PluginError(
                    f"plugins.enabled = {names!r}: {name!r} is disabled by {DISABLE_ENV}; "
                    "expected it removed from that variable"
                )
            if name not in self._external:
                installed = ", ".join(sorted(self._external)) or "none installed"
                raise PluginError(
                    f"plugins.enabled = {names!r}: {name!r} is not an installed plugin; "
                    f"expected one of: {installed}"
                )
        self._check_roles(names)
        self._enabled = tuple(names)
        self._hooks = self._hooks_for(names)

    def _implemented(self, plugin: object) -> set[str]:
        return {caller.name for caller in self._pm.get_hookcallers(plugin) or ()}

    def _pick_one_hooks(self) -> list[str]:
        return [
            name
            for name, caller in vars(self._pm.hook).items()
            if caller.spec is not None and caller.spec.opts.get("firstresult")
        ]

    def _registrations(self) -> tuple:
        return tuple((n, id(p)) for n, p in self._pm.list_name_plugin() if p is not None)

    def _check_roles(self, names: Sequence[str]) -> None:
        checked = (self._registrations(), tuple(names))
        if checked in self._roles_checked:
            return
        for hook_name in self._pick_one_hooks():
            providers = [n for n in names if hook_name in self._implemented(self._external[n][0])]
            if len(providers) > 1:
                first, second = providers[:2]
                raise PluginError(
                    f"plugins.enabled = {list(names)!r}: {first} ({self._external[first][1]}) "
                    f"and {second} ({self._external[second][1]}) both implement {hook_name}; "
                    "expected one plugin per pick-one role"
                )
        self._roles_checked.add(checked)

    # -- queries ------------------------------------------------------------------------

    @property
    def hook(self) -> Any:
        """The built-ins and the enabled plugins: what a run calls."""
        return self._hooks

    @property
    def all_hooks(self) -> Any:
        """Every installed plugin, enabled or not: for declarations (tables, commands)."""
        return self._pm.hook

    def config_sections(self) -> list[ConfigSection]:
        """Core tables, then each registered plugin's, tagged with the plugin's owner."""
        registrations = self._registrations()
        if self._sections[0] != registrations:
            self._sections = (registrations, self._declared_sections())
        return list(self._sections[1])

    def _declared_sections(self) -> list[ConfigSection]:
        sections = list(CORE_SECTIONS)
        seen = {s.name: CORE_OWNER for s in sections}
        registered = [(n, p) for n, p in self._pm.list_name_plugin() if p is not None]
        for name, plugin in registered:
            owner = CORE_OWNER if name in self._builtin else name
            others = [p for _, p in registered if p is not plugin]
            ask = self._pm.subset_hook_caller("europa_config_sections", remove_plugins=others)
            for answer in ask():
                for section in declared_sections(owner, answer):
                    if section.name in seen:
                        raise PluginError(
                            f"[{section.name}] is declared by both {seen[section.name]} and "
                            f"{owner}: expected each config table to have one owner"
                        )
                    seen[section.name] = owner
                    sections.append(section)
        return sections

    def teardown(self, job: Any, error: BaseException | None) -> BaseException | None:
        """Call every enabled ``europa_teardown``, each even if another raises (pluggy
        would stop at the first); return the first exception one raised, if any."""
        first = None
        for impl in reversed(self.hook.europa_teardown.get_hookimpls()):
            given = {"job": job, "error": error}
            try:
                impl.function(*(given[name] for name in impl.argnames))
            except Exception as err:
                first = first or err
        return first

    def plugins(self) -> list[PluginInfo]:
        from europa.core import __version__

        def hooks(plugin: object) -> tuple[str, ...]:
            return tuple(sorted(self._implemented(plugin)))

        infos = [
            PluginInfo(name, "europa-core", __version__, hooks(module), True, True)
            for name, module in self._builtin.items()
        ]
        infos += [
            PluginInfo(name, dist, version, hooks(plugin), False, name in self._enabled)
            for name, (plugin, dist, version) in sorted(self._external.items())
        ]
        return infos
