"""CUDA graphs (notebook 14): the batch sizes captured and the graph each batch pads to. Both depend on
sizes only, so they are checked on a CPU; the capture itself runs in the GPU tests and the notebook."""
import pytest

pytest.importorskip("hypothesis")  # the dev extra: a bare GPU machine (`pytest -m gpu`) may lack it
from hypothesis import given
from hypothesis import strategies as st

from nanovllm_edu.engine.cuda_graph import MAX_CAPTURE_SIZE, CUDAGraphRunner, capture_sizes


def sizes_only(max_num_seqs: int) -> CUDAGraphRunner:
    """A CUDAGraphRunner with its batch sizes and nothing captured (capturing needs a GPU)."""
    runner = CUDAGraphRunner.__new__(CUDAGraphRunner)
    runner.batch_sizes = capture_sizes(max_num_seqs)
    return runner


def test_the_default_engine_captures_36_sizes():
    sizes = capture_sizes(512)
    assert sizes[:6] == [1, 2, 4, 8, 16, 32] and sizes[-1] == 512 and len(sizes) == 36


@given(st.integers(1, 2048))
def test_the_largest_batch_has_a_graph(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and all(bs in (1, 2, 4, 8) or bs % 16 == 0 for bs in sizes)
    assert sizes[-1] >= min(max_num_seqs, MAX_CAPTURE_SIZE) and sizes[-1] <= MAX_CAPTURE_SIZE
    assert len(sizes) == 1 or sizes[-2] < max_num_seqs  # no graph beyond the first that holds max_num_seqs


@given(st.integers(1, 600), st.integers(1, 700))
def test_a_batch_pads_to_the_smallest_graph_that_holds_it(max_num_seqs, batch):
    runner = sizes_only(max_num_seqs)
    padded = runner.padded_size(batch)
    if batch > runner.batch_sizes[-1]:
        assert padded is None  # the caller runs it eagerly
    else:
        assert padded in runner.batch_sizes and padded >= batch
        assert all(bs < batch for bs in runner.batch_sizes if bs < padded)
