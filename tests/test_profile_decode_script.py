"""scripts/profile_decode.py on a CPU: --smoke runs the whole path (batch, three parts, profiler, JSON,
table). The kernel categories and the per-step grouping it imports are tested in tests/test_20_profile.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "profile_decode.py"


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
