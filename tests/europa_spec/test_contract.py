"""europa-spec: the pieces every package shares, checked once here."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from europa.spec import hookspecs, metrics
from europa.spec.errors import is_user_error
from europa.spec.hookspecs import hookimpl
from europa.spec.optim import optimizer_state_bytes, uses_muon
from europa.spec.plan_layout import LayoutError
from tests.installs import PACKAGES


class _Renamed(nn.Module):
    """Hugging Face names: an embedding that is not ``tok_embeddings``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.LayerNorm(16)])
        self.lm_head = nn.Linear(16, 100, bias=False)


def test_the_muon_rule_keeps_embeddings_heads_and_norms_on_adamw_whatever_their_names():
    model = _Renamed()
    muon = sorted(n for n, p in model.named_parameters() if uses_muon(n, p.shape))
    assert muon == ["layers.0.weight"]


def test_optimizer_state_bytes_are_fp32_moments_and_step_counters():
    assert optimizer_state_bytes(10, 0, 0) == 40  # Muon's momentum
    assert optimizer_state_bytes(0, 10, 1) == 84  # AdamW's two moments and a step


def test_every_hook_has_one_phase_and_phases_are_in_order():
    specs = {n for n in vars(hookspecs) if n.startswith("europa_")}
    phased = [hook for _, hooks in hookspecs.PHASES for hook in hooks]
    assert sorted(phased) == sorted(specs) and len(phased) == len(set(phased))
    assert [p for p, _ in hookspecs.PHASES][-1] == "teardown"


def _hooks_as_defined() -> list:
    return sorted(
        (f for n, f in vars(hookspecs).items() if n.startswith("europa_")),
        key=lambda f: f.__code__.co_firstlineno,
    )


def test_the_hooks_are_defined_in_phase_order():
    """Read top to bottom, hookspecs.py is the order a run calls the hooks in."""
    defined = [f.__name__ for f in _hooks_as_defined()]
    assert defined == [hook for _, hooks in hookspecs.PHASES for hook in hooks]


def test_every_hook_documents_each_parameter_its_result_and_whether_it_stops_early():
    import inspect

    for hook in _hooks_as_defined():
        doc = inspect.getdoc(hook)
        for name in inspect.signature(hook).parameters:
            assert f":param {name}:" in doc, f"{hook.__name__} leaves {name} undocumented"
        returns = inspect.signature(hook).return_annotation
        assert (":returns:" in doc) == (returns != "None"), hook.__name__
        stops = getattr(hook, f"{hookspecs.PROJECT}_spec")["firstresult"]  # pluggy's mark
        assert ("Stops at first non-None result" in doc) == stops, hook.__name__


# europa-flexshard's plugin joins this list once its hooks are annotated too
ANNOTATED_PLUGINS = (
    "europa.core.plugins.builtin.activation_checkpointing",
    "europa.core.plugins.builtin.fsdp",
    "europa.core.plugins.builtin.model",
    "europa.core.plugins.builtin.optimizer",
    "europa.flexshard.plugin",
    "europa.offload.plugin",
    "europa.overlap.plugin",
    "europa.report.plugin",
)


@pytest.mark.parametrize("module", ANNOTATED_PLUGINS)
def test_hook_implementations_type_each_parameter_as_the_spec_does(module):
    """A hook's ``job`` says which phase's Job protocol it relies on (``PlanningJob`` or
    ``RunningJob``), as the spec does."""
    import importlib
    import inspect

    hooks = vars(importlib.import_module(module))
    implemented = [name for name in vars(hookspecs) if name.startswith("europa_") and name in hooks]
    assert implemented
    for name in implemented:
        spec = inspect.signature(getattr(hookspecs, name)).parameters
        implementation = inspect.signature(hooks[name]).parameters
        for parameter in implementation:
            assert implementation[parameter].annotation == spec[parameter].annotation, (
                f"{module}.{name}({parameter})"
            )


def _public_names_defined(source: str) -> set[str]:
    """The module's own top-level functions, classes and assigned names, not imports."""
    import ast

    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            elements = target.elts if isinstance(target, ast.Tuple) else [target]
            names.update(e.id for e in elements if isinstance(e, ast.Name))
    return {n for n in names if not n.startswith("_")}


