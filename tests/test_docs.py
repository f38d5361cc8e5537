"""The docs site and the README hold together: the site builds with ``mkdocs build --strict`` (a missing page or
anchor fails it, shown by breaking each on a copy), the generated CLI and REST reference pages are what the code
says now, every shell and Python block is run by a named test or says why not, the README stays a first page
(≤ 250 lines) whose links resolve, and ``make docs`` leaves ``git status`` as it found it."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import markdown
import pytest
from readme_blocks import README, ROOT, fences, pages

from unroll.app import docs_reference

MKDOCS = [sys.executable, "-m", "mkdocs"]
#: The fence languages a reader would paste into a shell or Python.
RUNNABLE = {"bash", "sh", "shell", "console", "python", "py", "pycon"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _build(project: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MKDOCS, "build", "--strict", "-f", str(project / "mkdocs.yml"), "-d", str(site)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strict(tmp_path: Path) -> None:
    r = _build(ROOT, tmp_path / "site")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()
    assert (tmp_path / "site" / "benchmarks" / "results" / "serve_latency.png").is_file()  # linked results come along


@pytest.fixture(scope="module")
def project_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mkdocs.yml and docs/ copied (the linked folders as real copies), for breaking a page without touching ours."""
    root = tmp_path_factory.mktemp("docs_copy")
    shutil.copy2(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", root / "docs", symlinks=False)
    return root


@pytest.mark.parametrize("link, complaint", [("[gone](no-such-page.md)", "no-such-page.md"),
                                             ("[gone](operating.md#no-such-anchor)", "no-such-anchor")])
def test_a_missing_page_or_anchor_fails_the_build(project_copy: Path, tmp_path: Path, link: str,
                                                  complaint: str) -> None:
    page = project_copy / "docs" / "getting-started.md"
    original = page.read_text()
    try:
        page.write_text(original + f"\nSee {link}.\n")
        r = _build(project_copy, tmp_path / "site")
    finally:
        page.write_text(original)
    assert r.returncode != 0 and complaint in r.stderr, r.stderr[-2000:]


def test_the_reference_pages_are_what_the_code_says() -> None:
    """The committed CLI and REST reference equal what the Typer app and the gateway's OpenAPI schema give now."""
    assert docs_reference.stale(ROOT / "docs" / "reference") == [], "run `make docs` and commit docs/reference"


def test_the_reference_check_fails_when_a_page_differs(tmp_path: Path) -> None:
    out = tmp_path / "reference"
    shutil.copytree(ROOT / "docs" / "reference", out)
    page = out / docs_reference.CLI_PAGE
    page.write_text(page.read_text().replace("--models", "--modles", 1))
    assert docs_reference.stale(out) == [docs_reference.CLI_PAGE]
    r = subprocess.run([sys.executable, "-m", "unroll.app.docs_reference", "--out", str(out), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "cli.md" in r.stderr, (r.returncode, r.stderr)


def test_the_cli_reference_has_every_command_and_option() -> None:
    import typer

    from unroll.app.cli import app

    page = (ROOT / "docs" / "reference" / docs_reference.CLI_PAGE).read_text()
    for path, cmd in docs_reference._commands(typer.main.get_command(app)):
        assert f"## `{' '.join(('unroll', *path))}`" in page, path
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert f"`{param.opts[0]}" in page, (path, param.opts)


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_shell_and_python_block_is_run_or_says_why() -> None:
    """Above each shell or Python block: ``<!-- run: tests/FILE.py::TEST … -->`` naming a test that exists, or
    ``<!-- not run…: reason -->``."""
    checked = 0
    for page in pages():
        for fence in fences(page):
            if fence.language not in RUNNABLE:
                continue
            checked += 1
            where = f"{page.relative_to(ROOT)}:{fence.line}"
            assert fence.note, f"{where}: a {fence.language} block with no <!-- run: … --> or <!-- not run: … -->"
            if fence.note.startswith("not run"):
                reason = fence.note.split(":", 1)[1].strip() if ":" in fence.note else ""
                assert len(reason) >= 20, f"{where}: say why the block is not run ({fence.note!r})"
                continue
            m = re.match(r"run: (tests/\w+\.py)::(\w+)", fence.note)
            assert m, f"{where}: {fence.note!r} is neither 'run: tests/FILE.py::TEST' nor 'not run: reason'"
            assert m.group(2) in _test_functions(ROOT / m.group(1)), f"{where}: {m.group(1)} has no {m.group(2)}"
    assert checked >= 15, checked


def test_the_readme_is_a_first_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    for heading in ("## Two commands", "## A first request", "## What it does", "## Measured", "## Read on"):
        assert heading in text, heading


def _anchors(page: Path) -> set[str]:
    """The heading ids Markdown's toc gives ``page`` (what mkdocs links to)."""
    md = markdown.Markdown(extensions=["toc", "tables", "attr_list"])
    md.convert(page.read_text(encoding="utf-8"))
    ids: set[str] = set()

    def walk(tokens: list[dict]) -> None:
        for t in tokens:
            ids.add(t["id"])
            walk(t["children"])
    walk(md.toc_tokens)
    return ids


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_the_top_level_pages_links_resolve(name: str) -> None:
    """Relative links of the pages outside the site (mkdocs checks the site's own): the file exists, and an anchor
    into a Markdown page is one of its headings."""
    page = ROOT / name
    links = [u for u in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", u)]
    assert links, f"{name} links nothing"
    for link in links:
        target, _, anchor = link.partition("#")
        path = (page.parent / target) if target else page
        assert path.exists(), f"{name}: {link} points at a missing file"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{name}: {link}: no heading with that anchor in {target or name}"


def test_make_docs_leaves_git_status_as_it_was(tmp_path: Path) -> None:
    """``make docs`` writes the reference pages (unchanged when the code is) and the site into build/site (ignored)."""
    def status() -> str:
        return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                              capture_output=True, text=True, check=True, timeout=60).stdout
    before = status()
    r = subprocess.run(["make", "-s", "-o", ".venv/.installed", "docs", f"PY={sys.executable}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (ROOT / "build" / "site" / "index.html").is_file()
    assert status() == before


def test_a_generated_block_is_rewritten_on_every_page_that_holds_it(tmp_path: Path) -> None:
    from unroll.benchmarks.common import write_docs_blocks

    begin, end = "<!-- x: generated -->", "<!-- /x -->"
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    holders = [tmp_path / "README.md", tmp_path / "docs" / "sub" / "page.md"]
    for page in holders:
        page.write_text(f"before\n{begin}\nold\n{end}\nafter\n")
    (tmp_path / "docs" / "other.md").write_text("no markers\n")
    assert write_docs_blocks(tmp_path, begin, end, "new")
    for page in holders:
        assert page.read_text() == f"before\n{begin}\nnew\n{end}\nafter\n"
    assert (tmp_path / "docs" / "other.md").read_text() == "no markers\n"
    assert not write_docs_blocks(tmp_path, "<!-- y -->", "<!-- /y -->", "new")
