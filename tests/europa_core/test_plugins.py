"""The plugin registry, through real entry points of fake installed distributions.

Each test writes ``<dist>-<version>.dist-info`` folders and plain plugin modules
into its own tmp folder and puts that folder on ``sys.path``, where
``importlib.metadata`` finds them exactly as it finds pip-installed packages.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pluggy
import pytest
import torch

from europa.core.config import config_to_toml
from europa.core.errors import ConfigError, PluginError
from europa.core.job import Job
from europa.core.plugins import DISABLE_ENV, EuropaPluginManager, PluginInfo
from europa.core.plugins.manager import _BUILTIN_MODULES
from europa.core.session import open_session
from europa.spec import hookspecs

HEADER = 'import pluggy\n\nhookimpl = pluggy.HookimplMarker("europa")\n'

AFTER_STEP = """
@hookimpl
def europa_after_step(job, step, metrics):
    metrics["{name}_seen"] = step
"""

SHARD = """
@hookimpl
def europa_shard_model(job, model):
    return "{name}-layout"
"""

BUILD = """
@hookimpl
def europa_build_model(job):
    return "{name}-model"
"""

# A table declared with the standard library alone: the plugin imports no europa code.
GAMMA_TABLE = """
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class GammaConfig:
    depth: int = field(default=2, metadata={{"ge": 1, "doc": "how deep"}})
    mode: str = field(default="fast", metadata={{"choices": ("fast", "slow")}})
    ratio: float = field(default=0.5, metadata={{"ge": 0, "le": 1}})
    tags: list[str] = field(default_factory=list)


@hookimpl
def europa_config_sections():
    return {{"{table}": GammaConfig}}
"""

Installer = Callable[..., None]


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Installer]:
    """``install(dist, {plugin_name: source}, version=...)``: a fake installed distribution
    whose ``europa`` entry points are plain modules written beside it."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    token = uuid.uuid4().hex[:8]
    modules: list[str] = []

    def _install(dist: str, plugins: dict[str, str], version: str = "0.1.0") -> None:
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = ["[europa]"]
        for name, body in plugins.items():
            module = f"europa_fake_{token}_" + re.sub(r"\W", "_", name)
            (site / f"{module}.py").write_text(HEADER + textwrap.dedent(body))
            lines.append(f"{name} = {module}")
            modules.append(module)
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        importlib.invalidate_caches()

    yield _install
    for module in modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


def _external(pm: EuropaPluginManager) -> dict[str, PluginInfo]:
    return {info.name: info for info in pm.plugins() if not info.builtin}


def _after_step(pm: EuropaPluginManager) -> dict[str, object]:
    metrics: dict[str, object] = {}
    pm.hook.europa_after_step(job=None, step=7, metrics=metrics)
    return metrics


# -- listing and enabling --------------------------------------------------------------


def test_installed_plugin_is_listed_with_distribution_version_and_hooks(install):
    install("europa-alpha", {"alpha": AFTER_STEP.format(name="alpha")}, version="1.2.3")
    pm = EuropaPluginManager()
    assert _external(pm)["alpha"] == PluginInfo(
        name="alpha",
        distribution="europa-alpha",
        version="1.2.3",
        hooks=("europa_after_step",),
        builtin=False,
        enabled=False,
    )
    pm.enable(["alpha"])
    assert _external(pm)["alpha"].enabled is True
    assert _external(pm)["alpha"].as_dict()["hooks"] == ["europa_after_step"]


def test_builtins_are_listed_first_and_always_enabled():
    pm = EuropaPluginManager(load_entry_points=False)
    infos = pm.plugins()
    assert [i.name for i in infos] == [name for name, _ in _BUILTIN_MODULES]
    assert all(i.builtin and i.enabled and i.distribution == "europa-core" for i in infos)
    hooks = {i.name: i.hooks for i in infos}
    assert hooks["core.model"] == ("europa_build_model",)
    assert hooks["core.fsdp2"] == (
        "europa_checkpoint_state",
        "europa_clip_gradients",
        "europa_init_parameters",
        "europa_scale_rows",
        "europa_shard_model",
    )
    assert hooks["core.optimizer"] == ("europa_build_optimizer",)
    assert hooks["core.activation_checkpointing"] == (
        "europa_config_sections",
        "europa_wrap_model",
    )


def test_only_enabled_plugins_hooks_run(install):
    install("europa-alpha", {"alpha": AFTER_STEP.format(name="alpha")})
    install("europa-beta", {"beta": AFTER_STEP.format(name="beta")})
    pm = EuropaPluginManager()
    pm.enable(["alpha"])
    assert _after_step(pm) == {"alpha_seen": 7}


def test_installed_plugins_stay_silent_until_enabled(install):
    install("europa-alpha", {"alpha": AFTER_STEP.format(name="alpha")})
    pm = EuropaPluginManager()
    assert _after_step(pm) == {}


def test_every_installed_table_is_known_after_enabling_a_subset(install):
    install("europa-gamma", {"gamma": GAMMA_TABLE.format(table="gamma")})
    install("europa-alpha", {"alpha": AFTER_STEP.format(name="alpha")})
    pm = EuropaPluginManager()
    pm.enable(["alpha"])
    assert "gamma" in {section.name for section in pm.config_sections()}


def test_enable_again_switches_the_set_of_running_plugins(install):
    install("europa-alpha", {"alpha": AFTER_STEP.format(name="alpha")})
    install("europa-beta", {"beta": AFTER_STEP.format(name="beta")})
    pm = EuropaPluginManager()
    pm.enable([])
    assert _after_step(pm) == {}
    pm.enable(["alpha"])
    assert _after_step(pm) == {"alpha_seen": 7}
    pm.enable(["beta"])
    assert _after_step(pm) == {"beta_seen": 7}
    enabled = {n: i.enabled for n, i in _external(pm).items() if n in ("alpha", "beta")}
    assert enabled == {"alpha": False, "beta": True}


def test_two_enabled_pick_one_plugins_name_both_distributions(install):
    install("europa-left", {"left": SHARD.format(name="left")})
    install("europa-right", {"right": SHARD.format(name="right")})
    pm = EuropaPluginManager()
    with pytest.raises(PluginError) as err:
        pm.enable(["left", "right"])
    assert str(err.value) == (
        "plugins.enabled = ['left', 'right']: left (europa-left) and right (europa-right) "
        "both implement europa_shard_model; expected one plugin per pick-one role"
    )
    pm.enable(["right"])  # one of them alone is fine, and it wins over core's FSDP2
    assert pm.hook.europa_shard_model(job=None, model=None) == "right-layout"


def test_enabling_an_unknown_plugin_lists_the_installed_ones(install):
    install("europa-alpha", {"alpha": AFTER_STEP.format(name="alpha")})
    install("europa-beta", {"beta": AFTER_STEP.format(name="beta")})
    pm = EuropaPluginManager()
    installed = sorted(_external(pm))
    assert {"alpha", "beta"} <= set(installed)
    with pytest.raises(PluginError) as err:
        pm.enable(["alpha", "gamma"])
    assert str(err.value) == (
        "plugins.enabled = ['alpha', 'gamma']: 'gamma' is not an installed plugin; "
        f"expected one of: {', '.join(installed)}"
    )


def test_enabling_a_builtin_by_name_is_refused():
    pm = EuropaPluginManager(load_entry_points=False)
    with pytest.raises(PluginError, match=r"'core\.fsdp2' is not an installed plugin"):
        pm.enable(["core.fsdp2"])


def test_plugin_name_registered_by_two_distributions(install):
    install("europa-one", {"twin": AFTER_STEP.format(name="one")})
    install("europa-two", {"twin": AFTER_STEP.format(name="two")})
    with pytest.raises(PluginError) as err:
        EuropaPluginManager()
    message = str(err.value)
    assert message.startswith("plugin name 'twin' is registered by both europa-")
    assert "europa-one" in message and "europa-two" in message
    assert message.endswith(": expected unique plugin names")


