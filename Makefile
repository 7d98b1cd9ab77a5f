# Two entry points: `make demo` and `make test`. Each creates ./.venv on first use and
# installs everything into it (the CPU wheel of torch is pinned here, for dev and CI only;
# the library itself requires torch>=2.6). `make test-oldest` runs the tests again in
# ./.venv-oldest, on the oldest versions pyproject.toml allows, and `make test-newest` in
# ./.venv-newest, on the newest torch release it allows (CI runs all three).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_DEV := torch==2.13.0
# The floors of pyproject.toml's dependencies, exactly (tests/test_versions.py checks
# that they agree). torch 2.6.0 has no CPU-only wheel on PyPI: this is the CUDA build,
# which runs on the CPU.
OLDEST := torch==2.6.0 optree==0.13.0 numpy==1.24.4 jaxtyping==0.2.37 safetensors==0.4.0
# Python 3.10 too, where the machine has it (pyenv's, as on CI's machine, or a plain
# python3.10); otherwise the default $(PYTHON). test-oldest prints which one ran.
PYTHON_OLDEST ?= $(shell PYENV_VERSION=3.10 python3.10 -c 'import sys; print(sys.executable)' 2>/dev/null || echo $(PYTHON))
# pytest's worker processes (pytest-xdist): the suite is mostly single-threaded Python,
# so two workers on CI's two cores take about half the time of one. 0 runs in-process.
PYTEST_WORKERS ?= 2
OLD_VENV := .venv-oldest
OLD_STAMP := $(OLD_VENV)/.installed
# The newest torch release CI tests: pyproject.toml caps torch below its next minor
# release (tests/test_versions.py checks that they agree). Its CUDA build, as PyPI has it
# (about 5.5 GB installed), runs on the CPU. Some machines cap what pip installs in a
# config file of their own (/etc/xdg/pip: torch up to 2.14.1, the releases they hold on
# disk); this install alone sets that constraint aside, to fetch the newer one from PyPI.
TORCH_NEWEST := torch==2.15.0
NEWEST_PIP := PIP_CONSTRAINT=/dev/null
NEW_VENV := .venv-newest
NEW_STAMP := $(NEW_VENV)/.installed

.PHONY: install demo test test-oldest test-newest lint docs bench clean

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
	$(BIN)/mkdocs build --strict

test: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS)
	$(BIN)/mkdocs build --strict

# torch 2.6.0's CUDA build is about 5 GB installed; .ci/lean_install.py installs it one
# wheel at a time with no pip cache (a plain install needs about twice that disk), and
# `df` says beforehand how much disk there is, should it still run out.
$(OLD_STAMP): pyproject.toml Makefile .ci/lean_install.py
	$(PYTHON_OLDEST) -m venv --clear $(OLD_VENV)
	@df -h . | tail -1 | awk '{print "disk free before the oldest install: " $$4}'
	$(OLD_VENV)/bin/python .ci/lean_install.py $(firstword $(OLDEST))
	$(OLD_VENV)/bin/python -m pip install --quiet --no-cache-dir -e '.[dev]' $(OLDEST)
	touch $(OLD_STAMP)

# The test suite less its slow and multi-process tests (the compiled steps, which torch
# 2.6 cannot trace; the long example runs; the runs of several ranks, whose start-up
# deadlines the 5 GB CUDA build of torch overran on a loaded 2-core machine, and which
# sometimes hang at exit on torch 2.6: docs/how-to/versions.md), on the oldest supported
# versions.
test-oldest: $(OLD_STAMP)
	$(OLD_VENV)/bin/python -c 'import sys, torch; print("oldest versions: Python", sys.version.split()[0], "torch", torch.__version__)'
	$(OLD_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) -m "not slow and not multiprocess"

$(NEW_STAMP): pyproject.toml Makefile .ci/lean_install.py
	$(PYTHON) -m venv --clear $(NEW_VENV)
	@df -h . | tail -1 | awk '{print "disk free before the newest install: " $$4}'
	$(NEWEST_PIP) $(NEW_VENV)/bin/python .ci/lean_install.py $(TORCH_NEWEST)
	$(NEWEST_PIP) $(NEW_VENV)/bin/python -m pip install --quiet --no-cache-dir -e '.[dev]' $(TORCH_NEWEST)
	touch $(NEW_STAMP)

# The test suite less its slow and multi-process tests, as test-oldest, plus the compiled
# checks of what the newest torch changed (marked `newest`: the in-place change of a
# shared input, second derivatives, forward mode, randomness), on the newest torch.
test-newest: $(NEW_STAMP)
	$(NEW_VENV)/bin/python -c 'import sys, torch; print("newest versions: Python", sys.version.split()[0], "torch", torch.__version__)'
	$(NEW_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) -m "(not slow and not multiprocess) or newest"

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]' $(TORCH_DEV)
	$(BIN)/python -m benchmarks.run $(ARGS)

clean:
	rm -rf $(VENV) $(OLD_VENV) $(NEW_VENV) site

# The quickstart notebook is committed with its outputs, which the docs site renders:
# re-execute it in a fresh kernel and store them (seconds). The test run checks that they
# are complete, clean and what a fresh run prints (tests/notebook_outputs.py).
.PHONY: notebook
notebook: $(STAMP)
	$(BIN)/python tests/notebook_outputs.py examples/quickstart.ipynb

# The figures in docs/img come from full runs of the examples; the examples themselves
# write into ./out/<example>/ and never touch docs/img unless told to, as here. Takes
# minutes, most of them the RL example's (docs/examples.md lists each one's time).
.PHONY: figures
figures: $(STAMP) notebook
	$(BIN)/python examples/deep_ensemble_regression.py --out docs/img
	$(BIN)/python examples/lr_sweep.py --out docs/img
	$(BIN)/python examples/digits_ensemble.py --out docs/img
	$(BIN)/python examples/pbt_digits.py --out docs/img
	$(BIN)/python examples/rl_q_ensemble.py --out docs/img
