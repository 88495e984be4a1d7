"""Notebook 02: each layer against transformers' own module on the same weights, plus the weight loaders,
the layer factory, the attention context and the attention dispatch."""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import LAYER_SHAPES, assert_close, hf, make_random_hf_qwen3, random_tokens as tokens  # noqa: F401 (hf: a fixture)
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3

from nanovllm_edu.layers.activation import silu_and_mul
from nanovllm_edu.utils.step_inputs import StepInputs
from nanovllm_edu.layers.attention import Attention, causal_attention
from nanovllm_edu.layers.backends.base import PagedAttention, attach_kv_cache
from nanovllm_edu.layers.embed_head import Embedding, LMHead
from nanovllm_edu.layers.factory import LayerFactory, layer_factory_for
from nanovllm_edu.layers.layernorm import RMSNorm
from nanovllm_edu.layers.linear import GateUp, Linear, MergedLinear, QKVLinear
from nanovllm_edu.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb, get_rope_theta
from nanovllm_edu.models.qwen3 import (
    PACKED_MODULES_MAPPING,
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3ForCausalLM,
    Qwen3MLP,
)
from nanovllm_edu.utils.loader import load_weights

torch.set_grad_enabled(False)

# ---- activation and norm ----

def test_silu_and_mul(hf):
    mlp, x = hf.model.layers[0].mlp, tokens(hf)
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    assert_close(silu_and_mul(gate_up), mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(hf, dtype):
    ref = copy.deepcopy(hf.model.layers[0].input_layernorm).to(dtype)
    norm = RMSNorm(hf.config.hidden_size, hf.config.rms_norm_eps).to(dtype)
    norm.weight.copy_(ref.weight)
    x = (tokens(hf) * 3).to(dtype)
    # same operations in the same order as transformers: bf16 results are identical too
    if dtype == torch.bfloat16:
        assert torch.equal(norm(x), ref(x))
    else:
        assert_close(norm(x), ref(x))


def test_rmsnorm_fused_residual(hf):
    ref = hf.model.layers[0].post_attention_layernorm
    norm = RMSNorm(hf.config.hidden_size, hf.config.rms_norm_eps)
    norm.weight.copy_(ref.weight)
    x, residual = tokens(hf, seed=1), tokens(hf, seed=2)
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert_close(out, ref(x + residual))
    assert isinstance(norm(x), torch.Tensor)  # without a residual: just the normalised tensor


# ---- rotary embedding ----

def test_get_rope_theta_both_config_styles():
    assert get_rope_theta(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})) == 1e6
    assert get_rope_theta(SimpleNamespace(rope_theta=5e5)) == 5e5  # transformers < 5
    assert get_rope_theta(SimpleNamespace(rope_parameters=None, rope_theta=1234.0)) == 1234.0
    assert get_rope_theta(SimpleNamespace()) == 10000.0
    hf_config = make_random_hf_qwen3(rope_theta=77777.0, num_layers=1).config
    assert get_rope_theta(hf_config) == 77777.0


def test_rotary_matches_hf_with_packed_positions(hf):
    cfg = hf.config
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, get_rope_theta(cfg))
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 300])  # two sequences packed, one far position
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(positions), cfg.num_attention_heads, cfg.head_dim, generator=gen)
    k = torch.randn(len(positions), cfg.num_key_value_heads, cfg.head_dim, generator=gen)
    q_rot, k_rot = rope(positions, q, k)
    cos, sin = hf.model.rotary_emb(q, positions[None])
    hf_q, hf_k = hf_qwen3.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert_close(q_rot, hf_q[0].transpose(0, 1))
    assert_close(k_rot, hf_k[0].transpose(0, 1))


def test_rotary_cache_is_float32_and_relative():
    rope = RotaryEmbedding(16, 64, 10000.0)
    assert rope.cos_sin_cache.dtype == torch.float32 and rope.cos_sin_cache.shape == (64, 16)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(pq, pk):
        return (rope(torch.tensor([pq]), q, k)[0] * rope(torch.tensor([pk]), q, k)[1]).sum()
    assert torch.allclose(score(10, 7), score(40, 37), rtol=1e-4, atol=1e-5)
    x = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    rotated = apply_rotary_emb(x, torch.ones(3, 8), torch.zeros(3, 8))  # angle 0: the identity
    assert rotated.dtype == torch.bfloat16 and torch.equal(rotated, x)


# ---- linear layers ----

def test_qkv_matches_hf_projections(hf):
    attn, x, cfg = hf.model.layers[0].self_attn, tokens(hf), hf.config
    qkv = QKVLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
    for shard_id, proj in [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)]:
        qkv.weight.weight_loader(qkv.weight, proj.weight, shard_id)
    assert_close(qkv(x), torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1))


