"""Full-step CUDA graphs (notebook 14): the padded layout a graph replays, and the attention over it.

A graph of T rows is captured once with `min(T, max_num_seqs)` decode slots and MAX_GRAPH_CHUNKS chunk slots;
every step that fits is copied into that layout (`padded_step`). On a CPU nothing is captured, but what a graph
would compute is the Triton backend's `mixed` over the padded layout (run here through Triton's interpreter):
its real rows must equal the unpadded step's attention. The GPU tests (test_gpu_engine.py) check the replayed
graphs' tokens against transformers.
"""
import random

import pytest
import torch

from nanovllm_edu.engine.cuda_graph import MAX_GRAPH_CHUNKS, CUDAGraphForward, FullStepGraphs, padded_step
from nanovllm_edu.layers.backends.base import AttentionBackend
from nanovllm_edu.layers.backends.torch_backend import TorchBackend
from nanovllm_edu.layers.backends.triton_backend import TritonBackend
from nanovllm_edu.utils.step_inputs import StepInputs

BLOCK, HEADS, KV_HEADS, DIM, NUM_BLOCKS = 16, 4, 2, 32, 48


def random_step(rng: random.Random, num_decodes: int, chunks: list[tuple[int, int]]) -> StepInputs:
    """`num_decodes` decode rows of random context, then one chunk per (cached, new) pair, on distinct blocks:
    a mixed step as notebook 07's `prepare_mixed` builds it (a plain prefill when num_decodes is 0)."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    contexts = [rng.randint(1, 60) for _ in range(num_decodes)] + [cached + new for cached, new in chunks]
    tables = [[free.pop() for _ in range(-(-ctx // BLOCK))] for ctx in contexts]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    positions = [ctx - 1 for ctx in contexts[:num_decodes]]
    positions += [p for cached, new in chunks for p in range(cached, cached + new)]
    owners = list(range(num_decodes)) + [num_decodes + i for i, (_, new) in enumerate(chunks) for _ in range(new)]
    slots = [tables[o][p // BLOCK] * BLOCK + p % BLOCK for o, p in zip(owners, positions)]
    cu_q, cu_k = [num_decodes], [0]
    for cached, new in chunks:
        cu_q.append(cu_q[-1] + new)
        cu_k.append(cu_k[-1] + cached + new)
    return StepInputs(
        True, torch.tensor([rng.randrange(1000) for _ in positions]), torch.tensor(positions), torch.tensor(slots),
        block_tables=block_tables, cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), max_seqlen_q=max(new for _, new in chunks),
        max_seqlen_k=max(c + n for c, n in chunks),
        context_lens=torch.tensor(contexts[:num_decodes], dtype=torch.int32) if num_decodes else None,
        num_decode_rows=num_decodes)


CASES = {  # name: (decode rows, chunks as (cached, new), graph rows, decode slots)
    "mixed, tight": (3, [(0, 9)], 12, 3),
    "mixed, padded everywhere": (2, [(5, 7), (0, 4)], 32, 8),
    "mixed, cached chunk across blocks": (5, [(17, 20)], 64, 16),
    "prefill only, cached context": (0, [(16, 5), (3, 11)], 32, 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_padded_layout_attention_equals_the_step_s_own(case):
    num_decodes, chunks, size, slots = CASES[case]
    rng, gen = random.Random(case), torch.Generator().manual_seed(0)
    step = random_step(rng, num_decodes, chunks)
    rows = step.input_ids.shape[0]
    padded = padded_step(step, size, decode_slots=slots)
    q = torch.randn(size, HEADS, DIM, generator=gen)
    k, v = torch.randn(size, KV_HEADS, DIM, generator=gen), torch.randn(size, KV_HEADS, DIM, generator=gen)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen)  # the earlier steps' keys
    torch_cache, triton_cache = cache.clone(), cache.clone()
    torch_backend, triton_backend = TorchBackend(), TritonBackend()
    torch_backend.store_kvcache(k[:rows], v[:rows], *torch_cache, step.slot_mapping)
    triton_backend.store_kvcache(k, v, *triton_cache, padded.slot_mapping)  # padding rows: slot -1, stored nowhere
    assert torch.equal(torch_cache, triton_cache)
    if num_decodes:
        expected = torch_backend.mixed(q[:rows], k[:rows], v[:rows], *torch_cache, step, DIM ** -0.5)
        # the Triton override and the generic decode-then-prefill agree on the unpadded step as well
        generic = AttentionBackend.mixed(triton_backend, q[:rows], k[:rows], v[:rows], *triton_cache, step, DIM ** -0.5)
        torch.testing.assert_close(triton_backend.mixed(q[:rows], k[:rows], v[:rows], *triton_cache, step, DIM ** -0.5),
                                   generic, atol=1e-5, rtol=1e-5)
    else:
        expected = torch_backend.prefill(q[:rows], k[:rows], v[:rows], *torch_cache, step, DIM ** -0.5)
    graphed = triton_backend.mixed(q, k, v, *triton_cache, padded, DIM ** -0.5)
    assert graphed.shape == (size, HEADS, DIM)
    torch.testing.assert_close(graphed[:rows], expected, atol=1e-5, rtol=1e-5)


def test_padded_step_fields():
    step = random_step(random.Random(1), 2, [(5, 7), (0, 4)])
    rows = step.input_ids.shape[0]  # 2 + 7 + 4 = 13
    padded = padded_step(step, 32, decode_slots=8)
    assert padded.is_mixed and padded.num_decode_rows == 8 and padded.max_seqlen_q == 32
    assert padded.input_ids[:rows].tolist() == step.input_ids.tolist() and padded.input_ids.shape == (32,)
    assert padded.slot_mapping[:rows].tolist() == step.slot_mapping.tolist()
    assert padded.slot_mapping[rows:].tolist() == [-1] * (32 - rows)  # padding rows store nothing
    assert padded.context_lens.tolist() == step.context_lens.tolist() + [0] * 6  # padding slots attend to nothing
    assert padded.cu_seqlens_q.tolist() == [2, 9, 13] + [13] * (MAX_GRAPH_CHUNKS - 2)  # then empty chunks
    assert padded.cu_seqlens_k.tolist() == step.cu_seqlens_k.tolist() + [step.cu_seqlens_k[-1].item()] * (MAX_GRAPH_CHUNKS - 2)
    assert padded.block_tables.shape == (8 + MAX_GRAPH_CHUNKS, step.block_tables.shape[1])
    assert torch.equal(padded.block_tables[:2], step.block_tables[:2])  # decode rows' tables in their slots
    assert torch.equal(padded.block_tables[8:10], step.block_tables[2:])  # chunks' tables from row decode_slots
    assert (padded.block_tables[2:8] == -1).all() and (padded.block_tables[10:] == -1).all()
    with pytest.raises(AssertionError):
        padded_step(step, 12, decode_slots=8)  # 13 rows do not fit a graph of 12


def full_graphs_stub(sizes=(64, 128), max_num_seqs=8) -> FullStepGraphs:
    """The class's bookkeeping without a capture (which needs CUDA)."""
    graphs = FullStepGraphs.__new__(FullStepGraphs)
    graphs.token_sizes, graphs.max_num_seqs = list(sizes), max_num_seqs
    return graphs


