"""Lesson 20's kernel categories (nanovllm_edu/bench/profile.py, which scripts/profile_decode.py and
scripts/profile_prefill.py import): real kernel names of the H200 record and CPU operators of the tiny model's
decode step land in the expected category, the record's stored categories are what the rules give today, and
the grouping is per step and slowest first."""
import json
from pathlib import Path

import pytest

from nanovllm_edu.bench.profile import CATEGORY_RULES, kernel_category, kernel_rows, profile_part, summed

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "figures" / "profile_decode_h200_after.json"

NAMES = [  # (name, part, category): names from figures/profile_decode_h200_after.json and a CPU profile
    ("_decode_kernel", "forward", "attention"),
    ("_gemm_kernel", "forward", "gemm"),
    ("nvjet_sm90_tst_64x32_64x16_1x2_h_bz_TNT", "forward", "gemm"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "logits", "gemm"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "forward", "elementwise/norm"),
    ("_qk_norm_rope_kernel", "forward", "elementwise/norm"),
    ("_store_kvcache_kernel", "forward", "elementwise/norm"),
    ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, bool)",
     "forward", "elementwise/norm"),
    ("Memcpy DtoD (Device -> Device)", "forward", "memcpy/memset"),
    ("memcpy32_post", "forward", "memcpy/memset"),
    ("Memset (Device)", "logits", "memcpy/memset"),
    ("_race_tile_kernel", "sample", "sampler"),
    ("Memcpy HtoD (Pinned -> Device)", "sample", "sampler"),  # the sample part's copy: the part decides
    ("flash::flash_fwd_splitkv_kernel<cutlass::bfloat16_t>", "forward", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "forward", "gemm"),
    ("aten::mm", "forward", "gemm"),
    ("aten::mm", "logits", "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "forward", "attention"),
    ("aten::index_select", "forward", "elementwise/norm"),
    ("aten::mul", "forward", "elementwise/norm"),
    ("aten::argmax", "sample", "sampler"),
]


@pytest.mark.parametrize("name, part, category", NAMES)
def test_a_kernel_name_lands_in_its_category(name, part, category):
    assert kernel_category(name, part) == category


def test_rules_are_tried_in_order_first_match_wins():
    assert [c for c, _ in CATEGORY_RULES] == ["memcpy/memset", "attention", "gemm"]
    # "memcpy" before "attention": a copy inside attention's code is still a copy
    assert kernel_category("memcpy_prefill_buffers", "forward") == "memcpy/memset"


def test_the_records_stored_categories_are_what_the_rules_give():
    record = json.loads(RECORD.read_text())
    rows = record["kernels"]
    assert len(rows) == 18 and record["kernels_per_step"]["total"] == 265
    assert [kernel_category(r["name"], r["part"]) for r in rows] == [r["category"] for r in rows]
    by_category = summed(rows, "category", "us_per_step")
    assert by_category == pytest.approx(record["by_category_us_per_step"], abs=0.01)
    assert summed(rows, "category", "calls_per_step")["attention"] == 28  # one decode kernel a layer


def test_kernel_rows_are_per_step_and_slowest_first():
    events = {"forward": [("gemm_a", 10.0), ("gemm_a", 10.0), ("norm", 2.0), ("norm", 2.0)],
              "sample": [("_race_tile_kernel", 30.0)]}
    rows = kernel_rows(events, steps=2)
    assert [(r["name"], r["category"], r["calls_per_step"], r["us_per_step"]) for r in rows] == [
        ("_race_tile_kernel", "sampler", 0.5, 15.0), ("gemm_a", "gemm", 1.0, 10.0),
        ("norm", "elementwise/norm", 1.0, 2.0)]
    assert summed(rows, "category", "us_per_step") == {
        "sampler": 15.0, "gemm": 10.0, "elementwise/norm": 2.0, "total": 27.0}
    assert summed(rows, "part", "calls_per_step") == {"forward": 2.0, "sample": 0.5, "total": 2.5}


def test_profile_part_on_a_cpu_records_each_operator_once_per_call():
    import torch

    a, b = torch.ones(4, 8), torch.ones(8, 3)
    rows = kernel_rows({"forward": profile_part(lambda: a @ b, 3, cuda=False)}, 3)
    mm = next(r for r in rows if r["name"] == "aten::mm")
    assert (mm["category"], mm["calls_per_step"]) == ("gemm", 1.0)