def test_merged_linear_matches_hf_gate_and_up(hf):
    mlp, x = hf.model.layers[0].mlp, tokens(hf)
    inter = hf.config.intermediate_size
    layer = MergedLinear(hf.config.hidden_size, [inter, inter])
    layer.weight.weight_loader(layer.weight, mlp.up_proj.weight, 1)  # any order: each part has its offset
    layer.weight.weight_loader(layer.weight, mlp.gate_proj.weight, 0)
    gate, up = layer(x).chunk(2, dim=-1)
    assert_close(gate, mlp.gate_proj(x))
    assert_close(up, mlp.up_proj(x))
    gated = GateUp(layer)  # the merged layer's own parameters: loaded once, shared
    assert gated.weight is layer.weight and gated.bias is None
    assert_close(gated(x), mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def test_linear_with_bias():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(8, 6, generator=gen), torch.randn(8, generator=gen)
    x = torch.randn(3, 6, generator=gen)
    layer = Linear(6, 8, bias=True)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    assert_close(layer(x), F.linear(x, w, b))


def test_weight_loader_rejects_wrong_shapes():
    layer = Linear(6, 8)
    with pytest.raises(AssertionError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, torch.randn(8, 5))
    with pytest.raises(AssertionError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, torch.randn(1, 6))  # copy_ alone would broadcast this
    qkv = QKVLinear(8, 2, 2, 1)
    with pytest.raises(AssertionError, match="shape mismatch"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(4, 8), "k")  # k holds one head: 2 rows


def test_weight_loader_converts_dtype():
    layer = Linear(4, 4)
    w = torch.randn(4, 4).to(torch.bfloat16)
    layer.weight.weight_loader(layer.weight, w)
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, w.float())


# ---- embedding and LM head ----

def test_embedding_and_lm_head_match_hf(hf):
    cfg = hf.config
    ids = torch.tensor([0, 5, cfg.vocab_size - 1, 100, 5])
    embed = Embedding(cfg.vocab_size, cfg.hidden_size)
    embed.weight.weight_loader(embed.weight, hf.model.embed_tokens.weight)
    assert_close(embed(ids), hf.model.embed_tokens(ids))
    head = LMHead(cfg.vocab_size, cfg.hidden_size)
    head.weight.weight_loader(head.weight, hf.lm_head.weight)
    x = tokens(hf)
    assert_close(head(x), hf.lm_head(x))


# ---- the layer factory ----

def test_model_builds_its_layers_through_the_factory():
    """Every weight-holding layer comes from the factory, by role: a factory that records its calls sees
    each role the expected number of times, and its layers are the ones in the model."""
    cfg = make_random_hf_qwen3(**LAYER_SHAPES[0], num_layers=2).config
    calls = []

    class Recording(LayerFactory):
        def __getattribute__(self, name):  # every role the model asks for, as it asks
            if not name.startswith("_"):
                calls.append(name)
            return super().__getattribute__(name)

    model = Qwen3ForCausalLM(cfg, Recording())
    # gate_up asks merged_linear for its weight; the per-head q/k norms have no alternative: plain RMSNorm
    roles = ["qkv_linear", "gate_up", "merged_linear", "output_linear", "output_linear", "rms_norm", "rms_norm"]
    assert sorted(calls) == sorted(["embedding", "lm_head", "rms_norm"] + roles * 2)
    layer = model.model.layers[1]
    assert type(layer.self_attn.qkv_proj) is QKVLinear and type(layer.mlp.down_proj) is Linear
    assert type(layer.mlp.gate_up_proj) is GateUp and type(layer.input_layernorm) is RMSNorm
    assert type(model.lm_head) is LMHead and type(model.model.norm) is RMSNorm


def test_a_cpu_model_gets_the_plain_factory():
    """layer_factory_for picks the layers once, by device: on a CPU notebook 02's plain ones, whatever a later
    notebook adds for GPUs."""
    assert type(layer_factory_for(torch.device("cpu"))) is LayerFactory
    assert type(layer_factory_for("cpu")) is LayerFactory


# ---- attention ----

def test_causal_attention_matches_hf_eager(hf):
    cfg, attn = hf.config, hf.model.layers[0].self_attn
    T, d = 11, cfg.head_dim
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(T, cfg.num_attention_heads, d, generator=gen)
    k = torch.randn(T, cfg.num_key_value_heads, d, generator=gen)
    v = torch.randn(T, cfg.num_key_value_heads, d, generator=gen)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    ref, _ = hf_qwen3.eager_attention_forward(attn, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], mask, scaling=d**-0.5)
    layer = Attention(cfg.num_attention_heads, d, d**-0.5, cfg.num_key_value_heads)
    assert_close(layer(q, k, v), ref[0])
    assert_close(causal_attention(q, k, v, d**-0.5), ref[0])


class RecordingBackend:
    "Stands in for an attention backend: records the calls and returns a recognisable output."
    name = "recording"

    def __init__(self):
        self.calls = []

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        self.calls.append(("store", k.shape[0], slot_mapping))

    def prefill(self, q, k, v, k_cache, v_cache, ctx, scale):
        self.calls.append(("prefill", ctx, scale))
        return torch.full_like(q, 1.0)

    def decode(self, q, k_cache, v_cache, ctx, scale):
        self.calls.append(("decode", ctx, scale))
        return torch.full_like(q, 2.0)


