# syntax=docker/dockerfile:1
# unroll serving images, two targets (README "Deploy"):
#
#   cpu  the bundled tritonserver (from the nvidia-pytriton wheel: server, Python backend, libraries) + the
#        Python-backend models (ONNX Runtime) + the REST gateway, all run by `unroll serve --host 0.0.0.0`;
#        Triton listens on 127.0.0.1 inside, the gateway on :8080. No PyTorch, no compilers, non-root.
#   gpu  NVIDIA's Triton container + the GPU repository (`unroll repo --target gpu`) + the gateway.
#
# Both serve graphs exported BEFORE the build: `python -m unroll.app.container stage` writes build/image/ (the
# graphs, both repositories, the served model names), which is all of the build context that is not source.
#
#   python -m unroll.app.container stage
#   podman build --format docker --target cpu -t unroll:cpu \
#       --secret id=pipcert,src=/etc/ssl/certs/ca-certificates.crt .
#
# (--format docker keeps the HEALTHCHECK; the secret is the CA bundle pip trusts inside the build, for machines
# that reach the package index through a TLS-inspecting proxy; without it pip uses its own bundle.)
# scripts/container_setup.sh does all of this from a local Debian base (BASE_IMAGE) and caches the result.

# A pinned Debian 12 (bookworm); scripts/container_setup.sh passes a local debootstrap minbase import instead.
ARG BASE_IMAGE=docker.io/library/debian:bookworm-20250520-slim
# Triton 24.08 (server 2.49.0): CUDA 12.6, TensorRT 10.3.0 (10.3.0.26), ONNX Runtime 1.18.1, Ubuntu 22.04 with
# Python 3.10 (sources: the 24.08 release notes for CUDA; Triton's docs/introduction/compatibility.md for TensorRT,
# listed for the 24.08 trtllm-python-py3 image, and for ONNX Runtime). A TensorRT plan only loads on the TensorRT
# version it was built with: build plans with TensorRT 10.3 (`pip install tensorrt==10.3.0`) or let this image
# build its own engines (the default, see scripts/container_gpu_entrypoint.sh). NOT BUILT OR RUN in this
# repository's CI (no NVIDIA registry, no GPU); hadolint checks it.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.08-py3

# ------------------------------------------------------------------------------------------------ builder
# The dependencies: rebuilt only when requirements/serve-image.txt changes (the source is installed in `app`).
FROM ${BASE_IMAGE} AS builder
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The base image's date pins the Debian release; package versions are left to it (they move with point releases).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/unroll
ENV PATH=/opt/unroll/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
COPY requirements/serve-image.txt /tmp/serve-image.txt
# Every dependency is pinned in the file and installed as listed (--no-deps): no resolver surprises, no PyTorch.
# Then keep only what the server needs from nvidia-pytriton (tritonserver/, and utils/distribution.py, which
# unroll.serving.triton loads to find it) and this Python's stub, and move pip and setuptools out of the venv
# (the app stage still uses them from /opt/pip; the images do not get them).
RUN --mount=type=secret,id=pipcert --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    if [ -s /run/secrets/pipcert ]; then export PIP_CERT=/run/secrets/pipcert; fi \
 && pip install --no-deps -r /tmp/serve-image.txt \
 && site=/opt/unroll/lib/python3.11/site-packages \
 && find "$site/pytriton" -mindepth 1 -maxdepth 1 ! -name tritonserver ! -name utils ! -name __init__.py \
        -exec rm -rf {} + \
 && find "$site/pytriton/tritonserver/python_backend_stubs" -mindepth 1 -maxdepth 1 ! -name 3.11 -exec rm -rf {} + \
 && rm -rf "$site/pytriton/tritonserver/caches" \
 && mkdir /opt/pip \
 && find "$site" -mindepth 1 -maxdepth 1 \( -name pip -o -name 'pip-*' -o -name 'setuptools*' \
        -o -name _distutils_hack -o -name distutils-precedence.pth \) -exec mv -t /opt/pip {} + \
 && rm -f /opt/unroll/bin/pip*

