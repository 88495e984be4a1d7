"""Notebook 04: paged torch attention against plain causal attention (prefill with and without a cached
prefix, decode, GQA, block sizes 16/256), and picking a backend by name (the registry)."""
import pytest
import torch
from attention_helpers import PagedSetup, cu, reference_attention, attn_step

pytest.importorskip("hypothesis")  # the dev extra: a bare GPU machine (`pytest -m gpu`) may lack it
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm_edu.layers.backends.base import AttentionBackend
from nanovllm_edu.layers.backends.registry import get_attention_backend
from nanovllm_edu.layers.backends.torch_backend import TorchBackend


# ---------------------------------------------------------------- paged attention

CASES = [(16, 4, 4), (16, 4, 2), (16, 8, 1), (256, 4, 2), (256, 6, 3)]  # block size, heads, kv heads


@pytest.mark.parametrize("block_size,heads,kv_heads", CASES)
def test_prefill_without_prefix(block_size, heads, kv_heads):
    s = PagedSetup([37, 1, 16, 70], block_size, heads, kv_heads)
    backend = TorchBackend()
    slots = torch.tensor([x for i, n in enumerate(s.lengths) for x in s.slots(i, 0, n)])
    ctx = attn_step(is_prefill=True, cu_seqlens_q=cu(s.lengths), cu_seqlens_k=cu(s.lengths),
                  max_seqlen_q=max(s.lengths), max_seqlen_k=max(s.lengths), slot_mapping=slots)
    k, v = torch.cat(s.k), torch.cat(s.v)
    backend.store_kvcache(k, v, s.k_cache, s.v_cache, slots)
    out = backend.prefill(torch.cat(s.q), k, v, s.k_cache, s.v_cache, ctx, s.scale)
    torch.testing.assert_close(out, torch.cat(s.expected), atol=2e-5, rtol=1e-4)
    # the same step read through the cache (block tables set, nothing cached before) agrees too
    ctx.block_tables = s.block_tables
    out = TorchBackend().prefill(torch.cat(s.q), k, v, s.k_cache, s.v_cache, ctx, s.scale)
    torch.testing.assert_close(out, torch.cat(s.expected), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size,heads,kv_heads", CASES)
def test_prefill_with_cached_prefix(block_size, heads, kv_heads):
    s = PagedSetup([37, 20, 300, 5], block_size, heads, kv_heads, seed=1)
    backend = TorchBackend()
    cached = [32, 19, 256, 0]  # tokens already in the cache; the rest is this step's chunk
    # store only the cached part first, as an earlier step would have
    pre = torch.tensor([x for i, c in enumerate(cached) for x in s.slots(i, 0, c)])
    backend.store_kvcache(torch.cat([k[:c] for k, c in zip(s.k, cached)]),
                          torch.cat([v[:c] for v, c in zip(s.v, cached)]), s.k_cache, s.v_cache, pre)
    new = [n - c for n, c in zip(s.lengths, cached)]
    slots = torch.tensor([x for i, (c, n) in enumerate(zip(cached, s.lengths)) for x in s.slots(i, c, n)])
    ctx = attn_step(is_prefill=True, cu_seqlens_q=cu(new), cu_seqlens_k=cu(s.lengths), max_seqlen_q=max(new),
                  max_seqlen_k=max(s.lengths), slot_mapping=slots, block_tables=s.block_tables)
    q = torch.cat([x[c:] for x, c in zip(s.q, cached)])
    k = torch.cat([x[c:] for x, c in zip(s.k, cached)])
    v = torch.cat([x[c:] for x, c in zip(s.v, cached)])
    backend.store_kvcache(k, v, s.k_cache, s.v_cache, slots)
    out = backend.prefill(q, k, v, s.k_cache, s.v_cache, ctx, s.scale)
    expected = torch.cat([e[c:] for e, c in zip(s.expected, cached)])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size,heads,kv_heads", CASES)
def test_decode(block_size, heads, kv_heads):
    lengths = [1, 17, 300, 64, 5]
    s = PagedSetup(lengths, block_size, heads, kv_heads, seed=2)
    backend = TorchBackend()
    s.store_all(backend)
    ctx = attn_step(is_prefill=False, context_lens=torch.tensor(lengths, dtype=torch.int32),
                  block_tables=s.block_tables,
                  slot_mapping=torch.tensor([s.slots(i, n - 1, n)[0] for i, n in enumerate(lengths)]))
    out = backend.decode(torch.stack([q[-1] for q in s.q]), s.k_cache, s.v_cache, ctx, s.scale)
    torch.testing.assert_close(out, torch.stack([e[-1] for e in s.expected]), atol=2e-5, rtol=1e-4)


def test_single_sequence_prefill_fast_path():
    s = PagedSetup([50], 16, 4, 2)
    ctx = attn_step(is_prefill=True, cu_seqlens_q=cu([50]), cu_seqlens_k=cu([50]), max_seqlen_q=50, max_seqlen_k=50)
    out = TorchBackend().prefill(s.q[0], s.k[0], s.v[0], s.k_cache, s.v_cache, ctx, s.scale)
    torch.testing.assert_close(out, s.expected[0], atol=2e-5, rtol=1e-4)


def test_plan_reused_across_layers_is_right_for_each_layer():
    """One context, two layers with different caches: the per-step plan must not mix them up."""
    lengths = [9, 30]
    layers = [PagedSetup(lengths, 16, 4, 2, seed=seed) for seed in (3, 4)]
    # same block tables for both layers (one engine, one block manager)
    layers[1].tables, layers[1].block_tables = layers[0].tables, layers[0].block_tables
    backend = TorchBackend()
    ctx = attn_step(is_prefill=False, context_lens=torch.tensor(lengths, dtype=torch.int32),
                  block_tables=layers[0].block_tables)
    for s in layers:
        s.store_all(backend)
    for s in layers:
        out = backend.decode(torch.stack([q[-1] for q in s.q]), s.k_cache, s.v_cache, ctx, s.scale)
        torch.testing.assert_close(out, torch.stack([e[-1] for e in s.expected]), atol=2e-5, rtol=1e-4)
    # a new step (new context object) with other lengths is not served the old plan
    short = [5, 3]
    ctx2 = attn_step(is_prefill=False, context_lens=torch.tensor(short, dtype=torch.int32),
                   block_tables=layers[0].block_tables)
    s = layers[0]
    q = torch.stack([s.q[0][4], s.q[1][2]])
    out = backend.decode(q, s.k_cache, s.v_cache, ctx2, s.scale)
    expected = torch.stack([reference_attention(s.q[0][:5], s.k[0][:5], s.v[0][:5], s.scale)[-1],
                            reference_attention(s.q[1][:3], s.k[1][:3], s.v[1][:3], s.scale)[-1]])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(0, 60)), min_size=1, max_size=5),
       st.sampled_from([16, 32]), st.sampled_from([(4, 4), (4, 2), (4, 1)]))
