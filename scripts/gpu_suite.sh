#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: the GPU tests, every notebook top to bottom, the end-to-end
# benchmark (CUDA graphs with async scheduling on and off, eager, a step-time breakdown), tensor parallelism on
# every GPU count the machine allows, and the CUDA-graph figures. Results go under $RESULTS (default: out/);
# when $OUT is set (the device tool's folder, which takes back only a few files) they are also packed into
# $OUT/gpu_suite.tgz, with the summary in $OUT/summary.txt.
#
#   bash scripts/gpu_suite.sh [tests] [notebooks] [bench] [sync] [eager] [tp] [graphs] [kernels] [online] [mixed] [sweeps]
#   (no argument: all but online, mixed and sweeps)
#   NOTEBOOKS="notebooks/18_benchmark.ipynb" bash scripts/gpu_suite.sh notebooks                (some notebooks)
#
# Uses the machine's own python3 (torch, triton, transformers, safetensors, xxhash, tqdm, matplotlib); the
# package is imported from this checkout. pytest's nbval options are dropped: notebooks are compared with their
# stored outputs on a CPU in CI; here `scripts/run_notebook.py` runs them (no Jupyter needed) and reports the
# first failing cell of each. Each stage has a time limit, so one hang cannot eat the whole call.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NANOVLLM_EDU_TP_TIMEOUT="${NANOVLLM_EDU_TP_TIMEOUT:-120}"  # a stuck collective fails in 2 minutes
RESULTS="${RESULTS:-out}"
mkdir -p "$RESULTS"
# Pure-Python packages the GPU machine lacks (it has no network): for the notebooks, fastcore (their @patch cells),
# IPython, ipywidgets and nbformat (the labs) with their dependencies; the package itself needs none of them. Carry their wheels in .whl/ (pip download
# --no-deps -d .whl NAME==VERSION, for Python 3.12); they are installed into .whl/site here.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .whl/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH="$PWD/.whl/site:$PYTHONPATH"
fi
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests notebooks bench sync eager tp graphs kernels)
status=0
num_gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RESULTS/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$RESULTS/gpu.txt"

bench() {  # bench NAME LABEL [extra flags...]: one benchmark run, its record in $RESULTS/bench_NAME.json
  local name=$1 label=$2
  shift 2
  echo "=== $label ($(date -u +%T))" | tee -a "$RESULTS/bench.log"
  # past the limit every python process (tensor-parallel workers too) prints its Python stack, then dies
  ( sleep "${BENCH_LIMIT_S:-300}"; pkill -ABRT python3 ) &
  local watchdog=$!
  PYTHONFAULTHANDLER=1 python3 -m nanovllm_edu.bench --random-weights qwen3-0.6b --backend triton --label "$label" \
    --json "$RESULTS/bench_$name.json" "$@" 2>&1 | tee -a "$RESULTS/bench.log" || status=1
  kill "$watchdog" 2>/dev/null
}

run_scripts() {  # run_scripts STAGE LIMIT_S "SCRIPT ARGS" ...: each of scripts/ in turn, logged to $RESULTS/STAGE.log
  local stage=$1 limit=$2 job
  shift 2
  for job in "$@"; do
    echo "=== $job" | tee -a "$RESULTS/$stage.log"
    timeout -s ABRT "$limit" python3 scripts/$job 2>&1 | tee -a "$RESULTS/$stage.log" || status=1
  done
}

for stage in "${stages[@]}"; do
  case "$stage" in
    tests)
      PYTHONFAULTHANDLER=1 timeout -s ABRT "${TESTS_LIMIT_S:-900}" python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu tests -q -rs --continue-on-collection-errors 2>&1 | tee "$RESULTS/pytest_gpu.log" || status=1 ;;
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
    notebooks)
      # on the GPU, GPU-only cells run live and write their records into $RESULTS/figures (NANOVLLM_EDU_RECORDS),
      # never over the committed records in figures/ that the lessons' prose reads
      mkdir -p "$RESULTS/notebooks" "$RESULTS/figures"
      NANOVLLM_EDU_RECORDS="$(cd "$RESULTS/figures" && pwd)" timeout "${NOTEBOOKS_LIMIT_S:-900}" \
        python3 scripts/run_notebook.py ${NOTEBOOKS:-notebooks/*.ipynb} --log-dir "$RESULTS/notebooks" \
        --timeout "${NOTEBOOK_LIMIT_S:-300}" 2>&1 | tee "$RESULTS/notebooks.log" || status=1 ;;
    online)
      PYTHONFAULTHANDLER=1 timeout -s ABRT "${ONLINE_LIMIT_S:-600}" python3 -m nanovllm_edu.bench.online --random-weights qwen3-0.6b --backend triton --json "$RESULTS/online.json" --plot "$RESULTS/online.png" --stall-plot "$RESULTS/online_stall.png" 2>&1 | tee "$RESULTS/online.log" || status=1 ;;
    mixed)
      # mixed against separate prefill/decode steps (notebooks 06, 14, 22): online latency, the seed benchmark, step cost
      for part in online offline cost; do
        limit_var="MIXED_${part^^}_LIMIT_S"
        PYTHONFAULTHANDLER=1 timeout -s ABRT "${!limit_var:-300}" python3 scripts/mixed_steps_bench.py $part \
          --json "$RESULTS/mixed_$part.json" ${MIXED_ARGS:-} 2>&1 | tee "$RESULTS/mixed_$part.log" || status=1
      done ;;
    sweeps)
      # the tile sweeps behind notebook 15's fused gate and notebook 12's decode tiles, and the prefill profile
      run_scripts sweeps 400 "sweep_gemm.py --json $RESULTS/sweep_gemm.json" \
        "sweep_attention.py --json $RESULTS/sweep_attention.json" "profile_prefill.py --json $RESULTS/profile_prefill.json" ;;
    graphs)
      timeout 300 python3 scripts/measure_cuda_graphs.py --json "$RESULTS/cuda_graphs.json" 2>&1 | tee "$RESULTS/graphs.log" || status=1 ;;
    kernels)
      # the sampler, the decode GEMMs and attention against their floors, one decode step kernel by kernel (at
      # batch 256 and at batch 1), and notebook 15's PDL chain against the kernels it replaces
      run_scripts kernels 300 "measure_sampler.py --json $RESULTS/sampler.json" "kernel_tables.py --json-dir $RESULTS" \
        "profile_decode.py --json $RESULTS/profile_decode.json" "profile_decode.py --batch 1 --json $RESULTS/profile_decode_b1.json" \
        "profile_pdl.py --json $RESULTS/pdl_chain.json" ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
if [ -n "${OUT:-}" ] && [ "$OUT" != "$RESULTS" ]; then
  tar czf "$OUT/gpu_suite.tgz" -C "$RESULTS" .
  { cat "$RESULTS/gpu.txt"; grep -h -E "passed|failed|error" "$RESULTS/pytest_gpu.log" 2>/dev/null | tail -1
    cat "$RESULTS/notebooks.log" 2>/dev/null; grep -h -E "tok/s" "$RESULTS/bench.log" 2>/dev/null; } > "$OUT/summary.txt"
fi
exit $status