def test_plugin_named_like_a_builtin_is_refused(install):
    install("europa-impostor", {"core.model": BUILD.format(name="impostor")})
    with pytest.raises(PluginError) as err:
        EuropaPluginManager()
    assert str(err.value) == (
        "plugin name 'core.model' is registered by both europa-core and europa-impostor: "
        "expected unique plugin names"
    )


# -- EUROPA_DISABLE_PLUGINS -------------------------------------------------------------


def test_disable_by_name_through_environ_argument(install):
    install("europa-alpha", {"alpha": AFTER_STEP.format(name="alpha")})
    install("europa-beta", {"beta": AFTER_STEP.format(name="beta")})
    pm = EuropaPluginManager(environ={DISABLE_ENV: " alpha , unrelated"})
    assert "alpha" not in _external(pm)
    assert "beta" in _external(pm)
    with pytest.raises(PluginError) as err:
        pm.enable(["alpha"])
    assert str(err.value) == (
        f"plugins.enabled = ['alpha']: 'alpha' is disabled by {DISABLE_ENV}; "
        "expected it removed from that variable"
    )


def test_disable_by_name_through_the_real_environment(install, monkeypatch):
    install("europa-alpha", {"alpha": AFTER_STEP.format(name="alpha")})
    install("europa-beta", {"beta": AFTER_STEP.format(name="beta")})
    monkeypatch.setenv(DISABLE_ENV, "beta")
    pm = EuropaPluginManager()
    assert "beta" not in _external(pm)
    with pytest.raises(PluginError, match=DISABLE_ENV):
        pm.enable(["beta"])
    pm.enable(["alpha"])
    assert _after_step(pm) == {"alpha_seen": 7}


def test_disable_star_skips_every_installed_plugin(install, monkeypatch):
    install("europa-alpha", {"alpha": AFTER_STEP.format(name="alpha")})
    install("europa-broken", {"broken": "raise RuntimeError('boom')\n"})
    assert _external(EuropaPluginManager(environ={DISABLE_ENV: "*"})) == {}
    monkeypatch.setenv(DISABLE_ENV, "*")
    pm = EuropaPluginManager()  # the broken plugin is never imported
    assert _external(pm) == {}
    assert len(pm.plugins()) == len(_BUILTIN_MODULES)
    with pytest.raises(PluginError, match=f"'alpha' is disabled by {DISABLE_ENV}"):
        pm.enable(["alpha"])


# -- broken plugins ---------------------------------------------------------------------


def test_plugin_that_fails_to_import_names_plugin_and_distribution(install):
    install("europa-broken", {"broken": "raise RuntimeError('boom')\n"})
    with pytest.raises(PluginError) as err:
        EuropaPluginManager()
    assert str(err.value) == (
        "plugin 'broken' from europa-broken failed to load (RuntimeError: boom); "
        f"expected an importable module (set {DISABLE_ENV}=broken to skip it)"
    )
    # ... and the way out the message names works.
    pm = EuropaPluginManager(environ={DISABLE_ENV: "broken"})
    assert "broken" not in _external(pm)


def test_plugin_with_misspelled_hook_is_a_plugin_error(install):
    body = "@hookimpl\ndef europa_after_stepp(job, step, metrics):\n    pass\n"
    install("europa-typo", {"typo": body})
    with pytest.raises(PluginError) as err:
        EuropaPluginManager()
    message = str(err.value)
    assert "'typo'" in message and "europa-typo" in message
    assert "europa_after_stepp" in message
    assert "\n" not in message


def test_plugin_with_wrong_hook_arguments_is_a_plugin_error(install):
    body = "@hookimpl\ndef europa_after_step(job, step, metrics, extra):\n    pass\n"
    install("europa-badargs", {"badargs": body})
    with pytest.raises(PluginError) as err:
        EuropaPluginManager()
    message = str(err.value)
    assert "'badargs'" in message and "europa-badargs" in message
    assert "extra" in message
    assert "\n" not in message


# -- config tables declared by plugins --------------------------------------------------


