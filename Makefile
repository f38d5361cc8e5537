# unroll — the two commands a newcomer needs: `make serve` and `make test` (set-up included).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test serve bench lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || { echo "==> creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "==> upgrading pip in $(VENV)"
	@$(PY) -m pip install -q --upgrade pip
	@echo "==> installing unroll with its serving and dev extras into $(VENV) (PyTorch, ONNX Runtime, Triton:"
	@echo "    about 2 minutes and a few GB on the first run; pip reports each package below)"
	$(PY) -m pip install --progress-bar on -e '.[serve,dev]'
	@touch $(STAMP)
	@echo "==> $(VENV) is ready"

venv: $(STAMP)  ## create .venv and install unroll with its serving and dev extras

test: $(STAMP)  ## run the whole test suite (CI calls this)
	$(PY) -m ruff check unroll export serving benchmarks tests examples scripts deploy
	$(VENV)/bin/hadolint Dockerfile
	@echo "==> perf_analyzer (Triton's own client) in build/perf_analyzer-venv; its tests skip with the reason without it"
	-bash scripts/perf_analyzer_setup.sh
	$(PY) -m pytest -q --durations=15

serve: $(STAMP)  ## build what is missing, then start Triton and the REST gateway
	@echo "==> unroll serve: exports and the Triton repository are built first when missing (about a minute)"
	$(VENV)/bin/unroll serve

bench: $(STAMP)  ## run the benchmarks and rewrite benchmarks/results/
	@echo "==> perf_analyzer (Triton's own client) in build/perf_analyzer-venv; without it the Triton-direct rows say why"
	-bash scripts/perf_analyzer_setup.sh
	$(VENV)/bin/unroll bench all

lint: $(STAMP)
	$(PY) -m ruff check unroll export serving benchmarks tests examples scripts deploy
	$(VENV)/bin/hadolint Dockerfile

clean:
	rm -rf build .pytest_cache .ruff_cache
