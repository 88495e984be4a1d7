"""Notebook 12: QK-norm and RoPE in one Triton kernel (`kernels.qk_norm_rope`) against the model's modules.

On CPU the kernel runs in Triton's interpreter; the `gpu` tests run Qwen3-0.6B's shapes on a CUDA GPU.
"""
import nanovllm_edu  # noqa: F401  (first: sets TRITON_INTERPRET=1 when there is no CUDA GPU)
import pytest
import torch

pytest.importorskip("triton")

from nanovllm_edu.kernels.qk_norm_rope import qk_norm_rope
from nanovllm_edu.layers.attention import Attention
from nanovllm_edu.layers.backends.base import AttentionBackend
from nanovllm_edu.layers.backends.torch_backend import TorchBackend
from nanovllm_edu.layers.backends.triton_backend import TritonBackend
from nanovllm_edu.layers.layernorm import RMSNorm, rms_norm
from nanovllm_edu.layers.rotary_embedding import RotaryEmbedding, rotate_qk

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-6
# (query heads, KV heads, head_dim): the test checkpoints', a GQA of 3 with counts that are not powers of
# two, the tiny model's, one KV head, and Qwen3-0.6B's
SHAPES = [(4, 2, 16), (6, 2, 32), (4, 2, 64), (3, 1, 64), (16, 8, 128)]
BF16_ULP = 2.0 ** -7  # bfloat16 keeps 8 significant bits: one unit in the last place is <= 2^-7 relative


def by_modules(positions, q, k, q_weight, k_weight, cos_sin_cache):
    """What the model's modules compute (notebook 02): RMSNorm of each head of q and k, then RoPE."""
    return rotate_qk(positions, rms_norm(q, q_weight, EPS), rms_norm(k, k_weight, EPS), cos_sin_cache)


def qkv_case(num_tokens, heads, kv_heads, head_dim, dtype, device="cpu", exact=False, seed=0, max_position=512):
    """q and k as strided views of one qkv buffer (as the model splits it), gains, positions, RoPE cache.
    `exact`: multiples of 1/8 in [-2, 2], whose sums of squares are exact in float32 in any order."""
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    if exact:
        qkv = torch.randint(-16, 17, (num_tokens, width), generator=gen) / 8
    else:
        qkv = torch.randn(num_tokens, width, generator=gen) * 2
    gains = torch.rand(2, head_dim, generator=gen) + 0.5
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    qkv, gains = qkv.to(device, dtype), gains.to(device, dtype)
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, max_position, 10000.0).to(device)
    return positions.to(device), q, k, gains[0], gains[1], rope.cos_sin_cache


def assert_within_bf16_rounding(ours, ref):
    """Each value within two bfloat16 ulps of the length of the pair (i, i + D/2) that RoPE rotates it with.
    A last-bit difference of the normalised pair (its sum of squares added in another order, or an FMA)
    moves a rotated value by at most one ulp of that length; the rounding of the value itself adds one."""
    ref = ref.float()
    first, second = ref.chunk(2, dim=-1)
    pair_length = torch.sqrt(first ** 2 + second ** 2).repeat(1, 1, 2)
    assert ((ours.float() - ref).abs() <= 2 * BF16_ULP * pair_length).all()


# ---------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_bit_identical_when_the_sum_of_squares_is_exact(heads, kv_heads, head_dim, dtype):
    case = qkv_case(5, heads, kv_heads, head_dim, dtype, exact=True)
    for ours, ref in zip(qk_norm_rope(*case[:5], EPS, EPS, case[5]), by_modules(*case)):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape and ours.is_contiguous()
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_random_inputs_float32_within_1e_6(heads, kv_heads, head_dim):
    case = qkv_case(7, heads, kv_heads, head_dim, torch.float32, seed=1)
    for ours, ref in zip(qk_norm_rope(*case[:5], EPS, EPS, case[5]), by_modules(*case)):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_random_inputs_bf16_within_one_ulp(heads, kv_heads, head_dim):
    case = qkv_case(7, heads, kv_heads, head_dim, torch.bfloat16, seed=2)
    for ours, ref in zip(qk_norm_rope(*case[:5], EPS, EPS, case[5]), by_modules(*case)):
        assert_within_bf16_rounding(ours, ref)
        assert (ours != ref).float().mean() < 0.01  # only the sum of squares is added in another order


def test_any_token_and_head_strides():
    """Heads-major storage (head stride > token stride) and a gap between heads read through the strides."""
    positions, q, k, wq, wk, cache = qkv_case(6, 6, 2, 32, torch.float32, exact=True, seed=3)
    q_heads_major = q.transpose(0, 1).contiguous().transpose(0, 1)  # strides (32, 6 * 32, 1)
    k_gapped = torch.zeros(6, 2, 64)
    k_gapped[..., :32] = k
    k_gapped = k_gapped[..., :32]  # strides (128, 64, 1)
    assert q_heads_major.stride() == (32, 192, 1) and k_gapped.stride() == (128, 64, 1)
    for ours, ref in zip(qk_norm_rope(positions, q_heads_major, k_gapped, wq, wk, EPS, EPS, cache),
                         by_modules(positions, q, k, wq, wk, cache)):
        assert torch.equal(ours, ref)


