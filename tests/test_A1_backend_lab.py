"""Appendix A1: the attention-backend lab (notebook 04). Our backends pass its checks; realistic broken ones fail the
check that names their bug, and only the checks their bug touches."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from lab_helpers import failed_names

from nanovllm_edu.labs.backend_checks import check_attention_backend
from nanovllm_edu.layers.backends.torch_backend import TorchBackend
from nanovllm_edu.utils.device import triton_available

STORE = "store_kvcache writes each token to its slot and skips -1"
CAUSAL = "a prompt attends causally (no token sees a later one)"
PACKED = "prompts packed in one step do not see each other"
PREFIX = "prefill reads a cached prefix through the block table"
DECODE = "decode attends to each sequence's whole context through its blocks"
GQA = "GQA: query head h reads KV head h // group"
SHAPES = "outputs are [tokens, num_heads, head_dim] in q's dtype"


@pytest.mark.parametrize("backend", [TorchBackend, TorchBackend()], ids=["class", "instance"])
def test_torch_backend_passes(backend):
    report = check_attention_backend(backend)
    assert report.passed is True, str(report)
    assert len(report.checks) >= 6
    assert report.stage == "attention backend (04)"
    assert str(report).count("✓") == len(report.checks)


def test_the_checker_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    check_attention_backend(TorchBackend)
    assert torch.equal(torch.rand(3), want)


@pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter runs on a CPU)")
def test_triton_backend_passes():
    """The same checks, shapes and all, through notebook 12's kernels (on a CPU: Triton's interpreter, ~3 s)."""
    from nanovllm_edu.layers.backends.triton_backend import TritonBackend

    report = check_attention_backend(TritonBackend)
    assert report.passed is True, str(report)


# --- deliberately broken backends ------------------------------------------------------------------------

class NoCausalMaskBackend(TorchBackend):
    """Prefill one prompt at a time (notebook 04's Q04.6) but without the causal mask: every token sees its whole
    prompt, later tokens included (and, after a cached prefix, every new token)."""

    def prefill(self, q, k, v, k_cache, v_cache, step, scale):
        out = torch.empty_like(q)
        cu_q, cu_k = step.cu_seqlens_q.tolist(), step.cu_seqlens_k.tolist()
        for b in range(len(cu_q) - 1):
            rows = slice(cu_q[b], cu_q[b + 1])
            if step.block_tables is None:
                keys, values = k[rows], v[rows]
            else:
                pos = torch.arange(cu_k[b + 1] - cu_k[b])
                block_size = k_cache.shape[1]
                slots = step.block_tables[b].long()[pos // block_size] * block_size + pos % block_size
                keys, values = (c.view(-1, *c.shape[2:])[slots] for c in (k_cache, v_cache))
            out[rows] = F.scaled_dot_product_attention(  # bug: no is_causal=True
                q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), scale=scale,
                enable_gqa=True).transpose(0, 1)
        return out


class OneSequencePrefill(TorchBackend):
    """With nothing cached, attends over the step's packed rows as if they were one prompt (cu_seqlens_q unread):
    every prompt sees the prompts packed before it."""

    def prefill(self, q, k, v, k_cache, v_cache, step, scale):
        if step.block_tables is not None:
            return super().prefill(q, k, v, k_cache, v_cache, step, scale)
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)


class PaddedWithoutMask(TorchBackend):
    """Pads the packed prompts to the longest (as TorchBackend does) but attends without the causal mask: a short
    prompt's real queries then see its padding rows, which borrow the next prompt's tokens."""

    def prefill(self, q, k, v, k_cache, v_cache, step, scale):
        if step.block_tables is not None:
            return super().prefill(q, k, v, k_cache, v_cache, step, scale)
        plan = self._varlen_plan(step, q.shape[0], q.device)
        qp, kp, vp = (x.index_select(0, plan["pad_idx"]).view(plan["batch"], plan["max_q"], -1, x.shape[-1])
                      .transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qp, kp, vp, scale=scale, enable_gqa=True)  # bug: no is_causal=True
        return out.transpose(1, 2).reshape(-1, *q.shape[1:]).index_select(0, plan["unpad_idx"])


class DropsNewestDecode(TorchBackend):
    """Decode over context_lens - 1 keys: reads 'tokens in the cache' as 'tokens before this one'."""

    def decode(self, q, k_cache, v_cache, step, scale):
        return super().decode(q, k_cache, v_cache, replace(step, context_lens=step.context_lens - 1), scale)


class IgnoresPrefixPrefill(TorchBackend):
    """Prefill attends to the step's new tokens only, as if nothing were cached (block tables unread)."""

    def prefill(self, q, k, v, k_cache, v_cache, step, scale):
        return super().prefill(q, k, v, k_cache, v_cache, replace(step, block_tables=None,
                               cu_seqlens_k=step.cu_seqlens_q, max_seqlen_k=step.max_seqlen_q), scale)


class AdjacentBlocksDecode(TorchBackend):
    """Decode reads block_table[0] + i for a sequence's i-th block, as if its blocks were adjacent."""

    def decode(self, q, k_cache, v_cache, step, scale):
        tables = step.block_tables
        adjacent = (tables[:, :1] + torch.arange(tables.shape[1])).where(tables >= 0, -1).to(tables.dtype)
        return super().decode(q, k_cache, v_cache, replace(step, block_tables=adjacent), scale)


class TiledGQADecode(TorchBackend):
    """Decode matches query heads to KV heads with `repeat` (head h -> KV head h % kv_heads), not repeat_interleave."""

    def decode(self, q, k_cache, v_cache, step, scale):
        group = q.shape[1] // k_cache.shape[2]
        return super().decode(q, k_cache.repeat(1, 1, group, 1), v_cache.repeat(1, 1, group, 1), step, scale)


class UpcastingBackend(TorchBackend):
    """Computes in float32 and forgets to cast back."""

    def prefill(self, q, k, v, k_cache, v_cache, step, scale):
        return super().prefill(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), step, scale)


