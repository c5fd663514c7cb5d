# `make reproduce-<topic>`: the commands behind each page of docs/results/<topic>/, writing
# to .experiments/ (ignored). Included by the Makefile; every target needs `make venv`.
PYX := $(BIN)/python -m experiments
SIM := $(BIN)/superinfer sim
OUTX := .experiments

.PHONY: reproduce-rotasched reproduce-rotasched-cells reproduce-rotasched-real reproduce-rate-step reproduce-decision-cost \
	reproduce-simulator reproduce-simulator-figures reproduce-pipeline reproduce-duplexkv \
	reproduce-executor reproduce-prefix-cache reproduce-tensor-parallel reproduce-grammar \
	reproduce-compose reproduce-replicas

# The rotasched page's table: the paper's own settings, three seeds (~3 min on 2 cores).
reproduce-rotasched: venv
	$(PYX) must-show --cells gh200_artifact --seeds 0,1,2 --out $(OUTX)/must_show_artifact

# All the simulator's must-show cells, three seeds (~45 min on 2 cores).
reproduce-rotasched-cells: venv
	$(PYX) must-show --seeds 0,1,2 --out $(OUTX)/must_show

# The real-stack cells at the engine's defaults (~2.5 h).
reproduce-rotasched-real: venv
	for s in 11 12 13 14 15; do for r in 0.855 1.14; do \
	  $(PYX) policies --policies lvf,swapped-first,waiting-first --saturation 0.57 --rates $$r \
	    --num-prompts 100 --interleave --warmup 8 --seed $$s \
	    --bench-args "--endpoint chat --no-ignore-eos --max-tokens 512" \
	    --out $(OUTX)/rotasched_real/s$${s}_$$r || exit 1; \
	done; done

# The rate step behind LVF's adaptive residency, simulator, three seeds (~5 min).
reproduce-rate-step: venv
	$(PYX) rate-step --params fixed_res,adaptive --seeds 0,1,2 --base 14 --peak 28 --out $(OUTX)/rate_step_14
	$(PYX) rate-step --params fixed_res,adaptive --seeds 0,1,2 --base 17 --peak 34 --out $(OUTX)/rate_step_17

reproduce-decision-cost: venv
	$(PYX) sched

# Calibrate this machine, run a four-policy pass on the real stack, replay it.
reproduce-simulator: venv
	$(PYX) calibrate-serving --out $(OUTX)/cpu-local.json
	$(PYX) policies --trace --out $(OUTX)/policies
	$(PYX) fidelity --experiment $(OUTX)/policies/results.json \
	    --json $(OUTX)/fidelity.json --plot $(OUTX)/fidelity.png

reproduce-simulator-figures: venv
	$(SIM) --hardware gh200-96gb --model qwen2.5-32b --dataset sharegpt --duration 120 \
	    --seed 0 --ttft-slo 5 --tbt-slo 0.1 --rps 5,8,11,14,17,20 \
	    --policies lvf,swapped-first,waiting-first,fcfs \
	    --json $(OUTX)/fig16_gh200_96gb.json --plot $(OUTX)/fig16_gh200_96gb.png

reproduce-pipeline: venv
	$(PYX) pipeline --requests 32 --device-blocks 200 --repeats 2
	$(PYX) overhead --requests 32 --repeats 5
	for r in 2.4 3.6; do \
	  $(PYX) policies --policies lvf --saturation 2.4 --rates $$r --num-prompts 80 \
	    --serve-args="--no-pipeline" --out $(OUTX)/pipeline/off-$$r || exit 1; \
	  $(PYX) policies --policies lvf --saturation 2.4 --rates $$r --num-prompts 80 \
	    --out $(OUTX)/pipeline/on-$$r || exit 1; \
	done

reproduce-duplexkv: venv
	$(BIN)/superinfer bench transfer --repeats 15 --json $(OUTX)/bench_transfer.json
	$(PYX) transfer-modes --out $(OUTX)/transfer_modes

# Against llama.cpp's server (LLAMA_SERVER: its binary; ../shared/tools/llama-server
# builds one), and the formats' quality.
reproduce-executor: venv
	$(BIN)/superinfer bench engine --repeats 2 --json $(OUTX)/bench_engine.json
	$(PYX) quality --json $(OUTX)/quality.json
	OUT=$(OUTX)/cpu_vs_llamacpp scripts/bench_cpu_vs_llamacpp.sh --repeats 2

reproduce-prefix-cache: venv
	$(PYX) prefix-cache --scenarios host-tier,multi-turn --repeats 3 --out $(OUTX)/prefix_cache
	$(PYX) prefix-cache --scenarios no-sharing,system-prompt --repeats 2 \
	    --out $(OUTX)/prefix_cache_no_sharing

reproduce-tensor-parallel: venv
	$(PYX) tp --json $(OUTX)/bench_tp.json

reproduce-grammar: venv
	OMP_NUM_THREADS=1 $(PYX) grammar --batch 16 --max-tokens 48 --repeats 3 \
	    --json $(OUTX)/grammar.json

# Needs a Docker engine.
reproduce-compose: venv
	$(BIN)/python scripts/compose_check.py --json $(OUTX)/compose.json

# Two replicas behind vllm-router: the four router policies on one multi-turn load
# (~15 min on 2 cores); the failure and events-only checks are tests/test_router.py.
reproduce-replicas: venv
	OMP_NUM_THREADS=1 $(PYX) replicas --out $(OUTX)/replicas