def test_random_chunked_prefill_matches_reference(seqs, block_size, heads):
    """Random (new tokens, cached tokens) pairs: paged prefill equals causal attention over the whole context."""
    lengths = [n + c for n, c in seqs]
    cached = [c for _, c in seqs]
    s = PagedSetup(lengths, block_size, heads[0], heads[1], seed=sum(lengths))
    backend = TorchBackend()
    s.store_all(backend)
    new = [n for n, _ in seqs]
    ctx = attn_step(is_prefill=True, cu_seqlens_q=cu(new), cu_seqlens_k=cu(lengths), max_seqlen_q=max(new),
                  max_seqlen_k=max(lengths), block_tables=s.block_tables if any(cached) else None)
    q = torch.cat([x[c:] for x, c in zip(s.q, cached)])
    k = torch.cat([x[c:] for x, c in zip(s.k, cached)])
    v = torch.cat([x[c:] for x, c in zip(s.v, cached)])
    out = backend.prefill(q, k, v, s.k_cache, s.v_cache, ctx, s.scale)
    torch.testing.assert_close(out, torch.cat([e[c:] for e, c in zip(s.expected, cached)]), atol=3e-5, rtol=1e-4)


def test_bfloat16_decode_close_to_float32():
    s = PagedSetup([40, 7], 16, 4, 2)
    backend = TorchBackend()
    s.store_all(backend)
    ctx = attn_step(is_prefill=False, context_lens=torch.tensor([40, 7], dtype=torch.int32), block_tables=s.block_tables)
    q = torch.stack([x[-1] for x in s.q])
    out = TorchBackend().decode(q.bfloat16(), s.k_cache.bfloat16(), s.v_cache.bfloat16(), ctx, s.scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.stack([e[-1] for e in s.expected]), atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------- backend selection

def test_get_attention_backend():
    cpu = torch.device("cpu")
    assert isinstance(get_attention_backend("torch", cpu), TorchBackend)
    assert isinstance(get_attention_backend("auto", cpu), TorchBackend)
    assert isinstance(TorchBackend(), AttentionBackend) and TorchBackend.name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'.*registered: auto, torch"):
        get_attention_backend("sdpa", cpu)


def test_every_course_backend_registers_from_the_modules_llm_imports():
    """In a fresh process, importing the package's LLM registers torch, Triton and flash-attn; before, a
    course backend that is not imported yet is named with the import that registers it."""
    import subprocess
    import sys
    code = ("from nanovllm_edu.layers.backends.registry import ATTENTION_BACKEND_REGISTRY, get_attention_backend\n"
            "try:\n    get_attention_backend('triton')\nexcept ValueError as err:\n    print('before:', err)\n"
            "import nanovllm_edu.llm\nprint('after:', sorted(ATTENTION_BACKEND_REGISTRY))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "before: unknown attention backend 'triton' (a course backend whose module is not imported" in out
    assert "after: ['flash_attn', 'torch', 'triton']" in out


def test_flash_attn_missing_is_a_clear_error():
    pytest.importorskip("nanovllm_edu.utils.device")
    from nanovllm_edu.utils.device import flash_attn_available
    if flash_attn_available():
        pytest.skip("flash-attn is installed")
    pytest.importorskip("nanovllm_edu.layers.backends.flash_attn_backend")  # its import registers it
    with pytest.raises(ImportError, match="flash-attn"):
        get_attention_backend("flash_attn", torch.device("cpu"))


def test_triton_backend_registers_when_imported():
    pytest.importorskip("nanovllm_edu.layers.backends.triton_backend")  # its import registers it
    backend = get_attention_backend("triton", torch.device("cpu"))
    assert isinstance(backend, AttentionBackend) and type(backend).__name__ == "TritonBackend"



def test_paged_attention_hands_prepare_qk_to_its_backend_only_with_step_inputs():
    """QK-norm and RoPE go through the backend in an engine step; without step inputs (model.logits) the
    paged layer runs the model's modules, as the plain attention it replaced does."""
    from nanovllm_edu.layers.attention import Attention
    from nanovllm_edu.layers.backends.base import PagedAttention
    from nanovllm_edu.layers.layernorm import RMSNorm
    from nanovllm_edu.layers.rotary_embedding import RotaryEmbedding

    class Recording(TorchBackend):
        calls = 0

        def prepare_qk(self, *args):
            self.calls += 1
            return super().prepare_qk(*args)

    backend = Recording()
    paged = PagedAttention(Attention(4, 16, 0.25, 2), torch.zeros(1, 16, 2, 16), torch.zeros(1, 16, 2, 16), backend)
    gen = torch.Generator().manual_seed(0)
    args = (torch.tensor([3, 0, 9]), torch.randn(3, 4, 16, generator=gen), torch.randn(3, 2, 16, generator=gen),
            RMSNorm(16), RMSNorm(16), RotaryEmbedding(16, 32, 10000.0))
    expected = args[5](args[0], args[3](args[1]), args[4](args[2]))
    plain = paged.prepare_qk(*args)
    assert backend.calls == 0 and all(map(torch.equal, plain, expected))
    through_backend = paged.prepare_qk(*args, attn_step(is_prefill=False))
    assert backend.calls == 1 and all(map(torch.equal, through_backend, expected))
