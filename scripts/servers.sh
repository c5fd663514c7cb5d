# Sourced by the benchmark scripts that start servers: the bundled GGUF, a run dir, and
# the servers started in the background, stopped with SIGTERM when the script exits
# (SIGKILL after 30 s). A background job of a script ignores SIGINT, so SIGTERM it is.
#
#   source scripts/servers.sh
#   some-server ... & pids+=($!)
#   wait_up http://127.0.0.1:PORT/v1 "some-server"
PY=${PY:-.venv/bin/python}
GGUF=$($PY -c "from common.modelfile import resolve_model; print(resolve_model(None).path)")
run_dir=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do
        for _ in $(seq 60); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$p" 2>/dev/null || true
    done
}
trap cleanup EXIT

wait_up() {  # url, name
    for _ in $(seq 600); do
        if curl -sf "$1/models" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    echo "$2 did not come up; logs in $run_dir" >&2
    exit 1
}
