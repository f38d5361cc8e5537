#!/usr/bin/env bash
# The GPU check (issue 25): every GPU-dependent measurement in one run, results into benchmarks/results/
# (gpu_check.json + gpu_check.md) or --out DIR. Without a CUDA GPU it says why and exits 0, writing nothing.
#
# Runs from a plain checkout, without `pip install -e .` (the GPU machine's PyTorch is not the pinned one):
# `unroll` is imported from the checkout and the folders that install as its subpackages (benchmarks/ as
# unroll.benchmarks, ...) are added to its package path by the small bootstrap below. Python packages the
# machine lacks (pydantic, mlxtend) travel as wheels in .whl/ and are unpacked into a scratch folder first.
#
# Usage: scripts/gpu_check.sh [--out DIR] [--device cpu] [--quick] [...]  (`--help` lists the options)
# Environment: PYTHON (default: .venv/bin/python when present, else python3), UNROLL_WHEELS (default: .whl).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
WHEELS="${UNROLL_WHEELS:-$ROOT/.whl}"
export PYTHONUNBUFFERED=1

# Wheels for what this interpreter lacks (only when something is missing, so a full install is left alone).
if compgen -G "$WHEELS/*.whl" >/dev/null && ! "$PYTHON" -c "import pydantic, mlxtend" 2>/dev/null; then
    SITE="$(mktemp -d "${TMPDIR:-/tmp}/unroll-site.XXXXXX")"
    trap 'rm -rf "$SITE"' EXIT
    echo "==> unpacking $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

# Bootstrap: `unroll` from this checkout; when it is not installed, the repository root joins its package path,
# so unroll.benchmarks, unroll.export ... resolve to the top-level folders as pyproject's package-dir maps them.
check() {
"$PYTHON" - "$ROOT" "$@" <<'EOF'
import importlib.util
import runpy
import sys

root = sys.argv[1]
sys.argv = ["unroll.benchmarks.gpu_check", *sys.argv[2:]]
sys.path.insert(0, root)
import unroll  # noqa: E402

if importlib.util.find_spec("unroll.benchmarks") is None:
    unroll.__path__.append(root)
runpy.run_module("unroll.benchmarks.gpu_check", run_name="__main__", alter_sys=True)
EOF
}

# A candidate that crashes the process in native code (seen: AOTInductor's package load) must not end the check:
# the run is resumed, keeping the rows written so far and recording that candidate as an error.
resume=()
for attempt in 1 2 3 4; do
    rc=0
    check "$@" "${resume[@]}" || rc=$?
    if (( rc <= 128 )); then exit "$rc"; fi
    echo "==> gpu_check: the process died with signal $((rc - 128)); resuming (attempt $((attempt + 1)))" >&2
    resume=(--resume)
done
exit "$rc"
