# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-shared test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[torch,dev]"
	touch $(STAMP)

# The main job: fine-tune GPT-2's last block, checkpointing into ./demo-vault.
demo: $(STAMP)
	$(BIN)/python examples/finetune.py

# The three seed scenarios (shared layers, renamed/subset loads, a frozen kernel).
demo-shared: $(STAMP)
	$(BIN)/python examples/shared_weights.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

typecheck: $(STAMP)
	$(BIN)/mypy

# pytest exits 5 when it collects no test; that is a failure here, never a pass.
unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python bench/bench_save_load.py

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache
