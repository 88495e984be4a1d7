"""scripts/kernel_tables.py on a CPU: tiny sizes through the whole path (shapes, floors, JSON, markdown)."""
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("triton")  # scripts/kernel_tables.py imports it (a Linux-only dependency)

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("kernel_tables", ROOT / "scripts" / "kernel_tables.py")
kernel_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_tables)

TINY = kernel_tables.Sizes(gemm_ms=(1,), batch_sizes=(1,), context_lens=(32,), mix_batch=2,
                           mix_context_range=(16, 48), split_sweep_batches=(2,), steps_workload=(3, 8, 24),
                           step_stride=8, max_model_len=64)
RATES = kernel_tables.Rates(copy_bandwidth=4e12, peak_flops=800e12, source="given")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The tiny tables, measured once for the module: (the folder they were written to, the records)."""
    folder = tmp_path_factory.mktemp("tables")
    return folder, kernel_tables.write_tables(folder, TINY, RATES)


def test_qwen3_decode_gemm_shapes():
    shape = kernel_tables.ModelShape.from_config(json.loads(kernel_tables.MODEL_CONFIG.read_text()))
    assert kernel_tables.decode_gemm_shapes(shape) == {
        "qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
        "lm_head": (151936, 1024)}


def test_gemm_floor_is_memory_bound_at_small_m_and_compute_bound_at_large():
    small = kernel_tables.gemm_floor(1, 4096, 1024, RATES)
    assert small["bound"] == "memory"
    assert small["floor_us"] == small["bytes"] / RATES.copy_bandwidth * 1e6
    assert kernel_tables.gemm_floor(65536, 4096, 1024, RATES)["bound"] == "compute"


def test_tables_are_written_and_rendered(written):
    folder, records = written
    gemm = json.loads((folder / "gemm_decode.json").read_text())
    attention = json.loads((folder / "decode_attention.json").read_text())
    assert gemm == records["gemm_decode"] and attention == records["decode_attention"]
    for record in (gemm, attention):
        assert record["copy_bandwidth_GBps"] == 4000 and record["peak_bf16_TFLOPs"] == 800
        assert record["empty_kernel_us"] > 0 and record["smoke"]
    assert [row["gemm"] for row in gemm["rows"]] == ["qkv", "o", "gate_up", "down", "lm_head"]
    assert all(row[f"{lib}_{method}_us"] > 0 for row in gemm["rows"] for lib in ("cublas", "cublaslt")
               for method in ("do_bench", "graph"))
    assert [(row["kind"], row["batch"], row["num_splits"]) for row in attention["rows"]] == [
        ("uniform", 1, 1), ("mix", 2, 1), ("mix, arrival order", 2, 1),
        *[(f"{kind}, {n} splits", 2, n) for kind in ("mix", "uniform") for n in (1, 2, 4, 8)]]
    uniform, mix = attention["rows"][:2]
    assert uniform["kv_bytes"] == 32 * 8 * 128 * 2 * 2 and uniform["graph_us"] is None
    assert 16 <= mix["context_min"] <= mix["context_max"] <= 48
    table = kernel_tables.markdown_table(attention)
    assert table.count("\n| ") == 12  # header + 11 rows
    assert f"| mix | 2 | {mix['context_min']}..{mix['context_max']} |" in table
    assert kernel_tables.markdown_table(gemm).count("\n| lm_head | 1 | 151936 | 1024 |") == 1


def test_decode_steps_follow_the_seed_workload(written):
    """Every 8th decode step of a 3-request workload: its rows, the padded batch, both orders, the summary."""
    steps = kernel_tables.seed_decode_steps(TINY)
    workload = kernel_tables.make_workload(3, 24, 24, min_input_len=8, min_output_len=8)
    assert [step for step, _ in steps] == list(range(0, max(workload.max_tokens) - 1, 8))
    for step, lens in steps:
        assert lens == [p + step + 1 for p, n in zip(workload.prompt_lens, workload.max_tokens) if step < n - 1]
    attention = written[1]["decode_attention"]
    rows = attention["steps"]
    assert [(row["order"], row["forced"]) for row in rows[:5]] == [
        ("arrival", False), ("longest first", False), ("longest first", True), ("longest first", True),
        ("longest first", True)]
    assert len(rows) == 5 * len(steps)
    assert all(row["padded"] >= row["batch"] and row["graph_us"] is None for row in rows)  # no graphs on a CPU
    summary = attention["steps_summary"]
    assert summary["steps"] == len(steps) and summary["step_stride"] == 8
    assert set(summary["seconds"]) == {"arrival, splits from shapes", "longest first, splits from shapes",
                                       "longest first, 1 splits", "longest first, 2 splits", "longest first, 4 splits"}
    kv_bytes = sum(sum(lens) for _, lens in steps) * 8 * 128 * 2 * 2
    assert summary["floor_seconds"] == kv_bytes * 8 * 28 / RATES.copy_bandwidth