def test_every_spec_module_exports_what_it_defines():
    import importlib
    import pkgutil
    from pathlib import Path

    import europa.spec

    for info in pkgutil.iter_modules(europa.spec.__path__):
        module = importlib.import_module(f"europa.spec.{info.name}")
        defined = _public_names_defined(Path(module.__file__).read_text())
        assert sorted(getattr(module, "__all__", [])) == sorted(defined), info.name


def test_the_trainer_writes_exactly_the_training_metric_keys(tmp_path):
    import json

    from tests.conftest import run_ranks
    from tests.trainer_runs import Run, train_runs

    run = Run("keys", ["training.steps=1"], [])
    run_ranks(train_runs, 1, str(tmp_path), [run])
    record = json.loads((tmp_path / run.name / "metrics.jsonl").read_text().splitlines()[0])
    assert set(record) == metrics.TRAINING_KEYS


def test_the_readme_snippet_runs():
    text = (PACKAGES / "europa-spec" / "README.md").read_text()
    exec(re.search(r"```python\n(.*?)```", text, re.S).group(1), {})


def _mine(layout: dict):
    class Mine:
        @hookimpl
        def europa_plan(self, job, plan):
            plan["layout"] = layout | {"owner": "mine"}

    return Mine()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("adamw_tensors"),
         "plugin mine: plan[\"layout\"]['adamw_tensors'] is missing"),
        (lambda d: d.update(stored_elements="lots"),
         "plugin mine: plan[\"layout\"]['stored_elements'] = 'lots': expected a list of integers"),
        (lambda d: d.update(replica_group={"size": 2}),
         "plugin mine: plan[\"layout\"]['replica_group']['stride'] is missing"),
        (lambda d: d.update(bytes_per_rank=3),
         "plugin mine: plan[\"layout\"]['bytes_per_rank']: unknown key; expected keys among"),
    ],
)  # fmt: skip
def test_a_plugins_broken_layout_is_one_line_naming_the_plugin_and_the_key(edit, message):
    from europa.core.plan import load_profile, make_plan
    from europa.core.plugins.manager import EuropaPluginManager
    from europa.core.session import open_session

    config, manager = open_session("tiny")
    good = make_plan(config, manager, load_profile("cpu"), 1).layout
    broken = dict(good)
    edit(broken)
    manager = EuropaPluginManager(extra_plugins=[("mine", _mine(broken), "tests", "0")])
    config, manager = open_session("tiny", (), ["mine"], manager)
    with pytest.raises(LayoutError) as err:
        make_plan(config, manager, load_profile("cpu"), 1)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert is_user_error(err.value)


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4), seed=st.integers(0, 999))
def test_the_exact_adamw_gives_the_same_bits_however_the_tensors_are_split(sizes, seed):
    """What FlexShard's layouts rely on to train alike at any ep or world size."""
    import torch

    from europa.spec.muon import adamw_state, adamw_update_exact

    generator = torch.Generator().manual_seed(seed)
    whole = torch.randn(sum(sizes), 7, 13, generator=generator)
    grads = [torch.randn(whole.shape, generator=generator) for _ in range(3)]

    def stepped(splits):
        params = [torch.nn.Parameter(p.clone()) for p in whole.split(splits)]
        states = [adamw_state(p) for p in params]
        for grad in grads:
            for param, piece in zip(params, grad.split(splits), strict=True):
                param.grad = piece.clone()
            adamw_update_exact(
                params, states, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
            )
        return torch.cat([p.detach() for p in params])

    assert torch.equal(stepped(sizes), stepped([sum(sizes)]))


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    matrix=st.sampled_from([(8, 16), (1, 64), (3, 128), (7, 13)]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 999),
)
def test_adamw_any_split_gives_the_same_bits_however_the_stacks_are_cut(
    sizes, matrix, threads, seed
):
    """FlexShard's AdamW: the fused kernel on stacks of whole-vector matrices (and the
    elementwise form on the rest) gives each element the same bits whether its stack is
    stepped whole or cut between matrices, on any number of threads."""
    import torch

    from europa.spec.muon import adamw_state, adamw_update_any_split, takes_fused_adamw

    generator = torch.Generator().manual_seed(seed)
    whole = torch.randn(sum(sizes), *matrix, generator=generator)
    grads = [torch.randn(whole.shape, generator=generator) for _ in range(3)]

    def stepped(splits, num_threads):
        params = [torch.nn.Parameter(p.clone()) for p in whole.split(splits)]
        states = [adamw_state(p) for p in params]
        before = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            for grad in grads:
                for param, piece in zip(params, grad.split(splits), strict=True):
                    param.grad = piece.clone()
                adamw_update_any_split(
                    params, states, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
                )
        finally:
            torch.set_num_threads(before)
        return torch.cat([p.detach() for p in params])

    assert takes_fused_adamw(whole) == (matrix != (7, 13))
    assert torch.equal(stepped(sizes, threads), stepped([sum(sizes)], 2))


