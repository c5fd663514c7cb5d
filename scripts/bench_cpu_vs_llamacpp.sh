#!/usr/bin/env bash
# SuperInfer vs llama.cpp on the CPU, one run, interleaved:
# starts llama-server and `superinfer serve` (default flags) on the bundled GGUF, then
# `superinfer bench serve --baseline-url` at 1, 8 and 32 streams; prints the table and
# writes $OUT/result.json and $OUT/result.png. Stops both servers at the end.
#
#   LLAMA_SERVER=$(/work/shared/tools/llama-server) scripts/bench_cpu_vs_llamacpp.sh [bench args]
#
# LLAMA_SERVER: the llama-server binary (default: ~/.cache/superinfer-anchors/llama-server,
# where ../shared/tools/llama-server builds it). OUT: default .experiments/cpu_vs_llamacpp.
# Extra arguments go to `superinfer bench serve` (e.g. --repeats 3 --streams 1,8).
# Wrap it in `flock /work/bench.lock` where several benchmarks share a machine.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER=${LLAMA_SERVER:-$HOME/.cache/superinfer-anchors/llama-server}
OUT=${OUT:-.experiments/cpu_vs_llamacpp}
LPORT=${LLAMA_PORT:-8090}
SPORT=${SUPERINFER_PORT:-18000}  # + 50..53 for its gRPC services (not the defaults: other stacks)
[ -x "$LLAMA_SERVER" ] || { echo "no llama-server at $LLAMA_SERVER (build it: ../shared/tools/llama-server)" >&2; exit 2; }
mkdir -p "$OUT"
# shellcheck source=scripts/servers.sh
source scripts/servers.sh  # GGUF, run_dir, pids, cleanup on exit, wait_up

# LLAMA_ARGS: more llama-server flags, e.g. "-t 1" (its default: one thread per core)
# shellcheck disable=SC2086
"$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$LPORT" -np 32 -c 16384 ${LLAMA_ARGS:-} \
    >"$run_dir/llama-server.log" 2>&1 &
pids+=($!)
$PY -m superinfer.cli serve --port "$SPORT" --grpc-port $((SPORT + 50)) \
    --scheduler-port $((SPORT + 51)) --worker-port $((SPORT + 52)) --kvmem-port $((SPORT + 53)) \
    --run-dir "$run_dir/superinfer" \
    >"$run_dir/serve.log" 2>&1 &
pids+=($!)

wait_up "http://127.0.0.1:$LPORT/v1" llama-server
wait_up "http://127.0.0.1:$SPORT/v1" "superinfer serve"
grep -h '"dtype_auto"\|"executor"' "$run_dir"/superinfer/*.log 2>/dev/null | tail -3 || true

note="superinfer serve (default flags) vs llama-server -np 32 -c 16384 ${LLAMA_ARGS:-}, $(git rev-parse --short HEAD)"
$PY -m superinfer.cli bench serve --base-url "http://127.0.0.1:$SPORT/v1" \
    --baseline-url "http://127.0.0.1:$LPORT/v1" --baseline-label llama-server \
    --tokenizer bundled --note "$note" \
    --json "$OUT/result.json" --plot "$OUT/result.png" "$@"