def test_plugin_table_is_validated_and_typed(install):
    install("europa-gamma", {"gamma": GAMMA_TABLE.format(table="gamma")})
    config, pm = open_session(None, plugins=["gamma"], manager=EuropaPluginManager())
    table = config.section("gamma")
    assert type(table).__name__ == "GammaConfig"
    assert (table.depth, table.mode, table.ratio) == (2, "fast", 0.5)
    assert config.plugins.enabled == ["gamma"]
    assert _external(pm)["gamma"].enabled

    config, _ = open_session(
        None, ["gamma.depth=4", "gamma.ratio=1"], ["gamma"], EuropaPluginManager()
    )
    assert config.section("gamma").depth == 4
    assert config.section("gamma").ratio == 1.0
    assert isinstance(config.section("gamma").ratio, float)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("gamma.depht=3", "gamma.depht = 3: unknown key; did you mean gamma.depth?"),
        ("gamma.depth=0", "gamma.depth = 0: expected an integer >= 1"),
        ("gamma.depth=1.5", "gamma.depth = 1.5: expected an integer >= 1"),
        ("gamma.mode=medium", 'gamma.mode = "medium": expected one of "fast", "slow"'),
        ("gamma.ratio=2", "gamma.ratio = 2: expected a finite number between 0 and 1"),
    ],
)
def test_plugin_table_errors(install, override, message):
    install("europa-gamma", {"gamma": GAMMA_TABLE.format(table="gamma")})
    with pytest.raises(ConfigError) as err:
        open_session(None, [override], ["gamma"], EuropaPluginManager())
    assert str(err.value) == message


def test_plugin_table_set_without_enabling_the_plugin(install, tmp_path):
    install("europa-gamma", {"gamma": GAMMA_TABLE.format(table="gamma")})
    expected = (
        '[gamma] is set but plugin "gamma" is not enabled: '
        "expected gamma in plugins.enabled (or -p gamma)"
    )
    with pytest.raises(ConfigError) as err:
        open_session(None, ["gamma.depth=3"], manager=EuropaPluginManager())
    assert str(err.value) == expected
    path = tmp_path / "run.toml"
    path.write_text("[gamma]\nmode = 'slow'\n")
    with pytest.raises(ConfigError) as err:
        open_session(path, manager=EuropaPluginManager())
    assert str(err.value) == expected
    path.write_text("[plugins]\nenabled = ['gamma']\n[gamma]\nmode = 'slow'\n")
    config, _ = open_session(path, manager=EuropaPluginManager())
    assert config.section("gamma").mode == "slow"


@pytest.mark.parametrize("enabled", [False, True])
def test_resolved_config_reloads_with_a_table_plugin_installed(install, tmp_path, enabled):
    """What ``europa config show`` prints (and a run directory stores) loads again,
    whether or not an installed plugin's table is switched on."""
    install("europa-gamma", {"gamma": GAMMA_TABLE.format(table="gamma")})
    plugins = ["gamma"] if enabled else []
    config, _ = open_session("debug", ["training.steps=3"], plugins, EuropaPluginManager())
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(config))
    again, _ = open_session(path, manager=EuropaPluginManager())
    assert again == config
    assert ("gamma" in config.extensions) is enabled
    assert "activation_checkpointing" in config.extensions


def test_two_plugins_declaring_the_same_table(install):
    install("europa-one", {"one": GAMMA_TABLE.format(table="shared")})
    install("europa-two", {"two": GAMMA_TABLE.format(table="shared")})
    pm = EuropaPluginManager()
    with pytest.raises(PluginError) as err:
        pm.config_sections()
    message = str(err.value)
    assert re.fullmatch(
        r"\[shared\] is declared by both (one and two|two and one): "
        r"expected each config table to have one owner",
        message,
    ), message


def test_plugin_declaring_a_core_table(install):
    install("europa-one", {"one": GAMMA_TABLE.format(table="model")})
    with pytest.raises(PluginError) as err:
        EuropaPluginManager().config_sections()
    assert str(err.value) == (
        "[model] is declared by both europa-core and one: "
        "expected each config table to have one owner"
    )


# -- pick-one hooks: enabled plugins beat the trylast built-ins ---------------------------


