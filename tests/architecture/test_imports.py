"""The import graph of europa's packages, read with ``ast`` (nothing is imported): no
cycle anywhere, the planner (``europa.core.plan``) imports no plugin module, no
technique package imports europa-core or another technique package, and europa-report
imports only itself and the contract.

Every import counts, at module level or inside a function (a lazy import still ties the
two modules together), except those under ``if TYPE_CHECKING:``."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2] / "packages"
TECHNIQUES = ("flexshard", "offload", "overlap")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGES.glob("*/src/europa/**/*.py"):
        parts = path.relative_to(path.parents[len(path.relative_to(PACKAGES).parts) - 3]).parts
        name = ".".join(parts).removesuffix(".py").removesuffix(".__init__")
        out[name] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            # ``from pkg import sub`` depends on the submodule; ``from pkg import name`` on pkg
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            names = []
        for name in names:
            target = resolve(name) if name.startswith("europa.") else None
            if target and target != module:
                found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {module: _imports(module, path, known) for module, path in known.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, if there is any (depth-first search with colours)."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in colour and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if node not in colour and (found := visit(node)):
            return found
    return None


def _package_imports(graph, parent: str) -> dict[str, list[str]]:
    return {m: sorted(t) for m, t in graph.items() if m == parent or m.startswith(parent + ".")}


def test_no_import_cycle_anywhere_in_europa():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_planner_imports_no_plugin_module():
    for module, targets in _package_imports(_graph(), "europa.core.plan").items():
        bad = [t for t in targets if t.startswith("europa.core.plugins")]
        assert not bad, f"{module} imports {bad}"


def test_technique_packages_import_only_themselves_and_the_contract():
    graph = _graph()
    for technique in TECHNIQUES:
        own = f"europa.{technique}"
        for module, targets in _package_imports(graph, own).items():
            bad = [t for t in targets if not t.startswith((own, "europa.spec"))]
            assert not bad, f"{module} imports {bad}"
    for module, targets in _package_imports(graph, "europa.spec").items():
        assert all(t.startswith("europa.spec") for t in targets), (module, targets)


def test_the_report_imports_only_itself_and_the_contract():
    for module, targets in _package_imports(_graph(), "europa.report").items():
        bad = [t for t in targets if not t.startswith(("europa.report", "europa.spec"))]
        assert not bad, f"{module} imports {bad}"


def test_the_planner_package_imports_only_itself_and_the_standard_library():
    """europa-plan installs alone and starts in a blink: no torch, no other europa package
    (europa-spec's distribution needs torch), nothing beyond the standard library."""
    plan = PACKAGES / "europa-plan" / "src" / "europa" / "plan"
    for path in sorted(plan.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                own = name == "europa.plan" or name.startswith("europa.plan.")
                assert own or (top in sys.stdlib_module_names and top != "europa"), (path, name)
    assert "europa.plan.reader" in _graph()["europa.plan"]  # the reader sees them


def test_the_graph_sees_the_imports_it_checks():
    """The reader itself: it finds a known lazy import and a known module-level one."""
    graph = _graph()
    assert "europa.spec.hookspecs" in graph["europa.flexshard.plugin"]
    assert "europa.flexshard.builder" in graph["europa.flexshard.plugin"]  # inside a function
    assert "europa.core.errors" in graph["europa.core.job"]
