#!/bin/bash
# GPU image entry point (Dockerfile target gpu, on NVIDIA's Triton container). NOT RUN in this repository's CI: no GPU
# and no NVIDIA registry there. What it does:
#   1. prints the TensorRT and GPU this container sees (an engine or plan only loads on the TensorRT version and GPU
#      it was built for);
#   2. starts the image's tritonserver on 127.0.0.1 with the GPU repository (UNROLL_REPOSITORY, default the staged
#      model_repository_gpu: onnxruntime_onnx with the TensorRT accelerator, so TensorRT engines are built on THIS
#      GPU while the models load and cached under /tmp/unroll-trt-cache — mount a volume there to keep them; a
#      repository with `unroll build` plans, mounted over it, is served as it is), every API but health locked
#      behind a key made for this start, as `unroll serve` does;
#   3. waits for Triton to be ready (UNROLL_TRITON_START_TIMEOUT_S, default 600: engine builds take minutes), then
#      runs the gateway on 0.0.0.0:8080 (python -m unroll.serving.gateway) with that key;
#   4. stops both on SIGTERM/SIGINT, and exits when either one exits (the orchestrator restarts the container).
# Triton's metrics stay on 127.0.0.1:8002 unless UNROLL_TRITON_METRICS_ADDRESS says otherwise (0.0.0.0 for a
# Prometheus scrape: counts and latencies, no data).
set -euo pipefail

repo="${UNROLL_REPOSITORY:-/srv/unroll/model_repository_gpu}"
timeout_s="${UNROLL_TRITON_START_TIMEOUT_S:-600}"
metrics_address="${UNROLL_TRITON_METRICS_ADDRESS:-127.0.0.1}"

trt=$(find /usr/lib /usr/local -name 'libnvinfer.so.*.*.*' 2>/dev/null | head -n 1 || true)
echo "unroll-gpu: TensorRT library: ${trt:-not found}"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null \
  | sed 's/^/unroll-gpu: GPU: /' || echo "unroll-gpu: nvidia-smi not available (is the GPU passed to the container?)"

# The engine and timing cache folders the repository's configs name (ONNX Runtime's TensorRT provider writes there).
grep -rh -A1 -E '"trt_(engine|timing)_cache_path"' "$repo"/*/config.pbtxt 2>/dev/null \
  | sed -n 's/.*value: "\(.*\)".*/\1/p' | sort -u | xargs -r mkdir -p || true

key=$(python -c 'from unroll.serving.triton import new_api_key; print(new_api_key())')
mapfile -t locked < <(python -c 'import sys
from unroll.serving.triton import restricted_api_args
print("\n".join(restricted_api_args(sys.argv[1])))' "$key")

tritonserver --model-repository="$repo" --strict-readiness=true --exit-on-error=true --exit-timeout-secs=5 \
  --http-address=127.0.0.1 --http-port=8000 --grpc-address=127.0.0.1 --grpc-port=8001 \
  --metrics-address="$metrics_address" --metrics-port=8002 "${locked[@]}" &
triton=$!
gateway=""

stop() {
  if [ -n "$gateway" ]; then kill -TERM "$gateway" 2>/dev/null || true; fi
  kill -TERM "$triton" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap 'stop; exit 0' TERM INT

deadline=$((SECONDS + timeout_s))
until python -c 'import sys, urllib.request as u; sys.exit(u.urlopen("http://127.0.0.1:8000/v2/health/ready", timeout=2).status != 200)' 2>/dev/null; do
  if ! kill -0 "$triton" 2>/dev/null; then
    echo "unroll-gpu: tritonserver exited during start-up (its log is above)" >&2
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "unroll-gpu: tritonserver not ready after ${timeout_s} s" >&2
    stop
    exit 1
  fi
  sleep 2
done

UNROLL_TRITON_URL=127.0.0.1:8001 UNROLL_TRITON_PROTOCOL=grpc UNROLL_TRITON_API_KEY="$key" \
  python -m unroll.serving.gateway --host 0.0.0.0 --port 8080 &
gateway=$!
wait -n "$triton" "$gateway" || true
echo "unroll-gpu: $(kill -0 "$triton" 2>/dev/null && echo gateway || echo tritonserver) exited; stopping" >&2
stop
exit 1
