#!/usr/bin/env bash
# Issue #5's GPU checks in one short run, for a session that is lent a GPU machine
# (the `device` tool's `run`; that machine reaches no package index and has torch, CUDA
# and most of our dependencies, but not these few, so they travel as wheels).
#
#   bash scripts/gpu_check.sh --fetch-wheels          # here, first: fills .whl/ (ignored)
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=480)
#
# It writes to $OUT (./gpu_out without one): nvidia-smi, the `gpu`-marked tests
# (DuplexKV round trips in every mode on CUDA streams, cudaMemcpyBatchAsync, overlap of
# both directions, the bench on the link) and `superinfer bench transfer --device cuda`
# for both KV shapes (JSON and table). About 3-5 minutes of device time.
set -uo pipefail
WHEELS=(structlog==26.1.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2)

if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
fi

OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"; } \
  2>&1 | tee "$OUT/machine.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_duplex.py 2>&1 | tee "$OUT/pytest_gpu.txt"
python3 -m superinfer.bench.transfer --device cuda --repeats 5 --nt-threshold default \
  --json "$OUT/bench_transfer_gpu.json" 2>&1 | tee "$OUT/bench_transfer_gpu.txt"
