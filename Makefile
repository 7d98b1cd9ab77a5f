# Two entry points: `make demo` and `make test`. Each creates ./.venv on first use and
# installs everything into it (the CPU wheel of torch is pinned here, for dev and CI only;
# the library itself requires torch>=2.4).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_DEV := torch==2.13.0

.PHONY: install demo test lint docs bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_DEV)
	$(BIN)/python -m pip install --quiet -e '.[dev]' $(TORCH_DEV)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/multihead.py

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --quiet

test: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest
	$(BIN)/mkdocs build --strict --quiet

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]' $(TORCH_DEV)
	$(BIN)/python -m benchmarks.run $(ARGS)

clean:
	rm -rf $(VENV) site

# The figures in docs/img come from full runs of the examples; the examples themselves
# write into ./out/<example>/ and never touch docs/img unless told to, as here. Takes
# minutes, most of them the RL example's (docs/examples.md lists each one's time).
.PHONY: figures
figures: $(STAMP)
	$(BIN)/python examples/deep_ensemble_regression.py --out docs/img
	$(BIN)/python examples/lr_sweep.py --out docs/img
	$(BIN)/python examples/digits_ensemble.py --out docs/img
	$(BIN)/python examples/rl_q_ensemble.py --out docs/img
