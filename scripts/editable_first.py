"""Make the editable ``unroll`` win over a folder named ``unroll`` in the working directory (run by ``make venv``).

Why: setuptools serves the ``package-dir`` mapping (``export/`` → ``unroll.export`` …) with an import finder it
appends after ``PathFinder``, so from the folder above a clone named ``unroll``, ``import unroll`` finds the clone as
an empty namespace package (pypa/setuptools#3557). This writes ``unroll-editable-first.pth`` into site-packages,
which runs after setuptools' own ``.pth`` and moves that finder before ``PathFinder``; it answers only for
``unroll``, so no other import changes. Usage: ``.venv/bin/python scripts/editable_first.py``.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

#: Sorts after setuptools' ``__editable__.unroll-<version>.pth`` ('u' > '_'), so its finder is installed first.
PTH_NAME = "unroll-editable-first.pth"
#: The module prefix of setuptools' generated finder (``__editable___unroll_0_1_0_finder``).
FINDER_PREFIX = "__editable___unroll_"
#: One line (``site`` executes ``.pth`` lines that start with ``import``): move the editable finder(s) in front of
#: PathFinder, keeping their order.
PTH_LINE = (
    "import sys, importlib.machinery as _m; "
    f"_f = [x for x in sys.meta_path if getattr(x, '__module__', '').startswith({FINDER_PREFIX!r})]; "
    "[sys.meta_path.remove(x) for x in _f]; "
    "_i = sys.meta_path.index(_m.PathFinder) if _m.PathFinder in sys.meta_path else len(sys.meta_path); "
    "sys.meta_path[_i:_i] = _f\n"
)


def install(site_packages: Path | None = None) -> Path:
    """Write the ``.pth`` into ``site_packages`` (default: this interpreter's purelib); returns its path."""
    target = Path(site_packages or sysconfig.get_path("purelib")) / PTH_NAME
    target.write_text(PTH_LINE)
    return target


if __name__ == "__main__":
    print(f"==> {install()}: the editable unroll wins over a folder named unroll in the working directory")
