"""``import unroll`` from the folder above a clone named ``unroll`` gets the installed package, not the clone folder.

The clone root has no ``__init__.py``: with the working directory first on ``sys.path`` (``python -c``, ``-m``),
a plain editable install resolves ``unroll`` to that folder as an empty namespace package
(``scripts/editable_first.py`` says why and what ``make venv`` installs against it).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_beside_clone(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Run this venv's python with ``args`` from a folder holding ``unroll`` → the clone root (as after a clone)."""
    (tmp_path / "unroll").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_python_c_from_the_clones_parent_imports_the_package(tmp_path: Path) -> None:
    r = _run_beside_clone(tmp_path, "-c", "import unroll, unroll.export; unroll.load; print(unroll.__file__)")
    assert r.returncode == 0, ("`import unroll` beside a clone folder named unroll did not get the package "
                               f"(is scripts/editable_first.py installed? run `make venv`):\n{r.stderr}")
    assert Path(r.stdout.strip()) == ROOT / "unroll" / "__init__.py"


def test_the_makefile_install_recipe_installs_the_fix() -> None:
    """A fresh clone gets it: the ``$(STAMP)`` recipe (``make venv``/``test``/``serve``) runs the script after pip."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(STAMP\):(?P<deps>.*)\n(?P<body>(?:\t.*\n)+)", text, re.M)
    assert recipe, "no $(STAMP) rule in the Makefile"
    body = recipe["body"]
    assert "scripts/editable_first.py" in recipe["deps"], "editing the script must re-run the install"
    assert body.index("pip install") < body.index("scripts/editable_first.py"), body