def test_inputs_are_left_untouched_and_no_tokens_is_fine():
    positions, q, k, wq, wk, cache = qkv_case(3, 4, 2, 16, torch.bfloat16, seed=4)
    q_before, k_before = q.clone(), k.clone()
    qk_norm_rope(positions, q, k, wq, wk, EPS, EPS, cache)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    q0, k0 = qk_norm_rope(positions[:0], q[:0], k[:0], wq, wk, EPS, EPS, cache)
    assert q0.shape == (0, 4, 16) and k0.shape == (0, 2, 16)


def test_separate_epsilons_for_queries_and_keys():
    positions, q, k, wq, wk, cache = qkv_case(4, 4, 2, 16, torch.float32, exact=True, seed=5)
    q_out, k_out = qk_norm_rope(positions, q * 1e-3, k * 1e-3, wq, wk, 1e-2, 1e-8, cache)
    ref_q, ref_k = rotate_qk(positions, rms_norm(q * 1e-3, wq, 1e-2), rms_norm(k * 1e-3, wk, 1e-8), cache)
    torch.testing.assert_close(q_out, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out, ref_k, rtol=1e-6, atol=1e-6)


def test_triton_backend_prepares_qk_with_the_kernel_and_others_use_the_modules():
    positions, q, k, wq, wk, cache = qkv_case(5, 6, 2, 32, torch.float32, exact=True, seed=6)
    q_norm, k_norm, rope = RMSNorm(32, EPS), RMSNorm(32, EPS), RotaryEmbedding(32, 512, 10000.0)
    with torch.no_grad():
        q_norm.weight.copy_(wq)
        k_norm.weight.copy_(wk)
    args = (positions, q, k, q_norm, k_norm, rope)
    with torch.no_grad():
        plain = Attention(6, 32, 32 ** -0.5, 2).prepare_qk(*args)
        assert all(torch.equal(a, b) for a, b in zip(plain, by_modules(positions, q, k, wq, wk, cache)))
        for backend in (TorchBackend(), TritonBackend()):
            assert all(torch.equal(a, b) for a, b in zip(backend.prepare_qk(*args), plain)), backend.name
    assert TorchBackend.prepare_qk is AttentionBackend.prepare_qk  # the default: the model's own modules
    assert TritonBackend.prepare_qk is not AttentionBackend.prepare_qk


def test_asserts_name_what_the_kernel_needs():
    positions, q, k, wq, wk, cache = qkv_case(2, 4, 2, 16, torch.float32)
    with pytest.raises(AssertionError, match="power of two"):
        qk_norm_rope(positions, q[..., :12], k[..., :12], wq[:12], wk[:12], EPS, EPS, cache[:, :12])
    with pytest.raises(AssertionError, match="share a dtype"):
        qk_norm_rope(positions, q, k, wq.bfloat16(), wk, EPS, EPS, cache)


# ---------------------------------------------------------------- GPU
@gpu
@needs_cuda
def test_gpu_qwen3_shapes_match_the_modules():
    """Qwen3-0.6B decode at batch 256 in bfloat16: within bf16 rounding of the modules run eagerly (torch ops,
    each rounded) and of the torch.compile'd modules the engine runs without this kernel."""
    positions, q, k, wq, wk, cache = qkv_case(256, 16, 8, 128, torch.bfloat16, device="cuda", seed=7,
                                              max_position=40960)
    ours = qk_norm_rope(positions, q, k, wq, wk, EPS, EPS, cache)
    eager = rotate_qk(positions, rms_norm(q, wq, EPS), rms_norm(k, wk, EPS),
                                  cache)
    # the eager ops round where the kernel does: under 1% of values may differ (summation order); torch.compile
    # keeps float32 between the norm and the gain, so ~30% of values differ from it by a bf16 ulp (H200)
    for ref, max_differing in ((eager, 0.01), (by_modules(positions, q, k, wq, wk, cache), 0.5)):
        for a, b in zip(ours, ref):
            assert_within_bf16_rounding(a, b)
            assert (a != b).float().mean() < max_differing
    exact = qkv_case(256, 16, 8, 128, torch.float32, device="cuda", exact=True, seed=8, max_position=40960)
    for a, b in zip(qk_norm_rope(*exact[:5], EPS, EPS, exact[5]), by_modules(*exact)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # FMA contraction may move a last bit


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay_reads_new_positions_and_values():
    positions, q, k, wq, wk, cache = qkv_case(64, 6, 2, 64, torch.bfloat16, device="cuda", seed=9)
    qk_norm_rope(positions, q, k, wq, wk, EPS, EPS, cache)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = qk_norm_rope(positions, q, k, wq, wk, EPS, EPS, cache)
    new = qkv_case(64, 6, 2, 64, torch.bfloat16, device="cuda", seed=10)
    positions.copy_(new[0])
    q.copy_(new[1])
    k.copy_(new[2])
    graph.replay()
    for a, b in zip((q_out, k_out), qk_norm_rope(positions, q, k, wq, wk, EPS, EPS, cache)):
        assert torch.equal(a, b)
