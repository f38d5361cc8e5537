"""The test tiers (``make check`` runs ``check``, ``make test`` runs everything): the table in ``conftest.py`` holds.

Every test file has a tier decision (in ``CHECK_FILES`` or a whole-file ``FULL`` entry, not both); every ``full``
entry says in one line why, and names a file and test that exist; every ``slow`` test is ``full``; no test file
writes a tier marker of its own (the table is the one place); the collected tests carry their tier's marker; and the
``check`` tier imports every package of unroll at least once (the layers of tests/test_architecture.py), so the
inner loop touches each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import CHECK_FILES, FULL
from test_architecture import FOLDERS, layer_of

TESTS = Path(__file__).resolve().parent
MAX_REASON = 100


def _files() -> set[str]:
    return {p.name for p in TESTS.glob("test_*.py")}


def _tree(name: str) -> ast.Module:
    return ast.parse((TESTS / name).read_text(), filename=name)


def _tests(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """The test functions of a module, by name (methods of ``Test*`` classes included)."""
    return {n.name: n for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}


def _marks(nodes: list[ast.expr], name: str) -> bool:
    """Whether any of ``nodes`` (decorators, a ``pytestmark`` value) is or holds ``pytest.mark.<name>``."""
    return any(isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for node in nodes for n in ast.walk(node))


def _pytestmark(tree: ast.Module) -> list[ast.expr]:
    return [n.value for n in tree.body if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]


def test_every_test_file_has_one_tier_decision() -> None:
    whole_full = {k for k in FULL if "::" not in k}
    files = _files()
    assert not CHECK_FILES & whole_full, f"both check and full: {sorted(CHECK_FILES & whole_full)}"
    missing = files - CHECK_FILES - whole_full
    assert not missing, (f"no tier decision for {sorted(missing)}: add each to CHECK_FILES or FULL in "
                         "tests/conftest.py (FULL with the one-line reason it must own its servers or is heavy)")
    gone = (CHECK_FILES | whole_full) - files
    assert not gone, f"the tier table names files that do not exist: {sorted(gone)}"


def test_every_full_entry_has_a_one_line_reason_and_names_a_test_that_exists() -> None:
    for key, reason in FULL.items():
        assert isinstance(reason, str) and reason.strip() and "\n" not in reason, f"{key}: no one-line reason"
        assert len(reason) <= MAX_REASON, f"{key}: the reason is over {MAX_REASON} characters (one short line)"
        if "::" in key:
            name, test = key.split("::")
            assert name in CHECK_FILES, f"{key}: its file must be a check file (a full file needs no test entries)"
            assert test.split("[")[0] in _tests(_tree(name)), f"{key}: no such test function in {name}"


def test_every_slow_test_is_full() -> None:
    """``slow`` means over about 20 s: not for the inner loop."""
    check_and_slow = []
    for name in sorted(CHECK_FILES):
        tree = _tree(name)
        file_slow = _marks(_pytestmark(tree), "slow")
        for test, node in _tests(tree).items():
            if (file_slow or _marks(node.decorator_list, "slow")) and f"{name}::{test}" not in FULL:
                check_and_slow.append(f"{name}::{test}")
    assert not check_and_slow, f"slow tests left in the check tier (give each a FULL entry): {check_and_slow}"


def test_no_file_writes_its_own_tier_marker() -> None:
    for name in sorted(_files()):
        tree = _tree(name)
        nodes = [d for f in _tests(tree).values() for d in f.decorator_list] + _pytestmark(tree)
        for tier in ("full", "check"):
            assert not _marks(nodes, tier), f"{name} writes pytest.mark.{tier}: tiers go in conftest.py's table"


def test_collected_tests_carry_their_tiers_marker(request: pytest.FixtureRequest) -> None:
    """What this run collected (after ``-m``): one tier marker each, a ``full`` one with its reason."""
    for item in request.session.items:
        full, check = item.get_closest_marker("full"), item.get_closest_marker("check")
        assert (full is None) != (check is None), item.nodeid
        if full is not None:
            assert len(full.args) == 1 and full.args[0], item.nodeid
        assert not (check is not None and item.get_closest_marker("slow")), f"{item.nodeid}: slow in check"


def _imported(tree: ast.Module, skip: set[str]) -> set[str]:
    """Modules the file imports (module level and inside functions), except inside the test functions ``skip``."""
    found: set[str] = set()

    def walk(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in skip:
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(tree)
    return found


def test_the_check_tier_imports_every_package() -> None:
    """Each package (the core and every stage) is imported by some check test file, outside its full tests."""
    by_layer: dict[str, set[str]] = {package: set() for package in FOLDERS.values()}
    for name in CHECK_FILES:
        full = {key.split("::")[1] for key in FULL if key.startswith(f"{name}::")}
        for module in _imported(_tree(name), full):
            if module == "unroll" or module.startswith("unroll."):
                by_layer[layer_of(module)].add(name)
    assert all(by_layer.values()), {layer: sorted(files) for layer, files in by_layer.items() if not files}


def test_the_import_walk_sees_function_local_imports_and_skips_full_tests() -> None:
    tree = ast.parse("import unroll.export\n"
                     "def helper():\n    from unroll.serving import gateway\n"
                     "def test_full():\n    import unroll.app.cli\n"
                     "def test_relative():\n    from . import served\n")
    assert _imported(tree, {"test_full"}) == {"unroll.export", "unroll.serving", "unroll.serving.gateway"}
    assert {layer_of(m) for m in _imported(tree, set())} == {"unroll.export", "unroll.serving", "unroll.app"}
