#!/usr/bin/env bash
# Set up Triton's own load generator, perf_analyzer, in its own virtualenv (idempotent).
#
# perf_analyzer ships inside the tritonclient wheel. 2.47.0 is the newest release whose binary runs on this
# glibc; it pins numpy < 2, so it cannot share the project's .venv (NumPy 2). The binary links libb64
# (Debian's libb64-0d) and the CUDA runtime (libcudart.so.12, even on a CPU-only machine), which come from
# apt and from the nvidia-cuda-runtime-cu12 wheel; the wrapper it writes puts that wheel's lib dir on
# LD_LIBRARY_PATH.
#
#   scripts/perf_analyzer_setup.sh [VENV]      # default build/perf_analyzer-venv
#
# Result: VENV/bin/perf_analyzer-run (wrapper), which `unroll bench serve` (benchmarks/perf_analyzer.py) finds.
# Exits non-zero with one line saying what it could not do.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/build/perf_analyzer-venv}"
PY="${PYTHON:-python3.11}"
TRITONCLIENT_VERSION="2.47.0"
WRAPPER="$VENV/bin/perf_analyzer-run"

fail() { echo "perf_analyzer_setup: $*" >&2; exit 1; }

command -v "$PY" >/dev/null 2>&1 || PY=python3
command -v "$PY" >/dev/null 2>&1 || fail "no python3.11 or python3 on PATH to create $VENV"

# 1. libb64 (Debian's libb64-0d), unless some libb64.so.0d is already known to the loader
if ! ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get install -y -q libb64-0d >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libb64-0d >/dev/null 2>&1; }; } \
      || fail "could not apt-get install libb64-0d (perf_analyzer links libb64.so.0d)"
  else
    fail "libb64.so.0d is missing and this is not root with apt-get: install Debian's libb64-0d"
  fi
fi

# 2. the virtualenv with tritonclient[all] (perf_analyzer binary) and the CUDA runtime libraries
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || fail "could not create the virtualenv $VENV with $PY"
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; \
sys.exit(m.version('tritonclient') != '$TRITONCLIENT_VERSION')" 2>/dev/null \
   || ! "$VENV/bin/python" -c "import nvidia.cuda_runtime" 2>/dev/null; then
  # the project's pip constraints (torch caps) do not concern this venv
  PIP_CONSTRAINT="" "$VENV/bin/pip" install -q "tritonclient[all]==$TRITONCLIENT_VERSION" "numpy<2" \
    nvidia-cuda-runtime-cu12 \
    || fail "pip could not install tritonclient[all]==$TRITONCLIENT_VERSION and nvidia-cuda-runtime-cu12 into $VENV"
fi

# 3. the wrapper: the CUDA runtime wheel's lib dir on LD_LIBRARY_PATH, then the real binary
CUDA_LIB="$("$VENV/bin/python" -c "import nvidia.cuda_runtime, os; \
print(os.path.join(list(nvidia.cuda_runtime.__path__)[0], 'lib'))")" \
  || fail "nvidia-cuda-runtime-cu12 is installed in $VENV but its lib dir cannot be found"
[ -x "$VENV/bin/perf_analyzer" ] || fail "tritonclient[all]==$TRITONCLIENT_VERSION installed no bin/perf_analyzer"
cat > "$WRAPPER" <<EOF
#!/usr/bin/env bash
# written by scripts/perf_analyzer_setup.sh: perf_analyzer with the CUDA runtime wheel's libraries
export LD_LIBRARY_PATH="$CUDA_LIB\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$VENV/bin/perf_analyzer" "\$@"
EOF
chmod +x "$WRAPPER"

# 4. it must actually start (a missing shared library shows here, not in the middle of a benchmark)
if ! out="$("$WRAPPER" --version 2>&1)" || ! grep -q "Perf Analyzer Version" <<<"$out"; then
  fail "$WRAPPER does not run: $(grep -m1 -i 'error\|cannot' <<<"$out" || echo "${out:0:200}")"
fi
echo "$WRAPPER"
