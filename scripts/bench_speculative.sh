#!/usr/bin/env bash
# Speculative decoding on and off, one run, interleaved (`superinfer bench serve
# --speculative`): starts `superinfer serve --speculative-config ...` and, as the anchor,
# llama-server twice on the bundled GGUF — with its own draft-free n-gram speculation and
# without — then runs the committed input-grounded and open-chat prompts at 1 and 8
# streams; prints the table and writes $OUT/results.json. Stops every server at the end.
#
#   LLAMA_SERVER=$(/work/shared/tools/llama-server) scripts/bench_speculative.sh [bench args]
#
# SPEC: the --speculative-config (default: prompt lookup, k 4). SERVE_ARGS: more serve
# flags (e.g. "--dtype float32" for the exactness run). NO_ANCHOR=1: SuperInfer alone.
# OUT: default .experiments/speculative. Extra arguments go to `superinfer bench serve`
# (e.g. --repeats 3 --streams 1,8).
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER=${LLAMA_SERVER:-$HOME/.cache/superinfer-anchors/llama-server}
OUT=${OUT:-.experiments/speculative}
SPEC=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'}
LPORT=${LLAMA_PORT:-8090}  # and LPORT + 1 for the one without speculation
SPORT=${SUPERINFER_PORT:-18000}  # + 50..53 for its gRPC services (not the defaults: other stacks)
# llama.cpp's n-gram speculation closest to prompt lookup: a 2-gram key, drafts of up to 8
LLAMA_SPEC=${LLAMA_SPEC:---spec-type ngram-map-k4v --spec-ngram-map-k4v-size-n 2 --spec-ngram-map-k4v-size-m 8}
mkdir -p "$OUT"
# shellcheck source=scripts/servers.sh
source scripts/servers.sh  # GGUF, run_dir, pids, cleanup on exit, wait_up

anchors=()
if [ -z "${NO_ANCHOR:-}" ]; then
    [ -x "$LLAMA_SERVER" ] || { echo "no llama-server at $LLAMA_SERVER (build it: ../shared/tools/llama-server)" >&2; exit 2; }
    # shellcheck disable=SC2086
    "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$LPORT" -np 8 -c 16384 -t 2 $LLAMA_SPEC \
        >"$run_dir/llama-lookup.log" 2>&1 &
    pids+=($!)
    "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port $((LPORT + 1)) -np 8 -c 16384 -t 2 \
        >"$run_dir/llama-plain.log" 2>&1 &
    pids+=($!)
    wait_up "http://127.0.0.1:$LPORT/v1" "llama-server (lookup)"
    wait_up "http://127.0.0.1:$((LPORT + 1))/v1" "llama-server"
    anchors=(--baseline-url "http://127.0.0.1:$LPORT/v1" --baseline-off-url "http://127.0.0.1:$((LPORT + 1))/v1"
             --baseline-label llama-lookup)
fi
# shellcheck disable=SC2086
$PY -m superinfer.cli serve --port "$SPORT" --grpc-port $((SPORT + 50)) \
    --scheduler-port $((SPORT + 51)) --worker-port $((SPORT + 52)) --kvmem-port $((SPORT + 53)) \
    --run-dir "$run_dir/superinfer" --speculative-config "$SPEC" ${SERVE_ARGS:-} \
    >"$run_dir/serve.log" 2>&1 &
pids+=($!)
wait_up "http://127.0.0.1:$SPORT/v1" "superinfer serve"

note="serve --speculative-config '$SPEC' ${SERVE_ARGS:-}; llama-server -np 8 -c 16384 -t 2 [$LLAMA_SPEC], $(git rev-parse --short HEAD)"
$PY -m superinfer.cli bench serve --speculative --base-url "http://127.0.0.1:$SPORT/v1" \
    "${anchors[@]}" --streams 1,8 --note "$note" --json "$OUT/results.json" "$@"
