"""The READMEs and docs: the front page stays a front page, every relative link (and
``#anchor``) lands, and the API snippets of europa-core's, europa-cli's and the
plugin guide's pages run as written."""

from __future__ import annotations

import contextlib
import io
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRONT_PAGE_MAX_LINES = 160

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "benchmarks" / "README.md"]
    pages += sorted((ROOT / "docs").glob("*.md"))
    pages += sorted((ROOT / "packages").glob("*/README.md"))
    return pages


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (code keeps its place as blank lines)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: link markup and backticks dropped, lower case,
    punctuation other than ``-`` and ``_`` removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(page.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    prose = INLINE_CODE.sub("code", "\n".join(_prose(page.read_text())))
    return [m.group(2) for m in LINK.finditer(prose) if not SCHEME.match(m.group(2))]


def test_the_pages_this_checks_exist():
    names = {str(p.relative_to(ROOT)) for p in _pages()}
    for name in (
        "README.md",
        "SECURITY.md",
        "benchmarks/README.md",
        "docs/plan.md",
        "docs/data.md",
        "docs/hf.md",
        "docs/plugins.md",
        "docs/operations.md",
        "packages/europa-core/README.md",
        "packages/europa-cli/README.md",
    ):
        assert name in names and (ROOT / name).is_file(), name


def test_the_front_page_is_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= FRONT_PAGE_MAX_LINES
    quick_start = re.search(r"## Quick start\n(.*?)\n## ", text, re.S).group(1)
    commands = re.search(r"```sh\n(.*?)```", quick_start, re.S).group(1).splitlines()
    assert [line.split("#")[0].strip() for line in commands] == ["make train", "make test"]


def test_the_front_page_pins_no_figure_to_a_commit_and_counts_no_tests():
    """Figures live in benchmarks/README.md, each table from one stated run; the front page
    links there, so it never goes stale with a commit or a count."""
    text = (ROOT / "README.md").read_text()
    assert not re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert not re.findall(r"\b(?:at|commit)\s+[0-9a-f]{7,40}\b", text)  # digits-only hashes
    assert not re.findall(r"\b\d+ (?:tests|passed)\b", text)
    picture = re.search(r"## Packages\n.*?```text\n(.*?)```", text, re.S).group(1)
    layers = [line.split()[0] for line in picture.splitlines()]
    assert layers == [
        "europa-cli", "europa-core", "europa-flexshard", "europa-plan", "europa-spec", "torch,"
    ]  # fmt: skip


def test_github_slugs():
    assert github_slug("Will it fit? `europa plan`") == "will-it-fit-europa-plan"
    assert (
        github_slug("The fastest layout for an allocation: `europa plan --search`")
        == "the-fastest-layout-for-an-allocation-europa-plan---search"
    )
    assert github_slug("Several nodes, and restarts") == "several-nodes-and-restarts"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or not target.is_relative_to(ROOT):
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading with that anchor in {target.name}")
        elif anchor and target.suffix != ".md":
            broken.append(f"{link}: an anchor into a file that is not markdown")
    assert not broken, broken


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def _readme_snippet(package: str) -> str:
    blocks = _python_blocks(ROOT / "packages" / package / "README.md")
    assert len(blocks) == 1, f"{package}: expected one ```python block"
    return blocks[0]


def _run(code: str, name: str, namespace: dict) -> None:
    # dont_inherit: the snippet runs without this file's `from __future__` imports.
    exec(compile(code, name, "exec", dont_inherit=True), namespace)


def test_the_core_readme_loop_runs():
    import torch

    # One thread: the loop's time then does not depend on what else the machine runs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        namespace: dict = {}
        with contextlib.redirect_stdout(io.StringIO()) as out:
            _run(_readme_snippet("europa-core"), "europa-core/README.md", namespace)
    finally:
        torch.set_num_threads(threads)
    assert namespace["plan"].fits
    assert namespace["counts"].total > namespace["counts"].active_per_token > 0
    losses = namespace["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "step 2: loss" in out.getvalue()


def test_the_cli_readme_snippet_runs(capsys):
    namespace: dict = {}
    _run(_readme_snippet("europa-cli"), "europa-cli/README.md", namespace)
    assert namespace["plan"]["fits"]
    assert {"core.model", "core.fsdp2", "core.optimizer"} <= set(namespace["plugins"])
    assert "training.steps = 0" in capsys.readouterr().err


def test_the_report_readme_snippet_runs():
    namespace: dict = {}
    _run(_readme_snippet("europa-report"), "europa-report/README.md", namespace)
    assert namespace["page"].is_file()


def test_the_planner_readme_plans_a_published_run(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    _run(_readme_snippet("europa-plan"), "europa-plan/README.md", {})
    assert "tp1" in capsys.readouterr().out


def test_every_package_readme_has_one_snippet_that_a_test_runs():
    tested = {"europa-core", "europa-cli", "europa-report", "europa-spec", "europa-plan"}
    standalone = {"europa-flexshard", "europa-offload", "europa-overlap"}  # test_standalone
    packages = {p.parent.name for p in (ROOT / "packages").glob("*/README.md")}
    assert packages == tested | standalone
    for package in packages:
        assert _python_blocks(ROOT / "packages" / package / "README.md"), package


def test_the_plugin_guides_plugin_declares_its_table_and_reports_a_metric():
    from europa.core.errors import ConfigError
    from europa.core.plugins import EuropaPluginManager
    from europa.core.session import open_session

    (snippet,) = _python_blocks(ROOT / "docs" / "plugins.md")
    plugin = types.ModuleType("mypackage.plugin")
    _run(snippet, "docs/plugins.md", plugin.__dict__)

    def manager():
        extra = [("myplugin", plugin, "mypackage", "0.1.0")]
        return EuropaPluginManager(load_entry_points=False, extra_plugins=extra)

    config, plugins = open_session(
        "tiny", ["myplugin.every=2"], plugins=["myplugin"], manager=manager()
    )
    job = types.SimpleNamespace(config=config)
    metrics: dict = {}
    plugins.hook.europa_after_step(job=job, step=1, metrics=metrics)
    assert metrics == {"myplugin_seen": 1}
    with pytest.raises(ConfigError, match=r"myplugin\.mode"):
        open_session("tiny", ["myplugin.mode='slow'"], plugins=["myplugin"], manager=manager())
