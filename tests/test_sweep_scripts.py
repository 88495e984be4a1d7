"""The H200 sweeps' pure parts on a CPU: scripts/sweep_gemm.py's tile configurations fit the shapes and the shared
memory, scripts/sweep_attention.py packs prompts as the scheduler does and sums tile rules from per-step rows,
scripts/profile_pdl.py times the tiles the engine runs."""
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # both import kernel_tables as a sibling


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sweep_gemm, sweep_attention = load("sweep_gemm"), load("sweep_attention")


@pytest.mark.parametrize("m", [1, 16, 33, 128, 256])
@pytest.mark.parametrize("n, k, gated", [(4096, 1024, False), (1024, 2048, False), (3072, 1024, True)])
def test_gemm_configs_divide_the_shape_and_fit_shared_memory(m, n, k, gated):
    configs = sweep_gemm.configs(m, n, k, gated)
    assert configs
    for c in configs:
        assert n % c["block_n"] == 0 and k % (c["splits"] * c["block_k"]) == 0
        assert not (gated and c["splits"] > 1)
        per_stage = (c["block_m"] * c["block_k"] + c["block_n"] * c["block_k"] * (2 if gated else 1)) * 2
        assert per_stage * c["num_stages"] <= sweep_gemm.SMEM_BYTES


def test_prefill_steps_pack_prompts_like_the_scheduler():
    steps = sweep_attention.prefill_steps([10_000, 10_000, 100])
    assert [sum(n for n, _ in s) for s in steps] == [16_384, 3_716]
    assert steps[0] == [(10_000, 0), (6_384, 0)] and steps[1] == [(3_616, 6_384), (100, 0)]


def test_rule_seconds_picks_short_tiles_only_on_a_full_gpu():
    rows = [{"step": s, "padded": padded, "split_scale": 1, "block_n": bn, "num_warps": w, "num_stages": 2,
             "graph_us": us} for s, padded in ((0, 256), (32, 64))
            for bn, w, us in ((32, 2, 10.0 if padded == 256 else 30.0), (64, 4, 20.0))]
    decode = {"rows": rows, "num_kv_heads": 8, "num_sms": 132, "step_stride": 32, "num_layers": 28}
    seconds = sweep_attention.rule_seconds(decode)
    scale = 32 * 28 / 1e6
    assert seconds["32-token tiles, 2 warps everywhere"] == pytest.approx(40 * scale)
    assert seconds["64-token tiles, 4 warps everywhere"] == pytest.approx(40 * scale)
    assert seconds["paged_decode's rule: 32/2 on a full GPU, else 64/4"] == pytest.approx(30 * scale)


profile_pdl = load("profile_pdl")


def test_the_chains_tiles_are_the_sweeps_fastest_unsplit_ones():
    """kernels/pdl_chain.py's PLAIN_TILES were read off figures/sweep_gemm_h200.json: scripts/profile_pdl.py picks the
    same tiles from the record (so the script times what the engine runs), row count by row count."""
    from nanovllm_edu.kernels.pdl_chain import PLAIN_TILES

    tiles = profile_pdl.plain_tiles(profile_pdl.json.loads(profile_pdl.SWEEP.read_text()))
    names = {(4096, 1024): "qkv", (1024, 2048): "o", (1024, 3072): "down"}
    for shape, table in PLAIN_TILES.items():
        for max_rows, *config in table:
            for m in (max_rows // 2 + 1, max_rows):
                picked = profile_pdl.tiles_for(tiles, names[shape], m)
                assert [picked[k] for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages")] == config