class SkipsNothingStore(TorchBackend):
    """Stores every token, padding too: slot -1 indexes the cache's last slot."""

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


@pytest.mark.parametrize("broken,expected,hint,cause", [
    (NoCausalMaskBackend, {CAUSAL, PREFIX}, "is_causal=True", "the causal mask is missing"),
    (OneSequencePrefill, {PACKED}, "rows cu_seqlens_q[b]..cu_seqlens_q[b+1]-1 are prompt b",
     "attended to the tokens of the prompts packed before them"),
    (PaddedWithoutMask, {CAUSAL, PACKED}, "is_causal=True", "the causal mask is missing"),
    (DropsNewestDecode, {DECODE}, "the new token included", "the newest token was left out"),
    (AdjacentBlocksDecode, {DECODE}, "blocks are not adjacent", "sequence 0 (context 13, blocks [0, 6, 5, 3])"),
    (IgnoresPrefixPrefill, {PREFIX}, "read from the cache through block_tables[b]",
     "attended only to each other, not to their cached prefix"),
    (TiledGQADecode, {GQA}, "repeat_interleave K/V by group", "query head h read KV head h % 2"),
    (UpcastingBackend, {SHAPES}, "then cast back", "returned torch.float32"),
    (SkipsNothingStore, {STORE}, "drop those tokens", "the last slot: where index -1 writes"),
], ids=lambda x: x.__name__ if isinstance(x, type) else None)
def test_a_broken_backend_fails_the_check_that_names_its_bug(broken, expected, hint, cause):
    report = check_attention_backend(broken)
    failed = failed_names(report)
    assert failed == expected, str(report)  # the right checks, and none that the bug does not touch
    first = next(c for c in report.checks if c.name in expected)
    assert cause in first.detail, first.detail  # what happened names the bug
    assert hint in first.hint
    text = str(report)
    for check in report.failed:  # the printed report shows each failed check with what happened and its hint
        assert f"✗ {check.name}\n      what happened: {check.detail}\n      hint: {check.hint}" in text


def test_a_stub_fails_every_check_without_raising():
    """A student edition's stubbed class: even its constructor raises."""
    class Stub(TorchBackend):
        def __init__(self):
            raise NotImplementedError("Exercise: implement TorchBackend.__init__")

    report = check_attention_backend(Stub)
    assert not any(c.passed for c in report.checks)
    assert all(c.detail.startswith("NotImplementedError: Exercise") for c in report.checks)
    assert report.summary().startswith("attention backend (04): 0/7 checks passed")
