# unroll — the two commands a newcomer needs: `make serve` and `make test` (set-up included).
# `make help` lists the targets. Options go to `unroll serve` through ARGS (see `unroll serve --help`):
#   make serve ARGS="--models sdnet-mnist --port 8081 --workers 2"
# and the UNROLL_* variables it reads pass through the environment: UNROLL_MODELS=sdnet-mnist UNROLL_WORKERS=2 make serve
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: help venv check test serve bench lint clean docs docs-serve

$(STAMP): pyproject.toml scripts/editable_first.py
	@test -x $(PY) || { echo "==> creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "==> upgrading pip in $(VENV)"
	@$(PY) -m pip install -q --upgrade pip
	@echo "==> installing unroll with its serving and dev extras into $(VENV) (PyTorch, ONNX Runtime, Triton:"
	@echo "    about 2 minutes and a few GB on the first run; pip reports each package below)"
	$(PY) -m pip install --progress-bar on -e '.[serve,dev]'
	@$(PY) scripts/editable_first.py  # `import unroll` works from the folder above a clone named unroll
	@touch $(STAMP)
	@echo "==> $(VENV) is ready"

help:  ## list the targets (options for `make serve`: ARGS="…", see `unroll serve --help`)
	@awk -F':.*## ' '/^[a-z-]+:.*## / {printf "  make %-9s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

venv: $(STAMP)  ## create .venv and install unroll with its serving and dev extras

# TEST_WORKERS=N runs the test files in N processes (pytest-xdist, one file per worker at a time so a file's servers
# start once): about 20 minutes of pytest with 3 on 2 cores instead of 30 in one process (the suite needs about
# 41 CPU-minutes either way). Not the default: of four parallel runs in a row two passed, one found a gateway that
# answered 404 for a model it had not managed to read (fixed) and one met tritonserver's Python backend aborting
# while a version unloaded (boost lock_exception, upstream; the supervisor restarts it, but the deploy tests then
# fail) — load makes both likelier. 0: one process.
TEST_WORKERS ?= 0

# The inner loop: the `check` tier (tests/conftest.py's table: every test but those marked `full`, which own their
# servers for faults, restarts or memory, build images, train or benchmark), about 5 minutes of pytest on 2 cores
# where `make test` takes 35. A fresh clone's first run also pays the venv and the exports built on first use.
check: $(STAMP)  ## the inner loop: ruff, then the tests of the `check` tier (about 5 minutes; make test runs all)
	$(PY) -m ruff check unroll export serving benchmarks app pipeline tests examples scripts deploy
	$(PY) -m pytest -q -m check --durations=15

test: $(STAMP)  ## run the whole test suite (CI calls this); TEST_WORKERS=N test processes (default 0: one)
	$(PY) -m ruff check unroll export serving benchmarks app pipeline tests examples scripts deploy
	$(VENV)/bin/hadolint Dockerfile
	@echo "==> perf_analyzer (Triton's own client) in build/perf_analyzer-venv; its tests skip with the reason without it"
	-bash scripts/perf_analyzer_setup.sh
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile

serve: $(STAMP)  ## build what is missing, then start Triton and the REST gateway; options: ARGS="--port 8081 …"
	@echo "==> unroll serve: exports and the Triton repository are built first when missing (about a minute)"
	$(VENV)/bin/unroll serve $(ARGS)

bench: $(STAMP)  ## run the benchmarks and rewrite benchmarks/results/
	@echo "==> perf_analyzer (Triton's own client) in build/perf_analyzer-venv; without it the Triton-direct rows say why"
	-bash scripts/perf_analyzer_setup.sh
	$(VENV)/bin/unroll bench all

.PHONY: gpu-check
gpu-check:  ## GPU runtimes of the trained models → benchmarks/results/gpu_check.*; skips without CUDA; ARGS="--out DIR …"
	bash scripts/gpu_check.sh $(ARGS)

.PHONY: gpu-serve-check
gpu-serve-check:  ## unroll serve --target gpu measured → benchmarks/results/gpu_serve.*; skips without CUDA; ARGS="--device cpu …"
	bash scripts/gpu_serve_check.sh $(ARGS)

docs: $(STAMP)  ## the docs site: generated reference pages (CLI, REST) rewritten, then build/site (strict)
	$(PY) -m unroll.app.docs_reference --out docs/reference
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

docs-serve: $(STAMP)  ## serve the docs site at http://127.0.0.1:8008 while you edit (reloads on save)
	$(PY) -m unroll.app.docs_reference --out docs/reference
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --strict -a 127.0.0.1:8008

lint: $(STAMP)  ## ruff and hadolint
	$(PY) -m ruff check unroll export serving benchmarks app pipeline tests examples scripts deploy
	$(VENV)/bin/hadolint Dockerfile

clean:  ## remove build/ and the tool caches
	rm -rf build .pytest_cache .ruff_cache
