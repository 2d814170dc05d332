"""Loading, listing and switching on plugins.

Built-in defaults (model, FSDP2 sharding, optimizer, activation checkpointing)
are always registered and implement pick-one hooks ``trylast``, so an enabled
technique plugin takes over their role. Plugins from the ``europa`` entry-point
group are loaded at start-up (minus those named in ``EUROPA_DISABLE_PLUGINS``)
so that ``europa plugins`` can list them and their config tables are known,
but their hooks only run once switched on through ``plugins.enabled`` / ``-p``.
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

from europa.core import hookspecs
from europa.core.config.fields import ConfigSection
from europa.core.config.loader import CORE_OWNER
from europa.core.config.schema import CORE_SECTIONS
from europa.core.errors import PluginError

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


def _pick_one_hooks() -> list[str]:
    return [
        name
        for name in dir(hookspecs)
        if name.startswith("europa_")
        and getattr(getattr(hookspecs, name), "europa_spec", {}).get("firstresult")
    ]


def _hook_names(plugin: object) -> tuple[str, ...]:
    return tuple(
        sorted(n for n in dir(plugin) if n.startswith("europa_") and callable(getattr(plugin, n)))
    )


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
        self._enabled: set[str] = set()
        for name, module_path in _BUILTIN_MODULES:
            module = importlib.import_module(module_path)
            self._pm.register(module, name=name)
            self._builtin[name] = module
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
        # Validated against the specs above; silent until enable() switches them on.
        for plugin, _, _ in self._external.values():
            self._pm.unregister(plugin)

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
            self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as err:
            raise self._invalid(name, dist, err) from None
        self._external[name] = (plugin, dist, version)

    @staticmethod
    def _invalid(name: str, dist: str, err: pluggy.PluginValidationError) -> PluginError:
        return PluginError(
            f"plugin {name!r} from {dist} does not match the europa hook specs ({err}); "
            f"expected hooks as in europa.core.hookspecs (set {DISABLE_ENV}={name} to skip it)"
        )

    # -- enabling -----------------------------------------------------------------------

    def enable(self, names: Iterable[str]) -> None:
        """Switch on these technique plugins; block every other external one."""
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
        for name, (plugin, _, _) in self._external.items():
            registered = self._pm.is_registered(plugin)
            if name not in names and registered:
                self._pm.unregister(plugin)
            elif name in names and not registered:  # switched off by an earlier enable()
                self._pm.register(plugin, name=name)
        self._enabled = set(names)

    def _check_roles(self, names: Sequence[str]) -> None:
        for hook_name in _pick_one_hooks():
            providers = [n for n in names if hasattr(self._external[n][0], hook_name)]
            if len(providers) > 1:
                first, second = providers[:2]
                raise PluginError(
                    f"plugins.enabled = {list(names)!r}: {first} ({self._external[first][1]}) "
                    f"and {second} ({self._external[second][1]}) both implement {hook_name}; "
                    "expected one plugin per pick-one role"
                )

    # -- queries ------------------------------------------------------------------------

    @property
    def hook(self) -> Any:
        return self._pm.hook

    def config_sections(self) -> list[ConfigSection]:
        """Core tables, then each registered plugin's, tagged with the plugin's owner."""
        sections = list(CORE_SECTIONS)
        seen = {s.name: CORE_OWNER for s in sections}
        declarers = [(CORE_OWNER, module) for module in self._builtin.values()]
        declarers += [(name, plugin) for name, (plugin, _, _) in self._external.items()]
        for owner, plugin in declarers:
            declare = getattr(plugin, "europa_config_sections", None)
            for section in (declare() if declare else None) or []:
                if section.name in seen:
                    raise PluginError(
                        f"[{section.name}] is declared by both {seen[section.name]} and "
                        f"{owner}: expected each config table to have one owner"
                    )
                seen[section.name] = owner
                sections.append(dataclasses.replace(section, owner=owner))
        return sections

    def builtin_owners(self) -> set[str]:
        return {CORE_OWNER}

    def plugins(self) -> list[PluginInfo]:
        from europa.core import __version__

        infos = [
            PluginInfo(name, "europa-core", __version__, _hook_names(module), True, True)
            for name, module in self._builtin.items()
        ]
        infos += [
            PluginInfo(name, dist, version, _hook_names(plugin), False, name in self._enabled)
            for name, (plugin, dist, version) in sorted(self._external.items())
        ]
        return infos
