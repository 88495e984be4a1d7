"""Notebook 16: the decode GEMM (kernels/skinny_gemm.py) against torch, on a CPU through Triton's
interpreter at small sizes and on a GPU (`-m gpu`) at Qwen3-0.6B's shapes; the fused gate's tiles."""
import pytest
import torch

from nanovllm_edu.kernels.skinny_gemm import GATED_TILES, skinny_gemm, tile_for, triton_gate_up
from nanovllm_edu.layers.activation import silu_and_mul
from nanovllm_edu.layers.linear import MergedLinear


def reference(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    """The product in float64 (on a CPU), gated by notebook 02's silu_and_mul."""
    out = x.double().cpu() @ w.double().cpu().T
    return silu_and_mul(out) if gated else out


def torch_path(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    return silu_and_mul(x @ w.T) if gated else x @ w.T


def error(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gated: bool) -> float:
    return (out.double().cpu() - reference(x, w, gated)).abs().max().item()


def operands(m: int, n_rows: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n_rows, k, generator=gen) / k**0.5).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, n, k, splits, gated", [(1, 64, 128, 1, False), (5, 64, 256, 2, False),
                                                     (20, 32, 256, 4, False), (3, 32, 128, 1, True),
                                                     (17, 64, 128, 1, True)])
def test_skinny_gemm_is_as_accurate_as_torch(dtype, m, n, k, splits, gated):
    x, w = operands(m, 2 * n if gated else n, k, dtype)
    out = skinny_gemm(x, w, gated=gated, block_n=32, block_k=64, splits=splits)
    assert out.shape == (m, n) and out.dtype == dtype
    bar = max(error(torch_path(x, w, gated), x, w, gated), 1e-6)  # float32: both near 0
    assert error(out, x, w, gated) <= 1.5 * bar


def test_split_k_sums_in_a_fixed_order():
    x, w = operands(7, 64, 512, torch.bfloat16)
    first = skinny_gemm(x, w, block_n=32, block_k=64, splits=8)
    assert torch.equal(first, skinny_gemm(x, w, block_n=32, block_k=64, splits=8))
    # a different split is a different float32 summation, still within the bar
    assert error(skinny_gemm(x, w, block_n=32, block_k=64, splits=2), x, w, False) <= \
        1.5 * error(x @ w.T, x, w, False)


@pytest.mark.parametrize("kwargs, match", [(dict(block_n=48), "multiple of block_n=48"),
                                           (dict(splits=3), "splits \\* block_k"),
                                           (dict(gated=True, splits=2), "gated=True needs splits=1")])
def test_bad_tiles_are_refused_before_any_launch(kwargs, match):
    x, w = operands(4, 64, 128, torch.float32)
    with pytest.raises(ValueError, match=match):
        skinny_gemm(x, w, block_k=64, **kwargs)


def test_noncontiguous_rows_are_refused():
    x, w = operands(4, 64, 128, torch.float32)
    with pytest.raises(ValueError, match="contiguous rows"):
        skinny_gemm(x.T.contiguous().T, w, block_k=64)


def test_a_weight_of_another_width_is_refused():
    x, w = operands(4, 64, 128, torch.float32)
    with pytest.raises(ValueError, match=r"K = x.shape\[1\] = 128, got w \(64, 256\)"):
        skinny_gemm(x, torch.cat([w, w], dim=1), block_k=64)


def test_triton_gate_up_takes_a_decode_batch_with_the_sweeps_tiles():
    x, w = operands(4, 256, 512, torch.bfloat16)
    assert torch.equal(triton_gate_up(x, w), skinny_gemm(x, w, gated=True, **tile_for(GATED_TILES, 4)))
    assert error(triton_gate_up(x, w), x, w, True) <= 1.5 * error(torch_path(x, w, True), x, w, True)
    for m in (0, GATED_TILES[-1][0] + 1):  # no rows, or a prefill: the layer runs cuBLAS and the gate instead
        with pytest.raises(ValueError, match="1 to 256 rows"):
            triton_gate_up(torch.zeros(m, 512, dtype=torch.bfloat16), w)
    assert GATED_TILES[-1][0] == 256 and [t[0] for t in GATED_TILES] == sorted(t[0] for t in GATED_TILES)
    assert tile_for(GATED_TILES, 17) == dict(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 48, 128, 200, 256])
def test_fused_gate_on_qwen3_shapes_on_the_gpu(m):
    layer = MergedLinear(1024, [3072, 3072]).to("cuda", torch.bfloat16)
    layer.weight.data = operands(1, 6144, 1024, torch.bfloat16, "cuda")[1]
    x = operands(m, 1, 1024, torch.bfloat16, "cuda", seed=1)[0]
    fused = triton_gate_up(x, layer.weight)
    assert fused.shape == (m, 3072)
    assert error(fused, x, layer.weight, True) <= 1.5 * error(silu_and_mul(layer(x)), x, layer.weight, True)
    graph, static_x = torch.cuda.CUDAGraph(), x.clone()
    with torch.cuda.graph(graph):
        static_out = triton_gate_up(static_x, layer.weight)
    static_x.copy_(x * 2)
    graph.replay()
    assert torch.equal(static_out, triton_gate_up(x * 2, layer.weight))
