"""Notebook 17: the tensor-parallel layers cut each checkpoint tensor into the right shards, and
`TensorParallelLayers` hands one model class its shard of every weight: the shards, combined the way the
collectives combine them, give the full model's outputs (in one process, no process group)."""
import pytest
import torch
import torch.nn.functional as F
from helpers import LAYER_SHAPES, assert_close, hf, make_random_hf_qwen3, random_tokens as tokens  # noqa: F401 (hf: a fixture)

from nanovllm_edu.layers.activation import silu_and_mul
from nanovllm_edu.layers.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallelLayers,
    VocabParallelEmbedding,
    divide,
)
from nanovllm_edu.models.qwen3 import Qwen3ForCausalLM

torch.set_grad_enabled(False)

def test_divide():
    assert divide(12, 4) == 3
    with pytest.raises(AssertionError, match="not divisible"):
        divide(10, 4)
    with pytest.raises(AssertionError, match="not divisible"):
        QKVParallelLinear(64, 16, 4, 2, tp_size=4)  # 2 KV heads over 4 ranks


def test_qkv_tensor_parallel_slices_whole_heads(hf):
    attn, x, cfg = hf.model.layers[0].self_attn, tokens(hf), hf.config
    d, tp_size = cfg.head_dim, 2
    for rank in range(tp_size):
        qkv = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                tp_rank=rank, tp_size=tp_size)
        assert qkv.num_heads == cfg.num_attention_heads // tp_size
        assert qkv.num_kv_heads == cfg.num_key_value_heads // tp_size
        for shard_id, proj in [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)]:
            qkv.weight.weight_loader(qkv.weight, proj.weight, shard_id)
        q, k, v = qkv(x).split([qkv.num_heads * d, qkv.num_kv_heads * d, qkv.num_kv_heads * d], dim=-1)
        qh, kvh = qkv.num_heads * d, qkv.num_kv_heads * d
        assert_close(q, attn.q_proj(x)[:, rank * qh:(rank + 1) * qh])
        assert_close(k, attn.k_proj(x)[:, rank * kvh:(rank + 1) * kvh])
        assert_close(v, attn.v_proj(x)[:, rank * kvh:(rank + 1) * kvh])


@pytest.mark.parametrize("tp_size", [1, 2])
def test_merged_column_parallel(hf, tp_size):
    mlp, x = hf.model.layers[0].mlp, tokens(hf)
    inter = hf.config.intermediate_size
    shard = inter // tp_size
    for rank in range(tp_size):
        layer = MergedColumnParallelLinear(hf.config.hidden_size, [inter, inter],
                                           tp_rank=rank, tp_size=tp_size)
        layer.weight.weight_loader(layer.weight, mlp.gate_proj.weight, 0)
        layer.weight.weight_loader(layer.weight, mlp.up_proj.weight, 1)
        gate, up = layer(x).chunk(2, dim=-1)
        assert_close(gate, mlp.gate_proj(x)[:, rank * shard:(rank + 1) * shard])
        assert_close(up, mlp.up_proj(x)[:, rank * shard:(rank + 1) * shard])


def test_column_parallel_with_bias():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(8, 6, generator=gen), torch.randn(8, generator=gen)
    x = torch.randn(3, 6, generator=gen)
    outs = []
    for rank in range(2):
        col = ColumnParallelLinear(6, 8, bias=True, tp_rank=rank, tp_size=2)
        col.weight.weight_loader(col.weight, w)
        col.bias.weight_loader(col.bias, b)
        outs.append(col(x))
    assert_close(torch.cat(outs, dim=-1), F.linear(x, w, b))
    with pytest.raises(AssertionError, match="shape mismatch"):
        col.weight.weight_loader(col.weight, torch.randn(8, 5))