def _step(is_prefill, n, **kw):
    return StepInputs(is_prefill, torch.zeros(n, dtype=torch.long), torch.arange(n), torch.arange(n), **kw)


def test_attention_dispatches_to_backend():
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    backend = RecordingBackend()
    layer = PagedAttention(Attention(4, 8, 0.25, 2), torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8), backend)
    # no step inputs: plain causal attention, the backend is not called
    assert_close(layer(q, k, v), causal_attention(q, k, v, 0.25))
    assert backend.calls == []
    slots = torch.arange(5)
    step = _step(True, 5, cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32))
    assert torch.equal(layer(q, k, v, step), torch.ones_like(q))
    assert backend.calls[0][:2] == ("store", 5) and torch.equal(backend.calls[0][2], slots)
    kind, got, scale = backend.calls[1]
    assert kind == "prefill" and got is step and scale == 0.25
    step = _step(False, 2, context_lens=torch.tensor([3, 4], dtype=torch.int32))
    assert torch.equal(layer(q[:2], k[:2], v[:2], step), torch.full_like(q[:2], 2.0))
    assert [c[0] for c in backend.calls] == ["store", "prefill", "store", "decode"]


def test_plain_attention_ignores_step_inputs():
    "Notebook 02's attention treats the tokens as one sequence whatever the engine passes along."
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    layer = Attention(4, 8, 0.25, 2)
    assert_close(layer(q, k, v, _step(True, 5)), causal_attention(q, k, v, 0.25))


def test_attach_kv_cache_swaps_every_attention_in_order():
    model = torch.nn.ModuleList([torch.nn.ModuleDict({"attn": Attention(2, 4, 0.5, 1)}) for _ in range(3)])
    cache = torch.randn(2, 3, 5, 16, 1, 4)
    backend = RecordingBackend()
    attached = attach_kv_cache(model, cache, backend)
    assert [m["attn"] for m in model] == attached and all(a.backend is backend for a in attached)
    assert all(a.k_cache.data_ptr() == cache[0, i].data_ptr() and a.v_cache.data_ptr() == cache[1, i].data_ptr()
               for i, a in enumerate(attached))
    with pytest.raises(ValueError, match="attention layers"):
        attach_kv_cache(model, cache[:, :2], backend)


def test_step_inputs_to_device_and_counts():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    step = _step(True, 5, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3,
                 logits_indices=torch.tensor([2, 4]))
    assert step.num_seqs == 2 and step.num_sampled == 2
    moved = step.to("cpu")
    assert moved.cu_seqlens_q.dtype == torch.int32 and torch.equal(moved.cu_seqlens_q, cu) and moved.is_prefill
    decode = _step(False, 3, context_lens=torch.tensor([4, 5, 6], dtype=torch.int32))
    assert decode.num_seqs == 3 and decode.num_sampled == 3


# ---- Qwen3 blocks ----

def _hf_rope(hf, x, positions):
    return hf.model.rotary_emb(x, positions[None])


def test_qwen3_attention_block_matches_hf(hf):
    ref = hf.model.layers[0].self_attn
    ours = Qwen3Attention(hf.config)
    load_weights(ours, ref.state_dict().items(), PACKED_MODULES_MAPPING)
    x, positions = tokens(hf), torch.arange(9)
    out, _ = ref(x[None], position_embeddings=_hf_rope(hf, x, positions), attention_mask=None)
    assert_close(ours(positions, x), out[0])
    assert isinstance(ours.attn, Attention)


def test_qwen3_mlp_matches_hf(hf):
    ref = hf.model.layers[0].mlp
    ours = Qwen3MLP(hf.config)
    load_weights(ours, ref.state_dict().items(), PACKED_MODULES_MAPPING)
    x = tokens(hf)
    assert_close(ours(x), ref(x))


def test_decoder_layer_matches_hf(hf):
    ref = hf.model.layers[0]
    ours = Qwen3DecoderLayer(hf.config)
    load_weights(ours, ref.state_dict().items(), PACKED_MODULES_MAPPING)
    x, positions = tokens(hf), torch.arange(9)
    out = ref(x[None], attention_mask=None, position_embeddings=_hf_rope(hf, x, positions))
    out = out[0] if isinstance(out, tuple) else out
    # first layer: no residual yet
    mlp_out, residual = ours(positions, x, None)
    assert_close(mlp_out + residual, out[0])
    # a later layer: the pending residual add is done by the input norm
    pending = tokens(hf, seed=9)
    mlp_out, residual = ours(positions, pending, x)
    out = ref((x + pending)[None], attention_mask=None, position_embeddings=_hf_rope(hf, x, positions))
    out = out[0] if isinstance(out, tuple) else out
    assert_close(mlp_out + residual, out[0])


def test_packed_modules_mapping_is_the_spec():
    assert Qwen3ForCausalLM.packed_modules_mapping == {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


