"""The layers point one way: every import in the package (module level, function-local and ``TYPE_CHECKING`` ones
alike, read with ``ast``) goes from a layer to one below it, never up.

    unroll.app                                       the CLI, ``unroll serve``, the doctor, container staging
      └─ unroll.benchmarks                           measurements
           └─ unroll.pipeline                        which artifacts are missing or stale, and making them
                └─ unroll.export   unroll.serving    the stages (neither imports the other)
                     └─ unroll (core)                models, solvers, card, registry, tasks, artifacts, errors

The stage folders stay at the top of the repository (``export/``, ``serving/``, …) and install as subpackages of
``unroll`` (``package-dir`` in pyproject.toml), so a reader cannot tell the layer from the path: each folder's
``__init__`` docstring names the package it installs as, and this test holds the arrows.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: folder → the package it installs as (pyproject.toml ``[tool.setuptools.package-dir]``)
FOLDERS = {"unroll": "unroll", "export": "unroll.export", "serving": "unroll.serving",
           "benchmarks": "unroll.benchmarks", "pipeline": "unroll.pipeline", "app": "unroll.app"}
STAGES = ("unroll.export", "unroll.serving", "unroll.pipeline", "unroll.benchmarks", "unroll.app")
#: layer → the packages it must not import
FORBIDDEN = {
    "unroll": STAGES,
    "unroll.export": ("unroll.serving", "unroll.pipeline", "unroll.benchmarks", "unroll.app"),
    "unroll.serving": ("unroll.export", "unroll.pipeline", "unroll.benchmarks", "unroll.app"),
    "unroll.pipeline": ("unroll.benchmarks", "unroll.app"),
    "unroll.benchmarks": ("unroll.app",),
    "unroll.app": (),
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> str:
    """The layer a module belongs to: the stage package that holds it, else the core."""
    return next((s for s in STAGES if _within(module, s)), "unroll")


def modules() -> dict[str, Path]:
    """Every module of the package, by its installed dotted name."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


#: Calls that import the module named by their first argument (a string literal is read like an import statement).
DYNAMIC_IMPORTS = ("import_module", "__import__")


def imported(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, wherever it is; ``from P import name`` counts as ``P.name``
    (so ``from unroll import export`` is seen as ``unroll.export``), relative imports are resolved, and
    ``importlib.import_module("…")`` / ``__import__("…")`` with a literal name count too, as does a launch of a
    module of ours (``"-m", "unroll.…"`` in a command list: the module runs, imported at run time)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.List, ast.Tuple)):
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            out += [(node.lineno, w) for flag, w in zip(words, words[1:], strict=False)
                    if flag == "-m" and isinstance(w, str) and w.startswith("unroll.")]
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in DYNAMIC_IMPORTS:
                out.append((node.lineno, node.args[0].value))
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def upward_imports(found: dict[str, Path] | None = None) -> list[str]:
    """Each import that points up a layer, as ``file:line: importer → imported`` (``found``: the modules to read,
    by dotted name; default: the package's)."""
    bad = []
    for module, path in (modules() if found is None else found).items():
        forbidden = FORBIDDEN[layer_of(module)]
        for line, target in imported(module, path):
            if any(_within(target, f) for f in forbidden):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                bad.append(f"{where}:{line}: {module} ({layer_of(module)}) → {target}")
    return bad


def test_every_module_is_seen() -> None:
    found = modules()
    assert {"unroll.card", "unroll.export.onnx_export", "unroll.serving.gateway.app", "unroll.app.cli",
            "unroll.benchmarks.common", "unroll.pipeline"} <= set(found)
    assert layer_of("unroll.serving.gateway.app") == "unroll.serving" and layer_of("unroll.tasks") == "unroll"


def test_no_import_points_up_a_layer() -> None:
    bad = upward_imports()
    assert not bad, "imports that point up a layer (see this test's docstring for the layers):\n" + "\n".join(bad)


def test_the_walk_sees_function_local_and_relative_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from unroll import export\n    from . import sibling\n    import unroll.app.cli\n")
    assert [t for _, t in imported("unroll.serving.x.m", src)] == [
        "unroll.export", "unroll.serving.x.sibling", "unroll.app.cli"]


def test_a_planted_upward_import_is_caught_and_a_downward_one_is_not(tmp_path: Path) -> None:
    """The check fails where it should: modules planted in each layer, importing up (statement, function-local,
    ``importlib`` with a literal name) and down."""
    planted = {
        "unroll.planted_up": "import unroll.serving.triton\n",
        "unroll.export.planted_up": "def f():\n    from unroll.pipeline import plan\n",
        "unroll.serving.planted_up": "import importlib\nimportlib.import_module('unroll.app.cli')\n",
        "unroll.benchmarks.planted_up": "__import__('unroll.app.serve')\n",
        "unroll.app.planted_down": "from unroll.benchmarks import common\nimport unroll.card\n",
        "unroll.pipeline.planted_down": "from unroll.export import gates\nfrom unroll.serving import triton\n",
    }
    found = {}
    for name, text in planted.items():
        found[name] = tmp_path / f"{name.replace('.', '_')}.py"
        found[name].write_text(text)
    bad = upward_imports(found)
    assert sorted(line.split(": ", 1)[1].split(" (")[0] for line in bad) == sorted(
        n for n in planted if n.endswith("planted_up")), bad
    assert any("unroll.serving.planted_up (unroll.serving) → unroll.app.cli" in b for b in bad), bad


def import_cycles(found: dict[str, Path] | None = None) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a circle (every import counts, as above;
    ``from P import name`` resolves to the module ``P.name`` where there is one, else ``P``)."""
    found = modules() if found is None else found

    def resolve(target: str) -> str | None:
        while target and target not in found:
            target = target.rpartition(".")[0]
        return target or None

    graph = {m: {r for _, t in imported(m, p) if (r := resolve(t)) is not None and r != m} for m, p in found.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in graph:
        if v not in order:
            visit(v)
    return cycles


def test_no_circle_of_imports_in_the_core() -> None:
    """The card names a task and validates it against the task registry; the tasks read cards through a protocol of
    their own (``unroll.tasks.base.ModelCard``) and never import the card back."""
    core = {m: p for m, p in modules().items() if layer_of(m) == "unroll"}
    assert import_cycles(core) == []


def test_a_planted_circle_and_a_module_launch_are_seen(tmp_path: Path) -> None:
    planted = {"unroll.circle_a": "from unroll import circle_b\n",
               "unroll.circle_b": "def f():\n    import unroll.circle_a\n",
               "unroll.benchmarks.launcher": "import sys\nCMD = [sys.executable, '-m', 'unroll.app.serve', '--port']\n"}
    found = {}
    for name, text in planted.items():
        found[name] = tmp_path / f"{name.replace('.', '_')}.py"
        found[name].write_text(text)
    assert import_cycles(found) == [["unroll.circle_a", "unroll.circle_b"]]
    assert any("unroll.benchmarks.launcher (unroll.benchmarks) → unroll.app.serve" in b
               for b in upward_imports(found)), upward_imports(found)


@pytest.mark.parametrize("folder", [f for f in FOLDERS if f != "unroll"])
def test_each_stage_folder_says_what_it_installs_as(folder: str) -> None:
    init = ROOT / folder / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert f"``{FOLDERS[folder]}``" in doc, f"{init.relative_to(ROOT)}: its docstring should name {FOLDERS[folder]}"
