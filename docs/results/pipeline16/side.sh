# Sourced by the compare_*.sh scripts (set MAIN, BRANCH and OUT first):
#   side NAME CHECKOUT BENCH ARGS...   runs `python -m superinfer.cli bench BENCH ARGS` in
# CHECKOUT's working directory (python -m resolves the bench's and the services' modules
# from there), with CHECKOUT's own .venv, or $PY where it has none (a `git archive` of a
# commit), writing OUT/BENCH-NAME.{json,txt,log}.
mkdir -p "$OUT"
export PYTHONDONTWRITEBYTECODE=1
side() {
  local name=$1 dir=$2 bench=$3; shift 3
  echo "== $(date -u +%H:%M:%S) $bench $name" >&2
  local py=$dir/.venv/bin/python
  [ -x "$py" ] || py=${PY:?"$dir has no .venv: set PY"}
  (cd "$dir" && "$py" -m superinfer.cli bench "$bench" "$@" --json "$OUT/$bench-$name.json") \
    > "$OUT/$bench-$name.txt" 2> "$OUT/$bench-$name.log"
}