def test_enabled_build_model_wins_over_the_builtin(install):
    install("europa-delta", {"delta": BUILD.format(name="delta")})
    pm = EuropaPluginManager()
    config, _ = open_session(None, plugins=["delta"], manager=pm)
    job = Job(config=config, run_dir=Path("."))
    assert pm.hook.europa_build_model(job=job) == "delta-model"


def test_builtin_build_model_runs_when_the_plugin_is_not_enabled(install):
    install("europa-delta", {"delta": BUILD.format(name="delta")})
    config, pm = open_session(None, manager=EuropaPluginManager())
    model = pm.hook.europa_build_model(job=Job(config=config, run_dir=Path(".")))
    assert isinstance(model, torch.nn.Module)
    assert next(model.parameters()).device.type == "meta"


# -- Job.claim ----------------------------------------------------------------------------


def test_claiming_a_parameter_twice_names_both_owners():
    job = Job(config=None, run_dir=Path("."))
    job.claim("core.fsdp2", ["layers.0.w", "layers.1.w"])
    job.claim("core.fsdp2", iter(["layers.0.w"]))  # the same owner again is fine
    with pytest.raises(PluginError) as err:
        job.claim("flexshard", ["norm.w", "layers.1.w"])
    assert str(err.value) == (
        "parameter 'layers.1.w' is claimed by both core.fsdp2 and flexshard: "
        "expected exactly one sharding plugin per parameter"
    )


# -- the hook specification --------------------------------------------------------------


def _specs() -> dict[str, object]:
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if name.startswith("europa_") and hasattr(fn, "europa_spec")
    }


def test_every_hook_docstring_states_how_it_is_called():
    specs = _specs()
    assert set(specs) == {
        "europa_config_sections",
        "europa_build_model",
        "europa_shard_model",
        "europa_wrap_model",
        "europa_init_parameters",
        "europa_build_optimizer",
        "europa_wrap_optimizer",
        "europa_step_context",
        "europa_clip_gradients",
        "europa_scale_rows",
        "europa_after_step",
        "europa_checkpoint_state",
        "europa_plan",
        "europa_search_levers",
        "europa_register_commands",
        "europa_teardown",
    }
    for name, fn in specs.items():
        flags = fn.europa_spec
        doc = " ".join(inspect.getdoc(fn).split())
        assert not (flags["firstresult"] and flags["historic"]), name
        assert ("Stops at first non-None result" in doc) == flags["firstresult"], name
        assert ("historic" in doc) == flags["historic"], name
        all_run = re.search(r"\bAll run\b", doc) is not None  # the spec's words for it
        assert all_run == (not flags["firstresult"] and not flags["historic"]), name


def test_pick_one_hooks_are_the_firstresult_ones():
    firstresult = {n for n, fn in _specs().items() if fn.europa_spec["firstresult"]}
    assert firstresult == {
        "europa_build_model",
        "europa_shard_model",
        "europa_init_parameters",
        "europa_build_optimizer",
        "europa_clip_gradients",
        "europa_scale_rows",
        "europa_checkpoint_state",
    }
    # Declarations are read per plugin after every plugin is registered, so no
    # hook needs pluggy's historic replay.
    assert {n for n, fn in _specs().items() if fn.europa_spec["historic"]} == set()


def test_builtins_pass_check_pending_and_yield_pick_one_roles():
    pm = pluggy.PluginManager("europa")
    pm.add_hookspecs(hookspecs)
    for name, module_path in _BUILTIN_MODULES:
        pm.register(importlib.import_module(module_path), name=name)
    pm.check_pending()
    firstresult = [n for n, fn in _specs().items() if fn.europa_spec["firstresult"]]
    for hook_name in firstresult:
        impls = getattr(pm.hook, hook_name).get_hookimpls()
        assert [impl.trylast for impl in impls] == [True], hook_name
    EuropaPluginManager(load_entry_points=False)  # runs check_pending itself


# -- the plugin contract: pluggy and the standard library are enough ------------------------


