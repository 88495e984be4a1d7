#!/usr/bin/env bash
# Before/after on one machine, in one call (the GPU machine is noisy: only runs of the same call compare).
# Alternates the seed benchmark of older copies of the package and of this checkout, REPS times each, and
# writes every record to $RESULTS/bench_{NAME,after}_REP.json (NAME: each copy's folder name without its
# leading dot) and the log to $RESULTS/bench_ab.log.
#
#   git archive REV nanovllm_edu | tar -x -C .bench_old     (here; carry .bench_old to the GPU machine)
#   bash scripts/bench_ab.sh .bench_old[,.bench_step1,...] [REPS] [extra benchmark flags...]
#   BENCH_AB_THIS=0 bash scripts/bench_ab.sh ...   (only the listed copies, not this checkout)
set -uo pipefail
cd "$(dirname "$0")/.."
IFS=, read -ra olds <<< "$1"; reps=${2:-2}; shift; [ $# -gt 0 ] && shift
RESULTS="${RESULTS:-out}"; mkdir -p "$RESULTS"; results=$(cd "$RESULTS" && pwd)
site="$PWD/.whl/site"  # carried wheels, installed by gpu_suite.sh (fastcore for both copies)
run() {  # run NAME DIR REP [flags]: one benchmark of the package found in DIR
  local name=$1 dir=$2 rep=$3; shift 3
  echo "=== $name rep $rep ($(date -u +%T))" | tee -a "$results/bench_ab.log"
  ( cd "$dir" && PYTHONPATH="$dir:$site" timeout -s ABRT "${BENCH_LIMIT_S:-300}" python3 -m nanovllm_edu.bench \
      --random-weights qwen3-0.6b --backend triton --label "$name rep $rep" --json "$results/bench_${name}_$rep.json" "$@" ) \
    2>&1 | tee -a "$results/bench_ab.log" | grep -E "tok/s|Error"
}
for rep in $(seq 1 "$reps"); do
  for old in "${olds[@]}"; do
    name=$(basename "$old"); run "${name#.}" "$(cd "$old" && pwd)" "$rep" "$@"
  done
  [ "${BENCH_AB_THIS:-1}" = 0 ] || run after "$PWD" "$rep" "$@"
done