def test_the_fused_adamw_equals_torchs_on_a_whole_vector_stack():
    """Where it takes the fused kernel, FlexShard's AdamW is core's (torch's fused) update
    bit for bit; elsewhere it is the elementwise form, within fp32 rounding of it."""
    import torch

    from europa.spec.muon import adamw_state, adamw_update, adamw_update_any_split

    generator = torch.Generator().manual_seed(0)
    for shape, exact in (((4, 8, 16), True), ((4, 7, 13), False)):
        start = torch.randn(shape, generator=generator)
        grad = torch.randn(shape, generator=generator)
        results = []
        for update in (adamw_update, adamw_update_any_split):
            param = torch.nn.Parameter(start.clone())
            param.grad = grad.clone()
            state = adamw_state(param)
            update([param], [state], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            results.append(param.detach())
        if exact:
            assert torch.equal(*results)
        else:
            torch.testing.assert_close(*results, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"keep_last_blocks": "1"}, "['keep_last_blocks'] = '1': expected an integer"),
        ({"activation_blocks": "layers.*"}, "expected a list of strings"),
        ({"optimizer_stat": True}, "['optimizer_stat']: unknown key"),
    ],
)
def test_a_broken_host_offload_table_is_one_line_naming_the_plugin_and_the_key(table, message):
    from europa.spec.offload import HostOffload

    with pytest.raises(LayoutError) as refused:
        HostOffload.parse(table)
    text = str(refused.value)
    assert text.startswith('plugin offload: plan["host_offload"]') and message in text
    assert is_user_error(refused.value) and "\n" not in text


def test_host_offload_moves_the_matching_blocks_but_the_last_kept():
    from europa.spec.offload import HostOffload

    offload = HostOffload.parse({"activation_blocks": ["layers.*"], "keep_last_blocks": 1})
    blocks = ["layers.0", "layers.1", "layers.2", "<root>"]
    assert offload.offloaded_blocks(blocks) == {"layers.0", "layers.1"}
    assert HostOffload.parse(None) == HostOffload()


def test_the_dispatchers_and_initialisers_satisfy_the_contracts_they_are_used_through():
    from europa.core.hf.load import HFInitialiser
    from europa.core.model.materialise import MatrixInitialiser
    from europa.flexshard.exchange.flat import FlatDispatcher, FlatRouted
    from europa.flexshard.exchange.nodes import ExpertNodes
    from europa.flexshard.exchange.two_level import TwoLevelDispatcher, TwoLevelRouted
    from europa.spec.dispatch import ChunkedDispatcher, RoutedExchange
    from europa.spec.init import InitMatrix, RegionInitMatrix

    ranges = [(0, 4)]
    for dispatcher in (
        FlatDispatcher(None, 0, ranges, 2),
        TwoLevelDispatcher(None, 0, ranges, 2, nodes=ExpertNodes(1)),
    ):
        assert isinstance(dispatcher, ChunkedDispatcher)
    wanted = [m for m in dir(RoutedExchange) if not m.startswith("_")]
    assert sorted(wanted) == ["arrive", "finish", "send_back"]  # and the chunks attribute
    for routed in (FlatRouted, TwoLevelRouted):
        assert all(callable(getattr(routed, m)) for m in wanted)
        assert isinstance(routed.chunks, property)
    initialiser = MatrixInitialiser(nn.Linear(2, 2), seed=0)
    assert isinstance(initialiser, InitMatrix) and not isinstance(initialiser, RegionInitMatrix)
    assert callable(HFInitialiser.fill_region)  # what makes it a RegionInitMatrix
    assert not isinstance(lambda name, index, out: None, RegionInitMatrix)
