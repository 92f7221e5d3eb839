# xnn: two commands on a fresh Linux machine
#   make demo   - set up .venv, generate EMT data, train, evaluate, run MD, write plots
#   make test   - set up .venv, run the whole test suite
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.xnn-installed
# On a machine without an NVIDIA GPU take the local CPU wheel of torch; with one, the default CUDA build.
TORCH_SPEC ?= $(shell if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo torch; else echo torch==2.13.0; fi)
PYTEST_ARGS ?=
DEMO_OUT ?= demo_output

.PHONY: setup demo test test-all lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install_extras.sh
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	bash scripts/install_extras.sh $(BIN)/python
	@touch $(STAMP)
	@echo "xnn is installed in $(VENV); to put the xnn command on your PATH: source $(VENV)/bin/activate"

demo: setup
	$(BIN)/xnn demo --out $(DEMO_OUT)

test: setup
	@$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: this is a failure"; exit 1; fi; exit $$rc

test-all: setup
	$(BIN)/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check xnn tests benchmarks

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache
