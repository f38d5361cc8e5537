#!/usr/bin/env bash
# The GPU serving check (issue 37): `unroll serve --target gpu` — the real tritonserver running each model's PyTorch
# module on the GPU, and the gateway with workers sized to the machine's cores — measured from outside (Triton direct
# with tensors and with image bytes, the gateway; concurrency 1, 64 and 256; batches formed, GPU utilisation, CPU per
# request per process; in-process times beside; parity on the cards' gate data), then everything stopped. Results:
# benchmarks/results/gpu_serve.{json,md} (or --out DIR). Without a CUDA GPU it says why and exits 0, writing nothing.
#
# On a lent GPU machine (plain checkout, no pip install, no network) it first sets up what travelled in .gpu_pack/
# (scripts/gpu_serve_pack.sh, run beforehand on the developer's machine): a virtual environment over the machine's own
# Python packages (PyTorch there is not the pinned one) holding the carried wheels, the tritonserver pieces and a
# finder that imports `unroll` from this checkout as `pip install -e .` maps it (the Triton stub, which ignores
# PYTHONPATH, finds the same through that environment), an `unroll` command, and the exported graphs in build/onnx.
# Where this interpreter already has everything (a full `make venv`), nothing is set up.
#
# Usage: scripts/gpu_serve_check.sh [--out DIR] [--device cpu] [--quick] [--workers N] [--client-procs N] [...]
#        (`--help` lists the options; --device cpu runs the same check on `unroll serve --target cpu`: the tests' dry run)
# A dry run of the set-up on this machine (done before the first GPU run; it found a missing wheel): a pack for this
# machine's Python (`scripts/gpu_serve_pack.sh --python 3.11 --out /tmp/pack311`), a bare virtualenv holding only what
# the lent machine has (its KINDS.md list: torch, numpy, onnxruntime, Pillow, httpx, uvloop, grpcio, scikit-image,
# scikit-learn ...; openvino too, since --device cpu serves the cards' CPU runtimes), then from a fresh clone
# `PYTHON=that/bin/python UNROLL_GPU_PACK=/tmp/pack311 scripts/gpu_serve_check.sh --device cpu --quick --out DIR`.
# Environment: PYTHON (default: .venv/bin/python when present, else python3), UNROLL_GPU_PACK (default: .gpu_pack),
#              UNROLL_GPU_SERVE_LIMIT_S (default 470: the check is stopped past it, so one 8-minute run holds it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
PACK="${UNROLL_GPU_PACK:-$ROOT/.gpu_pack}"
LIMIT_S="${UNROLL_GPU_SERVE_LIMIT_S:-470}"
export PYTHONUNBUFFERED=1
START=$SECONDS

device=cuda
prev=""
for arg in "$@"; do
    [[ "$prev" == "--device" ]] && device="$arg"
    [[ "$arg" == --device=* ]] && device="${arg#--device=}"
    [[ "$arg" == "-h" || "$arg" == "--help" ]] && device=help
    prev="$arg"
done

# No CUDA: say why, write nothing (before any set-up, which would be wasted).
if [[ "$device" == "cuda" ]]; then
    why="$("$PYTHON" - <<'EOF' 2>&1 || true
try:
    import torch
except ImportError as e:
    print(f"PyTorch is not importable ({e})")
else:
    if not torch.cuda.is_available():
        print(f"torch {torch.__version__} sees no CUDA device" if torch.version.cuda
              else f"torch {torch.__version__} is a CPU-only build")
EOF
)"
    if [[ -n "$why" ]]; then
        echo "gpu_serve: skipped, no CUDA GPU here: $why. Nothing written."
        exit 0
    fi
fi

ready() {  # whether $1 imports everything the check needs and has the `unroll` command beside it
    [[ -x "$(dirname "$1")/unroll" ]] && "$1" -c "import unroll.benchmarks.gpu_serve, fastapi, uvicorn, tritonclient.grpc, \
pydantic_settings, typer, onnx, h11, pytriton" 2>/dev/null
}

if [[ "$device" != "help" ]] && ! ready "$PYTHON"; then
    [[ -f "$PACK/triton.tar.xz" ]] || { echo "gpu_serve: $PYTHON lacks what the check needs and there is no pack at \
$PACK: run scripts/gpu_serve_pack.sh on a machine with the project's .venv and carry .gpu_pack" >&2; exit 1; }
    VENV="${TMPDIR:-/tmp}/unroll-gpu-serve-venv"
    echo "==> setting up $VENV over $("$PYTHON" -c 'import sys; print(sys.prefix)')'s packages from $PACK"
    rm -rf "$VENV"
    "$PYTHON" -m venv --without-pip "$VENV"
    SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE" "$PACK"/wheels/*.whl
    tar -xJf "$PACK/triton.tar.xz" -C "$SITE"
    ln -sfn ../../nvidia_pytriton.libs "$SITE/pytriton/tritonserver/external_libs"  # pytriton's other layout
    "$PYTHON" - "$ROOT" "$SITE" <<'EOF'