# ------------------------------------------------------------------------------------------------ app
# unroll itself, installed under /opt/app (a few MB) so that a source change rebuilds only this small layer.
FROM builder AS app
COPY pyproject.toml README.md /src/
COPY unroll /src/unroll
COPY export /src/export
COPY serving /src/serving
COPY benchmarks /src/benchmarks
COPY app /src/app
COPY pipeline /src/pipeline
RUN --mount=type=secret,id=pipcert --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    if [ -s /run/secrets/pipcert ]; then export PIP_CERT=/run/secrets/pipcert; fi \
 && PYTHONPATH=/opt/pip python -m pip install --no-deps --prefix /opt/app /src

# ------------------------------------------------------------------------------------------------ cpu
FROM ${BASE_IMAGE} AS cpu
ENV DEBIAN_FRONTEND=noninteractive
# python3.11 + libpython3.11 (the Python-backend stub embeds it); tini reaps Triton's stubs and forwards signals.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 libpython3.11 tini \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log \
 && groupadd --gid 10001 unroll \
 && useradd --uid 10001 --gid 10001 --home-dir /srv/unroll --no-create-home --shell /usr/sbin/nologin unroll \
 && install -d -o unroll -g unroll /srv/unroll /srv/unroll/build
COPY --from=builder /opt/unroll /opt/unroll
COPY --from=app /opt/app/lib/python3.11/site-packages/ /opt/unroll/lib/python3.11/site-packages/
COPY --from=app /opt/app/bin/unroll /opt/unroll/bin/unroll
ENV PATH=/opt/unroll/bin:$PATH
# The Python-backend stub goes beside the wheel's backend once, here; the serving path imports without PyTorch.
RUN python -c 'from unroll.serving.triton import server_layout; print(server_layout())' \
 && python -c 'import sys, onnxruntime, unroll.app.serve, unroll.serving.gateway; assert "torch" not in sys.modules'
WORKDIR /srv/unroll
# The served graphs and the CPU repository written from them (newer than the graphs: `unroll serve` keeps it).
COPY --chown=unroll:unroll build/image/onnx build/onnx
COPY --chown=unroll:unroll build/image/model_repository model_repository
COPY --chown=unroll:unroll build/image/models.txt models.txt
COPY scripts/container_entrypoint.sh /usr/local/bin/unroll-entrypoint
ENV PYTHONUNBUFFERED=1 \
    HOME=/srv/unroll \
    XDG_CACHE_HOME=/srv/unroll/.cache
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8080/readyz', timeout=4).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/unroll-entrypoint"]

# ------------------------------------------------------------------------------------------------ gpu
FROM ${TRITON_IMAGE} AS gpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The gateway needs Python 3.11 (pyproject's requires-python); the NGC image has 3.10, so uv installs a standalone
# 3.11 next to it (Assumption: the image has python3 with pip, as Triton's py3 images do for the Python backend).
ARG UV_VERSION=0.13.8
ENV UV_PYTHON_INSTALL_DIR=/opt/uv-python \
    UV_NO_CACHE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
COPY requirements/serve-image.txt /tmp/serve-image.txt
RUN --mount=type=secret,id=pipcert \
    if [ -s /run/secrets/pipcert ]; then export PIP_CERT=/run/secrets/pipcert SSL_CERT_FILE=/run/secrets/pipcert; fi \
 && python3 -m pip install --no-cache-dir "uv==${UV_VERSION}" \
 && uv venv --python 3.11 /opt/unroll \
 && uv pip install --python /opt/unroll/bin/python --no-deps -r /tmp/serve-image.txt
COPY pyproject.toml README.md /src/
COPY unroll /src/unroll
COPY export /src/export
COPY serving /src/serving
COPY benchmarks /src/benchmarks
COPY app /src/app
COPY pipeline /src/pipeline
RUN --mount=type=secret,id=pipcert \
    if [ -s /run/secrets/pipcert ]; then export SSL_CERT_FILE=/run/secrets/pipcert; fi \
 && uv pip install --python /opt/unroll/bin/python --no-deps /src \
 && rm -rf /src \
 && groupadd --gid 10001 unroll \
 && useradd --uid 10001 --gid 10001 --home-dir /srv/unroll --no-create-home --shell /usr/sbin/nologin unroll \
 && install -d -o unroll -g unroll /srv/unroll
WORKDIR /srv/unroll
COPY --chown=unroll:unroll build/image/model_repository_gpu model_repository_gpu
COPY scripts/container_gpu_entrypoint.sh /usr/local/bin/unroll-gpu-entrypoint
ENV PATH=/opt/unroll/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/srv/unroll
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8080/readyz', timeout=4).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/unroll-gpu-entrypoint"]
