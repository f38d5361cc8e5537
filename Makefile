# unroll — the two commands a newcomer needs: `make serve` and `make test` (set-up included).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test serve bench lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[serve,dev]'
	@touch $(STAMP)

venv: $(STAMP)  ## create .venv and install unroll with its serving and dev extras

test: $(STAMP)  ## run the whole test suite (CI calls this)
	$(PY) -m ruff check unroll export serving benchmarks tests
	$(PY) -m pytest -q --durations=15

serve: $(STAMP)  ## build what is missing, then start Triton and the REST gateway
	$(VENV)/bin/unroll serve

bench: $(STAMP)  ## run the benchmarks and rewrite benchmarks/results/
	$(VENV)/bin/unroll bench all

lint: $(STAMP)
	$(PY) -m ruff check unroll export serving benchmarks tests

clean:
	rm -rf build .pytest_cache .ruff_cache
