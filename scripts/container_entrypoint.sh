#!/bin/sh
# CPU image entry point (Dockerfile target cpu; tini runs it as PID 1's child): `unroll serve` on the graphs and the
# Triton repository staged before the build. The gateway listens on 0.0.0.0:8080, Triton on 127.0.0.1 only.
# The served models are the ones staged (models.txt; UNROLL_MODELS overrides); extra arguments go to `unroll serve`
# (e.g. --log-level debug). exec: `unroll serve` gets SIGTERM directly and stops the gateway, then Triton.
set -eu
models="${UNROLL_MODELS:-$(cat /srv/unroll/models.txt)}"
exec unroll serve --host 0.0.0.0 --models "$models" "$@"
