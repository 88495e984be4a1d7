"""Notebook 16: small decode batches as one chain of Triton kernels under programmatic dependent
launch (kernels/pdl_chain.py), run by the layers of layers/kernel_layers.py that `KernelLayers` builds. On a CPU
(Triton's interpreter): the norm kernel against notebook 02's, and which kernel each layer chose when it was built;
on a GPU (`-m gpu`, Hopper or newer): PDL changes no bit, in a CUDA graph too, and the layers take the chain."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm_edu.kernels.pdl_chain import PDL_MAX_ROWS, PLAIN_TILES, rms_norm_triton
from nanovllm_edu.kernels.skinny_gemm import GATED_TILES, skinny_gemm, tile_for, triton_gate_up
from nanovllm_edu.layers.factory import KernelLayers, LayerFactory, layer_factory_for
from nanovllm_edu.layers.kernel_layers import (TritonGateUp, TritonLinear, TritonQKVLinear, TritonRMSNorm,
                                               tiles_by_rows)
from nanovllm_edu.layers.layernorm import RMSNorm, add_rms_norm, rms_norm
from nanovllm_edu.layers.linear import GateUp, Linear, MergedLinear, QKVLinear
from nanovllm_edu.models.qwen3 import Qwen3ForCausalLM
from nanovllm_edu.utils.loader import default_dtype

from helpers import random_qwen3_config

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


def test_the_factory_of_a_cpu_is_the_plain_one():
    assert type(layer_factory_for(torch.device("cpu"))) is LayerFactory
    if not torch.cuda.is_available():
        assert type(layer_factory_for("cuda")) is LayerFactory  # Triton's interpreter: no kernel layers either


def test_tiles_are_looked_up_once_by_row_count():
    w = torch.empty(4096, 1024, dtype=torch.bfloat16, device="meta")
    tiles = tiles_by_rows(PLAIN_TILES[(4096, 1024)], w, 4096, PDL_MAX_ROWS, PDL_MAX_ROWS)
    assert len(tiles) == PDL_MAX_ROWS and all(t["pdl"] for t in tiles)
    assert tiles[15] == dict(tile_for(PLAIN_TILES[(4096, 1024)], 16), pdl=True) and tiles[16]["block_m"] == 32
    gated = tiles_by_rows(GATED_TILES, torch.empty(6144, 1024, dtype=torch.bfloat16, device="meta"), 3072, 256, 32)
    assert len(gated) == 256 and [t["pdl"] for t in gated[31:33]] == [True, False]
    assert gated[255] == dict(tile_for(GATED_TILES, 256), pdl=False) and tile_for(GATED_TILES, 257) is None
    assert tiles_by_rows(GATED_TILES, torch.empty(6144, 1024, device="meta"), 3072, 256, 32) == []  # float32
    # a tile that does not divide the weight ends the table there: 16 rows' block_n of 32 divides 96 columns,
    # 32 rows' block_n of 64 does not
    assert len(tiles_by_rows(GATED_TILES, torch.empty(192, 384, dtype=torch.bfloat16, device="meta"), 96, 256, 0)) == 16


def test_each_layer_holds_its_choice_from_the_build():
    """Qwen3-0.6B's shapes in bf16 (on meta: no memory): with PDL the chain's layers for up to 32 rows and the
    fused gate up to 256; without, only the fused gate; in float32, or for a shape the tables lack, none."""
    from transformers import AutoConfig

    from nanovllm_edu.assets import qwen3_0_6b_config_path

    cfg = AutoConfig.from_pretrained(qwen3_0_6b_config_path())
    cfg.num_hidden_layers = 1
    with torch.device("meta"), default_dtype(torch.bfloat16):
        chain = Qwen3ForCausalLM(cfg, KernelLayers(pdl=True)).model
        older = Qwen3ForCausalLM(cfg, KernelLayers(pdl=False)).model
    layer = chain.layers[0]
    assert type(layer.self_attn.qkv_proj) is TritonQKVLinear and layer.self_attn.qkv_proj.max_rows == PDL_MAX_ROWS
    assert type(layer.self_attn.o_proj) is TritonLinear and layer.mlp.down_proj.max_rows == PDL_MAX_ROWS
    assert type(layer.input_layernorm) is TritonRMSNorm and chain.norm.max_rows == PDL_MAX_ROWS
    assert type(layer.self_attn.q_norm) is RMSNorm  # per head: plain (a backend may run it with RoPE)
    gate = layer.mlp.gate_up_proj
    assert type(gate) is TritonGateUp and (gate.max_rows, gate.pdl_rows) == (256, PDL_MAX_ROWS)
    layer = older.layers[0]
    assert type(layer.self_attn.qkv_proj) is QKVLinear and type(layer.mlp.down_proj) is Linear
    assert type(layer.post_attention_layernorm) is RMSNorm
    assert type(layer.mlp.gate_up_proj) is TritonGateUp and layer.mlp.gate_up_proj.pdl_rows == 0
    with torch.device("meta"):
        assert TritonLinear(2048, 1024).max_rows == 0 and TritonRMSNorm(1024).max_rows == 0  # float32
        with default_dtype(torch.bfloat16):  # built in the model's dtype, as build_pretrained builds
            assert TritonLinear(2048, 1024).max_rows == PDL_MAX_ROWS and TritonRMSNorm(1024).max_rows == PDL_MAX_ROWS
            assert TritonLinear(64, 64).max_rows == 0  # a shape PLAIN_TILES lacks
            assert TritonLinear(2048, 1024, bias=True).max_rows == 0
            assert TritonGateUp(MergedLinear(1024, [3072, 3072], bias=True)).max_rows == 0


def test_kernel_layers_run_the_kernels_and_fall_back_to_notebook_02s_code():
    """On a CPU, through Triton's interpreter (no PDL): the fused gate for the rows its tiles hold, notebook 02's
    GateUp above; a norm and a linear layer with no tiles are notebook 02's exactly."""
    with default_dtype(torch.bfloat16):
        gate_up = MergedLinear(512, [128, 128])
    torch.nn.init.normal_(gate_up.weight, std=0.05)
    layer, plain = TritonGateUp(gate_up), GateUp(gate_up)
    assert layer.max_rows == 256 and layer.weight is gate_up.weight
    x = rows(4, 512, torch.bfloat16)
    assert torch.equal(layer(x), skinny_gemm(x, gate_up.weight, gated=True, **tile_for(GATED_TILES, 4)))
    torch.testing.assert_close(layer(x), plain(x), rtol=2e-2, atol=2e-2)
    big = rows(257, 512, torch.bfloat16)
    assert torch.equal(layer(big), plain(big)) and torch.equal(layer(x[:0]), plain(x[:0]))
    norm, linear = TritonRMSNorm(64), TritonLinear(64, 32)  # float32: no kernel
    torch.nn.init.normal_(linear.weight)  # a layer's weight starts as torch.empty: garbage (NaN != NaN) until loaded
    x = torch.randn(3, 64)
    assert torch.equal(norm(x), rms_norm(x, norm.weight, norm.eps)) and torch.equal(linear(x), F.linear(x, linear.weight))


