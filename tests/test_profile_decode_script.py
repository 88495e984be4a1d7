"""scripts/profile_decode.py on a CPU: --smoke runs the whole path (batch, three parts, profiler, JSON,
table); the kernel categories and the per-step grouping are checked on made-up kernel names."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "profile_decode.py"
spec = importlib.util.spec_from_file_location("profile_decode", SCRIPT)
profile_decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_decode)


def test_categories_by_name_and_part():
    category = profile_decode.kernel_category
    assert category("_decode_kernel", "forward") == "attention"
    assert category("flash::flash_fwd_splitkv_kernel<cutlass::bfloat16_t>", "forward") == "attention"
    assert category("nvjet_tst_128x64_64x8_1x2_h_bz_NNT", "logits") == "gemm"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "forward") == "gemm"
    assert category("_store_kvcache_kernel", "forward") == "elementwise/norm"
    assert category("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "forward") == "elementwise/norm"
    assert category("Memcpy DtoD (Device -> Device)", "forward") == "memcpy/memset"
    assert category("void at::native::reduce_kernel<argmax>", "sample") == "sampler"
    assert category("Memcpy HtoD (Pinned -> Device)", "sample") == "sampler"


def test_kernel_rows_are_per_step_and_slowest_first():
    events = {"forward": [("gemm_a", 10.0), ("gemm_a", 10.0), ("norm", 2.0), ("norm", 2.0)],
              "sample": [("_race_tile_kernel", 30.0)]}
    rows = profile_decode.kernel_rows(events, steps=2)
    assert [(r["name"], r["calls_per_step"], r["us_per_step"]) for r in rows] == [
        ("_race_tile_kernel", 0.5, 15.0), ("gemm_a", 1.0, 10.0), ("norm", 1.0, 2.0)]
    assert profile_decode.summed(rows, "category", "us_per_step") == {
        "sampler": 15.0, "gemm": 10.0, "elementwise/norm": 2.0, "total": 27.0}


def test_smoke_run_writes_the_record_and_the_table(tmp_path):
    out = tmp_path / "profile.json"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out), "--smoke"], capture_output=True,
                          text=True, check=False, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert (record["device"], record["batch"], record["context"], record["steps"]) == ("cpu", 4, 40, 2)
    assert record["package_file"] == str(ROOT / "nanovllm_edu" / "__init__.py")
    assert 36 <= record["context_lens"]["min"] <= record["context_lens"]["max"] <= 44
    for part in ("forward", "logits", "sample"):
        assert record["ms_per_step"][part] > 0 and record["kernels_per_step"][part] > 0
    assert {row["part"] for row in record["kernels"]} == {"forward", "logits", "sample"}
    assert abs(sum(v for k, v in record["by_category_us_per_step"].items() if k != "total")
               - record["kernel_us_per_step"]["total"]) < 1
    assert "category" in done.stdout and "kernels/step" in done.stdout