def test_row_parallel_partial_sums(hf):
    attn, cfg = hf.model.layers[0].self_attn, hf.config
    n_in = cfg.num_attention_heads * cfg.head_dim
    x = torch.randn(5, n_in, generator=torch.Generator().manual_seed(4))
    full = RowParallelLinear(n_in, cfg.hidden_size)
    full.weight.weight_loader(full.weight, attn.o_proj.weight)
    assert_close(full(x), attn.o_proj(x))
    partial = []
    for rank in range(2):
        row = RowParallelLinear(n_in, cfg.hidden_size, tp_rank=rank, tp_size=2)
        row.weight.weight_loader(row.weight, attn.o_proj.weight)
        partial.append(F.linear(x[:, rank * row.input_size:(rank + 1) * row.input_size], row.weight))
    assert_close(sum(partial), attn.o_proj(x))


def test_row_parallel_bias_is_loaded_whole():
    row = RowParallelLinear(8, 4, bias=True, tp_rank=1, tp_size=2)
    b = torch.arange(4.0)
    row.bias.weight_loader(row.bias, b)
    assert torch.equal(row.bias, b)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_vocab_parallel_embedding_ranks_sum_to_full(hf, tp_size):
    cfg = hf.config
    ids = torch.randint(0, cfg.vocab_size, (17,), generator=torch.Generator().manual_seed(5))
    ranks = [VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank=r, tp_size=tp_size)
             for r in range(tp_size)]
    for r in ranks:
        r.weight.weight_loader(r.weight, hf.model.embed_tokens.weight)
    assert ranks[-1].vocab_end_idx == cfg.vocab_size
    assert_close(sum(r.embed_local(ids) for r in ranks), hf.model.embed_tokens(ids))
    # and the LM-head slices are this rank's columns of the full logits
    x = tokens(hf)
    heads = [ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp_rank=r, tp_size=tp_size)
             for r in range(tp_size)]
    for h in heads:
        h.weight.weight_loader(h.weight, hf.lm_head.weight)
    assert_close(torch.cat([F.linear(x, h.weight) for h in heads], dim=-1), hf.lm_head(x))


def test_tensor_parallel_layers_shard_the_model():
    cfg = make_random_hf_qwen3(**LAYER_SHAPES[0], num_layers=1).config
    model = Qwen3ForCausalLM(cfg, TensorParallelLayers(1, 2))
    attn = model.model.layers[0].self_attn
    assert attn.attn.num_heads == 2 and attn.attn.num_kv_heads == 1
    assert isinstance(attn.o_proj, RowParallelLinear) and attn.o_proj.tp_rank == 1
    assert attn.o_proj.weight.shape == (64, 32)
    embed = model.model.embed_tokens
    assert embed.weight.shape == (128, 64) and embed.vocab_start_idx == 128
    assert isinstance(model.lm_head, ParallelLMHead)
    assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 64)


def test_one_model_class_two_factories_same_block_output(tmp_path):
    """The full model and two TensorParallelLayers shards, loaded from one checkpoint by the same loader:
    the MLP's partial outputs sum to the full MLP's, the attention's q heads are the full model's."""
    hf_model = make_random_hf_qwen3(**LAYER_SHAPES[0], num_layers=1, seed=3)
    hf_model.save_pretrained(tmp_path)
    full = Qwen3ForCausalLM.from_pretrained(tmp_path)
    shards = [Qwen3ForCausalLM.from_pretrained(tmp_path, layers=TensorParallelLayers(r, 2)) for r in range(2)]
    x = torch.randn(5, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    mlps = [s.model.layers[0].mlp for s in shards]
    partial = [F.linear(silu_and_mul(F.linear(x, m.gate_up_proj.weight)), m.down_proj.weight) for m in mlps]
    assert_close(sum(partial), full.model.layers[0].mlp(x), rtol=1e-4)
    q_full = F.linear(x, full.model.layers[0].self_attn.qkv_proj.weight)[:, :64]
    q_parts = [F.linear(x, s.model.layers[0].self_attn.qkv_proj.weight)[:, :32] for s in shards]
    assert_close(torch.cat(q_parts, -1), q_full)
