# Sourced by compare_chatter.sh and compare_deferral.sh (set MAIN, BRANCH and OUT first):
#   side NAME CHECKOUT BENCH ARGS...   runs `superinfer bench BENCH ARGS` from CHECKOUT's
# own .venv and working directory (python -m resolves the services' modules from there),
# writing OUT/BENCH-NAME.{json,txt,log}.
mkdir -p "$OUT"
export PYTHONDONTWRITEBYTECODE=1
side() {
  local name=$1 dir=$2 bench=$3; shift 3
  echo "== $(date -u +%H:%M:%S) $bench $name" >&2
  (cd "$dir" && .venv/bin/superinfer bench "$bench" "$@" --json "$OUT/$bench-$name.json") \
    > "$OUT/$bench-$name.txt" 2> "$OUT/$bench-$name.log"
}
