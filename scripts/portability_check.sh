#!/usr/bin/env bash
# Portability check (not CI): runs the notebook suite (nbval: stored outputs vs a fresh run) three times,
# as learners' machines would run it:
#   threads1  OMP_NUM_THREADS=1
#   threads4  OMP_NUM_THREADS=4 (torch is told 4 threads even on a machine with fewer cores)
#   avx2      ATEN_CPU_CAPABILITY=avx2, OMP_NUM_THREADS=2 (ATen's AVX2 kernels instead of AVX-512; on a
#             CPU without AVX2, e.g. ARM, torch ignores the setting and the run repeats the 2-thread one)
# Each run's log goes to OUT_DIR/<run>.log, its one-line summary to OUT_DIR/<run>.summary and
# OUT_DIR/summary.txt; the exit status is non-zero when any run fails.
#
# Usage: bash scripts/portability_check.sh [OUT_DIR] [PYTEST_TARGET ...]
#   OUT_DIR defaults to /tmp/portability; the targets default to notebooks/ (the whole suite takes long
#   on 2 cores: pass a few notebooks to try the script, e.g. notebooks/00_setup.ipynb).
# Run it in the environment the course is tested in (e.g. `. .venv/bin/activate` first).
#
# Thread counts: the notebooks use torch's default intra-op threads (OMP_NUM_THREADS), except 03-05, which
# call torch.set_num_threads(1). torch caps OMP_NUM_THREADS at the machine's cores, so each run's kernels
# get an IPython startup file (in a fresh IPYTHONDIR under OUT_DIR) that calls
# torch.set_num_threads($OMP_NUM_THREADS) before the notebook runs, and records what the kernel saw.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${1:-/tmp/portability}"
shift $(( $# > 0 ? 1 : 0 ))
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(notebooks/)
PYTHON="${PYTHON:-python}"
mkdir -p "$OUT"
: > "$OUT/summary.txt"

failed=0
run() {  # run NAME VAR=VALUE ...: the suite under those environment variables
    local name=$1
    shift
    local ipydir="$OUT/$name.ipython"
    rm -rf "$ipydir" "$OUT/$name.kernel"
    mkdir -p "$ipydir/profile_default/startup"
    cat > "$ipydir/profile_default/startup/00-torch-threads.py" <<'PY'
# written by scripts/portability_check.sh: torch's threads as OMP_NUM_THREADS says, even above the core count
import os as _os

import torch as _torch

_torch.set_num_threads(int(_os.environ["OMP_NUM_THREADS"]))
with open(_os.environ["NVE_PORTABILITY_KERNEL"], "w") as _f:
    _f.write(f"kernel: torch {_torch.get_num_threads()} threads, "
             f"CPU capability {_torch.backends.cpu.get_cpu_capability()}")
PY
    local start=$SECONDS
    env "$@" MKL_NUM_THREADS="$(env "$@" printenv OMP_NUM_THREADS)" IPYTHONDIR="$ipydir" \
        NVE_PORTABILITY_KERNEL="$OUT/$name.kernel" \
        "$PYTHON" -m pytest -p no:cacheprovider "${TARGETS[@]}" > "$OUT/$name.log" 2>&1
    local rc=$?
    [ $rc -ne 0 ] && failed=1
    local result kernel
    result=$(grep -E '^=+ .*(passed|failed|error|no tests ran).* =+$' "$OUT/$name.log" | tail -n 1 | tr -d '=' | xargs)
    kernel=$(cat "$OUT/$name.kernel" 2>/dev/null || echo "kernel: no notebook kernel started")
    local line
    line="$name ($*): $([ $rc -eq 0 ] && echo PASS || echo "FAIL (exit $rc)") | ${result:-no pytest summary} | $kernel | $((SECONDS - start)) s | log $OUT/$name.log"
    echo "$line" | tee "$OUT/$name.summary" >> "$OUT/summary.txt"
    echo "$line"
}

run threads1 OMP_NUM_THREADS=1
run threads4 OMP_NUM_THREADS=4
run avx2 ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=2
exit $failed
