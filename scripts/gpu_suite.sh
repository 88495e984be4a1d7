#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: the GPU tests, the end-to-end benchmark (CUDA graphs with
# async scheduling on and off, eager, a step-time breakdown), tensor parallelism on every GPU count the
# machine allows, and the CUDA-graph figures. Results go under $OUT (default: out/).
#
#   bash scripts/gpu_suite.sh [bench] [tp] [sync] [tests] [eager] [graphs]      (no argument: all)
#
# Uses the machine's own python3 (torch, triton, transformers, safetensors, xxhash, tqdm); the package
# is imported from this checkout. pytest's nbval options are dropped: notebooks are checked on CPU in CI.
# Each benchmark has a time limit, so one hang cannot eat the whole call.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NANOVLLM_EDU_TP_TIMEOUT="${NANOVLLM_EDU_TP_TIMEOUT:-120}"  # a stuck collective fails in 2 minutes
OUT="${OUT:-out}"
mkdir -p "$OUT"
# fastcore (pure Python, a dependency of the package) may be missing on the GPU machine, which has no network:
# carry its wheel in .whl/ (pip download fastcore --no-deps -d .whl) and it is unpacked onto the path here
if ! python3 -c "import fastcore" 2>/dev/null; then
  python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('.whl/site') for w in glob.glob('.whl/fastcore-*.whl')]"
  export PYTHONPATH="$PWD/.whl/site:$PYTHONPATH"
fi
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(bench tp sync tests eager graphs)
status=0
num_gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

bench() {  # bench NAME LABEL [extra flags...]: one benchmark run, its record in $OUT/bench_NAME.json
  local name=$1 label=$2
  shift 2
  echo "=== $label ($(date -u +%T))" | tee -a "$OUT/bench.log"
  # past the limit every python process (tensor-parallel workers too) prints its Python stack, then dies
  ( sleep "${BENCH_LIMIT_S:-300}"; pkill -ABRT python3 ) &
  local watchdog=$!
  PYTHONFAULTHANDLER=1 python3 -m nanovllm_edu.bench --random-weights qwen3-0.6b --backend triton --label "$label" \
    --json "$OUT/bench_$name.json" "$@" 2>&1 | tee -a "$OUT/bench.log" || status=1
  kill "$watchdog" 2>/dev/null
}

for stage in "${stages[@]}"; do
  case "$stage" in
    tests)
      PYTHONFAULTHANDLER=1 timeout -s ABRT "${TESTS_LIMIT_S:-900}" python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu tests -q -rs --continue-on-collection-errors 2>&1 | tee "$OUT/pytest_gpu.log" || status=1 ;;
    bench)
      bench triton_graphs "triton + CUDA graphs" --breakdown ;;
    sync)
      bench triton_graphs_sync "triton + CUDA graphs, async scheduling off" --no-async-scheduling ;;
    eager)
      bench triton_eager "triton, eager" --enforce-eager ;;
    tp)
      for tp in 2 4 8; do
        if [ "$num_gpus" -ge "$tp" ]; then
          bench "tp$tp" "tensor parallel $tp, triton + CUDA graphs" --tensor-parallel-size "$tp"
        fi
      done ;;
    graphs)
      timeout 300 python3 scripts/measure_cuda_graphs.py --json "$OUT/cuda_graphs.json" 2>&1 | tee "$OUT/graphs.log" || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
