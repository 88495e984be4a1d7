"""Appendix A1: the decode attention checker passes notebook 12's paged_decode and a plain torch decode, and
names the right check for broken ones (a `repeat` GQA mapping, an off-by-one mask, an ignored block table)."""
import pytest
import torch

import nanovllm_edu  # noqa: F401  (before triton: sets TRITON_INTERPRET=1 when there is no CUDA GPU)

pytest.importorskip("triton")

from lab_helpers import failed_names

from nanovllm_edu.kernels.paged_attention import paged_decode
from nanovllm_edu.labs.decode_attention_checks import check_decode_attention, reference_decode

ONE_BLOCK = "one sequence inside one block"
BLOCKS = "a context spanning several non-adjacent blocks"
PARTIAL = "a context length that is not a multiple of the block size"
GQA2, GQA4 = "GQA with 2 query heads per KV head", "GQA with 4 query heads per KV head"
UNEVEN = "a batch of uneven contexts"
BF16 = "bfloat16 inputs within 2e-2"
SHAPE = "the output has q's shape, dtype and device; inputs unchanged"


@pytest.fixture(scope="module")
def ours():
    """The checker on our Triton kernel (slow in the interpreter: run once), and a draw of the global RNG
    made right after it under the seed set right before it."""
    torch.manual_seed(123)
    report = check_decode_attention(paged_decode)
    return report, torch.rand(3)


def test_our_paged_decode_passes_every_check(ours):
    report, _ = ours
    assert report.passed is True, str(report)
    assert len(report.checks) >= 6
    assert "✗" not in str(report) and str(report).count("✓") == len(report.checks)
    assert report.stage == "decode attention (11)"


def test_the_checker_leaves_the_global_rng_alone(ours):
    _, after = ours
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))


# --- a plain torch decode, and the same with one classic mistake each --------------------------------------

def torch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, *, expand=torch.repeat_interleave,
                 extra_keys=0, follow_table=True):
    """paged_decode written the way a student might in torch: gather each sequence's keys through its block
    table, expand the KV heads to the query heads, softmax, @ V. The keywords introduce the mistakes."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        pos = torch.arange(n + extra_keys)
        row = block_tables[b].long() if follow_table else torch.arange(block_tables.shape[1])
        blocks, slots = row[pos // block_size], pos % block_size
        k = expand(k_cache[blocks, slots].float(), group, 1)  # [n, H, D]
        v = expand(v_cache[blocks, slots].float(), group, 1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, -1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v).to(q.dtype)
    return out


def decode_with_repeat(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Expands KV heads with `repeat` (tiles them: query head h reads KV head h % num_kv_heads)."""
    return torch_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                        expand=lambda kv, group, dim: kv.repeat(1, group, 1))


def decode_off_by_one(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Masks with `pos <= context_len`: also reads the stale slot at position context_len."""
    return torch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, extra_keys=1)


def decode_ignoring_block_table(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Reads blocks 0, 1, 2, ... for every sequence, as if its blocks were allocated in order."""
    return torch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, follow_table=False)


def test_a_plain_torch_decode_passes():
    report = check_decode_attention(torch_decode)
    assert report.passed, str(report)
    # the checker's own reference agrees with itself on every value; it answers in float32 on the CPU
    assert failed_names(check_decode_attention(reference_decode)) == {SHAPE}


def test_repeat_instead_of_repeat_interleave_fails_only_the_gqa_checks():
    report = check_decode_attention(decode_with_repeat)
    assert failed_names(report) == {GQA2, GQA4}
    text = str(report)
    assert "hint: query head h reads KV head h // group" in text
    assert "it matches attention over KV head 1 (expected KV head 1 // 2 = 0)" in text  # the diagnosis


def test_off_by_one_mask_fails_the_length_checks():
    report = check_decode_attention(decode_off_by_one)
    assert failed_names(report) == {PARTIAL, UNEVEN}  # the other checks' stale slots are quiet on purpose
    text = str(report)
    assert "hint: only positions < context_lens[b] count" in text
    assert "it matches attention over the first 22 positions (context_lens[0] is 21)" in text


def test_ignoring_the_block_table_fails_the_table_checks():
    report = check_decode_attention(decode_ignoring_block_table)
    failed = failed_names(report)
    assert {BLOCKS, UNEVEN, GQA2, BF16} <= failed
    assert ONE_BLOCK not in failed and SHAPE not in failed  # block 0 is block 0 either way; shapes are fine
    assert "blocks 0, 1, 2, ... in order instead of the block table's" in str(report)
    assert "hint: token t of sequence b sits in block block_tables[b, t // block_size]" in str(report)


def test_a_hard_coded_scale_fails_the_first_check():
    def default_scale(q, k_cache, v_cache, block_tables, context_lens, scale):
        return torch_decode(q, k_cache, v_cache, block_tables, context_lens, q.shape[-1] ** -0.5)

    report = check_decode_attention(default_scale)
    assert ONE_BLOCK in failed_names(report) and SHAPE not in failed_names(report)
    assert "scale head_dim ** -0.5 instead of the scale argument (0.3)" in str(report)


def test_wrong_output_dtype_fails_only_the_shape_check():
    def float32_out(*args):
        return torch_decode(*args).float()

    assert failed_names(check_decode_attention(float32_out)) == {SHAPE}


def test_the_checker_passes_only_six_arguments():
    seen = []

    def six_only(q, k_cache, v_cache, block_tables, context_lens, scale, *rest, **kw):
        seen.append((len(rest), kw))
        return torch_decode(q, k_cache, v_cache, block_tables, context_lens, scale)

    assert check_decode_attention(six_only).passed
    assert seen and all(call == (0, {}) for call in seen)


def test_a_stub_fails_every_check_without_raising():
    def stub(q, k_cache, v_cache, block_tables, context_lens, scale):
        raise NotImplementedError("Exercise: implement paged_decode")

    report = check_decode_attention(stub)
    assert not any(c.passed for c in report.checks)
    assert all(c.detail.startswith("NotImplementedError: Exercise") for c in report.checks)