def _europa_modules_seen_by(plugin: object) -> list[str]:
    return [
        value.__name__
        for value in vars(plugin).values()
        if inspect.ismodule(value) and value.__name__.startswith("europa")
    ]


def test_a_table_declaring_plugin_imports_no_europa_code(install):
    install("europa-gamma", {"gamma": GAMMA_TABLE.format(table="gamma")})
    pm = EuropaPluginManager()
    plugin = next(p for n, p in pm._pm.list_name_plugin() if n == "gamma")
    assert _europa_modules_seen_by(plugin) == []
    config, _ = open_session(None, ["gamma.tags=['a', 'b']"], ["gamma"], pm)
    assert config.section("gamma").tags == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "@hookimpl\ndef europa_config_sections():\n    return [1]\n",
            "plugin 'bad': europa_config_sections() returned list; "
            "expected a dict of name -> dataclass",
        ),
        (
            "@hookimpl\ndef europa_config_sections():\n    return {'bad': dict}\n",
            "plugin 'bad': europa_config_sections() gives [bad] as <class 'dict'>; "
            "expected a @dataclass class",
        ),
        (
            "from dataclasses import dataclass, field\n"
            "@dataclass\nclass T:\n    x: int = field(default=1, metadata={'min': 0})\n"
            "@hookimpl\ndef europa_config_sections():\n    return {'bad': T}\n",
            "plugin 'bad': europa_config_sections() [bad] field 'x' has metadata ['min']; "
            "expected only ['doc', 'ge', 'gt', 'le', 'choices']",
        ),
        (
            "from dataclasses import dataclass\n"
            "@dataclass\nclass T:\n    x: dict = None\n"
            "@hookimpl\ndef europa_config_sections():\n    return {'bad': T}\n",
            "plugin 'bad': europa_config_sections() [bad] field 'x' is annotated <class 'dict'>; "
            "expected bool, int, float, str or list[...] of one of them",
        ),
    ],
)
def test_a_badly_declared_table_is_one_line_naming_the_plugin(install, body, message):
    install("europa-bad", {"bad": body})
    with pytest.raises(PluginError) as err:
        EuropaPluginManager().config_sections()
    assert str(err.value) == message


COMMAND = """
@hookimpl
def europa_register_commands(app):
    @app.command("hello")
    def hello() -> None:
        print("hello from an installed plugin")
"""


def test_an_installed_plugin_adds_a_command_without_being_enabled(install, capsys):
    from europa.cli.app import run

    install("europa-hello", {"hello": COMMAND})
    assert run(["hello"]) == 0
    assert capsys.readouterr().out == "hello from an installed plugin\n"
    assert run(["plugins"]) == 0
    assert "hello  (europa-hello 0.1.0, installed)\n    europa_register_commands" in (
        capsys.readouterr().out
    )


MARKERS = """
@hookimpl(specname="europa_after_step", tryfirst=True)
def record_first(job, step, metrics):
    metrics.setdefault("order", []).append("{name}")
"""


def test_specname_and_tryfirst_are_honoured(install):
    install("europa-alpha", {"alpha": AFTER_STEP.format(name="alpha")})
    install("europa-zeta", {"zeta": MARKERS.format(name="zeta")})
    pm = EuropaPluginManager()
    assert _external(pm)["zeta"].hooks == ("europa_after_step",)
    pm.enable(["alpha", "zeta"])
    metrics: dict[str, object] = {}
    pm.hook.europa_after_step(job=None, step=1, metrics=metrics)
    assert metrics == {"order": ["zeta"], "alpha_seen": 1}
    impls = [impl.plugin_name for impl in pm.hook.europa_after_step.get_hookimpls()]
    assert impls[-1] == "zeta"  # tryfirst: called first, listed last by pluggy


def test_a_disabled_name_is_blocked_for_later_registration():
    plugin = types.ModuleType("europa_fake_blocked")
    pm = EuropaPluginManager(
        environ={DISABLE_ENV: "alpha"}, extra_plugins=[("alpha", plugin, "europa-alpha", "1")]
    )
    assert "alpha" not in _external(pm)
    assert pm._pm.is_blocked("alpha")