def test_which_steps_fit_a_full_graph():
    graphs = full_graphs_stub()
    rng = random.Random(2)
    assert graphs.decode_slots(64) == 8 and graphs.decode_slots(4) == 4
    assert graphs.padded_size(random_step(rng, 3, [(0, 40)])) == 64
    assert graphs.padded_size(random_step(rng, 3, [(0, 62)])) == 128
    assert graphs.padded_size(random_step(rng, 3, [(0, 126)])) is None  # 129 rows: larger than every graph
    many = random_step(rng, 1, [(0, 2)] * (MAX_GRAPH_CHUNKS + 1))
    assert graphs.padded_size(many) is None  # more chunks than slots
    fresh = random_step(rng, 0, [(0, 5), (0, 7)])
    fresh.block_tables = None  # a plain prefill, nothing cached: its keys come from k and v, not the cache
    assert graphs.padded_size(fresh) is None


class Recorder:
    """Stands in for a kind of graphs: which steps it was asked to replay."""

    def __init__(self, fits):
        self.fits, self.ran = fits, 0

    def padded_size(self, arg):
        return 64 if self.fits(arg) else None

    def run(self, step):
        self.ran += 1
        return "replayed"


def test_forward_replays_the_first_kind_that_holds_the_step():
    forward = CUDAGraphForward.__new__(CUDAGraphForward)
    forward.model = lambda ids, positions, step: "eager"
    forward.graphs = Recorder(lambda batch: batch <= 8)
    forward.full = Recorder(lambda step: step.block_tables is not None)
    forward.piecewise = Recorder(lambda num_tokens: num_tokens <= 64)
    forward.num_replayed_steps = forward.num_full_steps = forward.num_piecewise_steps = forward.num_eager_steps = 0
    rng = random.Random(3)
    decode = StepInputs(False, torch.zeros(4), torch.zeros(4), torch.zeros(4))
    mixed, fresh, big = random_step(rng, 2, [(0, 9)]), random_step(rng, 0, [(0, 9)]), random_step(rng, 0, [(0, 90)])
    fresh.block_tables = big.block_tables = None
    assert [forward(s) for s in (decode, mixed, fresh, big)] == ["replayed", "replayed", "replayed", "eager"]
    assert (forward.graphs.ran, forward.full.ran, forward.piecewise.ran) == (1, 1, 1)
    assert (forward.num_replayed_steps, forward.num_full_steps, forward.num_piecewise_steps,
            forward.num_eager_steps) == (1, 1, 1, 1)