def test_the_mlp_runs_the_gate_layer_the_factory_built():
    mlp = Qwen3ForCausalLM(random_qwen3_config(), KernelLayers(pdl=False)).model.layers[0].mlp
    assert type(mlp.gate_up_proj) is TritonGateUp and mlp.gate_up_proj.max_rows == 0  # float32 weights
    for param in mlp.parameters():
        torch.nn.init.normal_(param, std=0.05)
    x = torch.randn(3, mlp.gate_up_proj.weight.shape[1])
    torch.testing.assert_close(mlp(x), mlp.down_proj(GateUp(mlp.gate_up_proj)(x)), rtol=0, atol=0)


def test_the_tables_reach_the_chains_last_row_count():
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
        return gemm(triton_gate_up(h, gate_up.weight, pdl=pdl), down), residual

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
    # the kernel layers (built in bf16: the dtype decides at build) take these rows under PDL, with the chain's
    # bits; cuBLAS's answer is close, and one row more runs notebook 02's code
    with torch.device(dev), default_dtype(dt):
        fast_qkv, fast_norm = TritonLinear(1024, 4096), TritonRMSNorm(1024)
    fast_qkv.weight.data.copy_(qkv.weight)
    fast_norm.weight.data.copy_(norm.weight)
    tile = tile_for(PLAIN_TILES[(4096, 1024)], m)
    assert torch.equal(fast_qkv(x), skinny_gemm(x, qkv.weight, pdl=True, **tile))
    torch.testing.assert_close(fast_qkv(x), F.linear(x, qkv.weight), rtol=2e-2, atol=2e-2)
    assert torch.equal(fast_norm(x), rms_norm(x, norm.weight, norm.eps))
    too_many = rows(PDL_MAX_ROWS + 1, 1024, dt, dev)
    assert torch.equal(fast_qkv(too_many), F.linear(too_many, qkv.weight))
    assert torch.equal(fast_norm(too_many), norm(too_many))
    assert type(layer_factory_for(dev)) is KernelLayers and layer_factory_for(dev).pdl
