"""Notebook 14, third case study: small decode batches as one chain of Triton kernels under programmatic dependent
launch (kernels/pdl_chain.py). On a CPU (Triton's interpreter): the norm kernel against notebook 02's, and how
the layers ask the registries; on a GPU (`-m gpu`, Hopper or newer): PDL changes no bit, in a CUDA graph too."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm_edu.kernels.pdl_chain import (PDL_MAX_ROWS, PLAIN_TILES, pdl_gate_up, pdl_linear, pdl_rms_norm, pdl_rows,
                                            rms_norm_triton)
from nanovllm_edu.kernels.skinny_gemm import skinny_gemm, triton_gate_up
from nanovllm_edu.layers import layernorm, linear
from nanovllm_edu.layers.activation import FUSED_GATE_UP, first_kernel
from nanovllm_edu.layers.layernorm import NORM_KERNELS, RMSNorm, add_rms_norm, rms_norm
from nanovllm_edu.layers.linear import LINEAR_KERNELS, Linear, MergedLinear

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def rows(m: int, hidden: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    return (torch.randn(m, hidden, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, hidden", [(1, 64), (5, 96), (3, 1024)])
def test_norm_kernel_gives_notebook_02s_bits(dtype, m, hidden):
    x, residual = rows(m, hidden, dtype), rows(m, hidden, dtype, seed=1)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    assert torch.equal(rms_norm_triton(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    out, new_residual = rms_norm_triton(x, weight, 1e-6, residual)
    want, want_residual = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(out, want) and torch.equal(new_residual, want_residual)
    assert torch.equal(residual, rows(m, hidden, dtype, seed=1))  # the inputs are kept


def test_norm_kernel_refuses_what_it_cannot_read():
    x, weight = rows(4, 64, torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm_triton(x.t(), weight, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, weight, 1e-6, residual=x[:2])
    assert rms_norm_triton(x[:0], weight, 1e-6).shape == (0, 64)


def test_layers_ask_the_registries_first(monkeypatch):
    layer, norm, x = Linear(16, 8), RMSNorm(16), torch.randn(3, 16)
    torch.nn.init.normal_(layer.weight)
    calls = []

    def declines(*args):
        calls.append("declined")

    monkeypatch.setattr(linear, "LINEAR_KERNELS", [declines, lambda x, layer: x[:, :8] * 0 + 7])
    monkeypatch.setattr(layernorm, "NORM_KERNELS", [declines])
    assert torch.equal(layer(x), torch.full((3, 8), 7.0)) and calls == ["declined"]
    assert torch.equal(norm(x), rms_norm(x, norm.weight, norm.eps)) and calls == ["declined"] * 2
    monkeypatch.setattr(linear, "LINEAR_KERNELS", [declines])
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert first_kernel([declines, declines], x) is None


def test_registering_again_replaces_rather_than_duplicates():
    import importlib

    from nanovllm_edu.kernels import pdl_chain, skinny_gemm
    from nanovllm_edu.utils.device import register_kernel

    importlib.reload(skinny_gemm)  # a module imported again (as a notebook's cell beside its module) registers anew
    importlib.reload(pdl_chain)
    names = lambda kernels: [k.__name__ for k in kernels]  # noqa: E731
    assert names(FUSED_GATE_UP) == ["pdl_gate_up", "triton_gate_up"]
    assert names(LINEAR_KERNELS) == ["pdl_linear"] and names(NORM_KERNELS) == ["pdl_rms_norm"]
    kernels = []
    for kernel in (pdl_linear, pdl_rms_norm, pdl_linear):
        register_kernel(kernels, kernel)
    assert names(kernels) == ["pdl_rms_norm", "pdl_linear"]


def test_the_chain_is_registered_and_declines_off_a_hopper_gpu():
    names = [k.__name__ for k in FUSED_GATE_UP]
    assert [k.__name__ for k in LINEAR_KERNELS + NORM_KERNELS] == ["pdl_linear", "pdl_rms_norm"]
    assert names.index("pdl_gate_up") < names.index("triton_gate_up")
    x = rows(4, 1024, torch.bfloat16)
    assert not pdl_rows(x) and pdl_rms_norm(x, None, RMSNorm(1024)) is None
    assert pdl_linear(x, Linear(1024, 4096)) is None and pdl_gate_up(x, MergedLinear(1024, [3072, 3072])) is None
    for tiles in PLAIN_TILES.values():  # every table reaches the chain's last row count, in increasing order
        assert [t[0] for t in tiles] == sorted(t[0] for t in tiles) and tiles[-1][0] >= PDL_MAX_ROWS


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU with programmatic dependent launch (Hopper or newer)")
@pytest.mark.parametrize("m", [1, 7, PDL_MAX_ROWS])
def test_pdl_changes_no_bit_in_a_cuda_graph(m):
    """One decoder layer's chain (norm, qkv, o, norm, gate, down) on Qwen3-0.6B's shapes: under PDL, eagerly and
    replayed from a CUDA graph, the same bits as the same kernels launched without it, and close to cuBLAS."""
    torch.manual_seed(m)
    dev, dt = "cuda", torch.bfloat16
    qkv, o, down = (Linear(k, n).to(dev, dt) for n, k in PLAIN_TILES)
    gate_up = MergedLinear(1024, [3072, 3072]).to(dev, dt)
    norm = RMSNorm(1024).to(dev, dt)
    for layer in (qkv, o, gate_up, down):
        torch.nn.init.normal_(layer.weight, std=layer.weight.shape[1] ** -0.5)
    x, residual = rows(m, 1024, dt, dev), rows(m, 1024, dt, dev, seed=1)

    def layer_chain(x, residual, pdl: bool):
        h, residual = rms_norm_triton(x, norm.weight, norm.eps, residual, pdl=pdl)
        tiles = {k: next(t[1:] for t in v if m <= t[0]) for k, v in PLAIN_TILES.items()}

        def gemm(h, layer):
            bm, bn, bk, warps, stages = tiles[tuple(layer.weight.shape)]
            return skinny_gemm(h, layer.weight, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                               num_stages=stages, pdl=pdl)
        h = gemm(gemm(h, qkv)[:, :2048].contiguous(), o)
        h, residual = rms_norm_triton(h, norm.weight, norm.eps, residual, pdl=pdl)
        return gemm(triton_gate_up(h, gate_up, pdl=pdl), down), residual

    plain = layer_chain(x, residual, pdl=False)
    assert all(torch.equal(a, b) for a, b in zip(layer_chain(x, residual, pdl=True), plain))
    static_x, static_residual = x.clone(), residual.clone()
    layer_chain(static_x, static_residual, pdl=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer_chain(static_x, static_residual, pdl=True)
    static_x.copy_(x * 2)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(static_out, layer_chain(x * 2, residual, pdl=False)))
    # the registered kernels take these rows and give the same bits; cuBLAS's answer is close
    assert torch.equal(qkv(x), pdl_linear(x, qkv)) and pdl_rows(x)
    torch.testing.assert_close(pdl_linear(x, qkv), F.linear(x, qkv.weight), rtol=2e-2, atol=2e-2)
    assert torch.equal(norm(x), rms_norm.__wrapped__(x, norm.weight, norm.eps))
    too_many = rows(PDL_MAX_ROWS + 1, 1024, dt, dev)
    assert pdl_linear(too_many, qkv) is None and pdl_rms_norm(too_many, None, norm) is None
