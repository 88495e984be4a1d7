#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: the GPU tests, the end-to-end benchmark (CUDA graphs and
# eager, with a step-time breakdown) and the CUDA-graph figures. Results go under $OUT (default: out/).
#
#   bash scripts/gpu_suite.sh [tests] [bench] [graphs]      (no argument: all three)
#
# Uses the machine's own python3 (torch, triton, transformers, safetensors, xxhash, tqdm); the package
# is imported from this checkout. pytest's nbval options are dropped: notebooks are checked on CPU in CI.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-out}"
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests bench graphs)
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for stage in "${stages[@]}"; do
  case "$stage" in
    tests)
      python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu tests -q -rs 2>&1 | tee "$OUT/pytest_gpu.log" || status=1 ;;
    bench)
      python3 -m nanovllm_edu.bench --random-weights qwen3-0.6b --backend triton --breakdown \
        --label "triton + CUDA graphs" --json "$OUT/bench_triton_graphs.json" 2>&1 | tee "$OUT/bench.log" || status=1
      python3 -m nanovllm_edu.bench --random-weights qwen3-0.6b --backend triton --enforce-eager \
        --label "triton, eager" --json "$OUT/bench_triton_eager.json" 2>&1 | tee -a "$OUT/bench.log" || status=1 ;;
    graphs)
      python3 scripts/measure_cuda_graphs.py --json "$OUT/cuda_graphs.json" 2>&1 | tee "$OUT/graphs.log" || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