import site
import sys
import tomllib
from pathlib import Path

root, target = Path(sys.argv[1]), Path(sys.argv[2])
dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
# this interpreter's packages (PyTorch, NumPy …) under the carried ones, their own .pth files processed
parents = [p for p in site.getsitepackages() if Path(p).is_dir() and Path(p) != target]
# (a .pth line runs in exec's scope, where a comprehension before Python 3.12 cannot see `site`: map instead)
(target / "_unroll_parent.pth").write_text(f"import site; list(map(site.addsitedir, {parents!r}))\n")
(target / "_unroll_checkout.py").write_text(f'''"""`unroll` from the checkout {root}, mapped as pyproject's package-dir says."""
import importlib.util
import sys

ROOT, DIRS = {str(root)!r}, {dirs!r}


class _Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in DIRS:
            return None
        folder = f"{{ROOT}}/{{DIRS[name]}}"
        return importlib.util.spec_from_file_location(name, f"{{folder}}/__init__.py",
                                                      submodule_search_locations=[folder])


sys.meta_path.insert(0, _Finder)
''')
(target / "_unroll_checkout.pth").write_text("import _unroll_checkout\n")
EOF
    printf '#!%s\nimport sys\nfrom unroll.app.cli import main\nsys.exit(main())\n' "$VENV/bin/python" >"$VENV/bin/unroll"
    chmod +x "$VENV/bin/unroll"
    if [[ -f "$PACK/onnx.tar.xz" ]]; then
        mkdir -p "$ROOT/build/onnx"
        tar -xJf "$PACK/onnx.tar.xz" -C "$ROOT/build/onnx"
    fi
    PYTHON="$VENV/bin/python"
    missing="$("$PYTHON" - <<'EOF'
import importlib
bad = []
for m in ("unroll.benchmarks.gpu_serve", "fastapi", "uvicorn", "tritonclient.grpc", "pydantic_settings", "typer", "onnx",
          "onnxruntime", "h11", "httpx", "uvloop", "pynvml", "PIL", "skimage", "mlxtend", "pytriton"):
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001
        bad.append(f"{m} ({type(e).__name__}: {e})")
print("; ".join(bad))
EOF
)"
    if [[ -n "$missing" ]]; then
        echo "gpu_serve: still missing after the set-up: $missing" >&2
        exit 1
    fi
    echo "==> set up in $((SECONDS - START)) s"
fi

if [[ "$device" == "cuda" ]]; then
    # The Python backend talks to its stubs through /dev/shm; the stub needs this Python's libpython.
    "$PYTHON" - <<'EOF' || true
import subprocess, sysconfig
from multiprocessing import shared_memory
from pathlib import Path
try:
    s = shared_memory.SharedMemory(create=True, size=64 * 2**20)
    s.buf[:4] = b"ok!!"
    s.close(); s.unlink()
    print("==> /dev/shm: a 64 MiB region was created, written and removed")
except OSError as e:
    print(f"==> /dev/shm does NOT work here ({e}): Triton's Python backend cannot start its stubs")
lib = Path(sysconfig.get_config_var("LIBDIR") or "/") / (sysconfig.get_config_var("INSTSONAME") or "libpython3.so")
print(f"==> libpython for the stub: {lib} {'found' if lib.exists() else 'MISSING: the stub will look for the system one'}")
EOF
fi

# The issue's ViT with VARS attention at 224² has no committed weights, so the torch runtime does not serve it: it is
# timed in-process only (random weights), unless the command line names another model for that.
extra=(--timed-only rvt-tiny-vars-d:224)
for arg in "$@"; do [[ "$arg" == --timed-only* ]] && extra=(); done
rc=0
timeout --signal=TERM --kill-after=20 "$LIMIT_S" "$PYTHON" -m unroll.benchmarks.gpu_serve "$@" "${extra[@]}" || rc=$?
if (( rc == 124 )); then
    echo "gpu_serve: stopped after ${LIMIT_S} s (UNROLL_GPU_SERVE_LIMIT_S); what was measured so far is in the results" >&2
fi
exit "$rc"
