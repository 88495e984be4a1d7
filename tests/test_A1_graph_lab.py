"""The CUDA-graph lab (notebook 14), on a CPU: the checker passes our CUDAGraphRunner and names the right check for
realistic broken ones (each overrides one method)."""
import time

import torch
from lab_helpers import failed_names

from nanovllm_edu.engine.cuda_graph import CUDAGraphRunner
from nanovllm_edu.labs.graph_checks import check_graph_replay

PADDED_SIZE = "padded_size picks the smallest graph that holds the batch"
INPUTS = "a step is copied into the first rows of the buffers and replays its graph"
RETURNS = "run returns the batch's rows of the graph's output"
PADDING = "padding rows store nothing and read nothing"
BLOCK_TABLES = "stale block-table columns are never read"
EAGER = "steps of different sizes replay like the eager model"
CAPTURE_ORDER = "capture goes largest first into one shared pool"
CAPTURE_BUFFERS = "each graph is captured on the static buffers after a warm-up"


def test_our_runner_passes_quickly():
    start = time.perf_counter()
    report = check_graph_replay(CUDAGraphRunner)
    assert time.perf_counter() - start < 5
    assert report.passed is True, str(report)
    assert len(report.checks) >= 5 and report.stage == "CUDA graphs (13)"
    assert "✗" not in str(report)


def test_the_checker_leaves_torch_cuda_and_the_global_rng_alone():
    real = (torch.cuda.graph, torch.cuda.CUDAGraph, torch.cuda.synchronize)
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    check_graph_replay(CUDAGraphRunner)
    assert torch.equal(torch.rand(3), want)
    assert (torch.cuda.graph, torch.cuda.CUDAGraph, torch.cuda.synchronize) == real


# --- deliberately broken runners -------------------------------------------------------------------------

class StalePaddingRunner(CUDAGraphRunner):
    """Copies the step into the buffers but leaves the padding rows as the last larger step left them."""

    def run(self, step):
        bs = step.input_ids.shape[0]
        graph_bs = self.padded_size(bs)
        self.input_ids[:bs] = step.input_ids
        self.positions[:bs] = step.positions
        self.slot_mapping[:bs] = step.slot_mapping
        self.context_lens[:bs] = step.context_lens
        self.block_tables[:bs, :step.block_tables.shape[1]] = step.block_tables
        self.graphs[graph_bs].replay()
        return self.outputs[:bs]


class PowerOfTwoRunner(CUDAGraphRunner):
    """Pads to the next power of two, which is not always a captured size (33 -> 64 when 48 is captured)."""

    def padded_size(self, batch_size):
        bs = 1 << (batch_size - 1).bit_length()
        return bs if bs <= self.batch_sizes[-1] else None


class LargestBelowRunner(CUDAGraphRunner):
    """Off by one bucket: the largest graph that the batch fills, not the smallest that holds it."""

    def padded_size(self, batch_size):
        return max((bs for bs in self.batch_sizes if bs <= batch_size), default=None)


class PaddedOutputRunner(CUDAGraphRunner):
    """Returns the graph's whole output, padding rows included."""

    def run(self, step):
        CUDAGraphRunner.run(self, step)
        return self.outputs[:self.padded_size(step.input_ids.shape[0])]


class NoBlockTablesRunner(CUDAGraphRunner):
    """Forgets the block tables: the replay reads whatever tables an earlier batch left."""

    def run(self, step):
        bs = step.input_ids.shape[0]
        graph_bs = self.padded_size(bs)
        self.input_ids[:bs] = step.input_ids
        self.positions[:bs] = step.positions
        self.slot_mapping[bs:graph_bs].fill_(-1)
        self.slot_mapping[:bs] = step.slot_mapping
        self.context_lens[bs:graph_bs].zero_()
        self.context_lens[:bs] = step.context_lens
        self.graphs[graph_bs].replay()
        return self.outputs[:bs]


class SmallestFirstRunner(CUDAGraphRunner):
    """Captures the smallest batch first, each graph into a pool of its own."""

    @torch.inference_mode()
    def capture(self):
        for bs in self.batch_sizes:
            step = self.static_step(bs)
            self.outputs[:bs] = self.model(step.input_ids, step.positions, step)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.outputs[:bs] = self.model(step.input_ids, step.positions, step)
            self.graphs[bs] = graph
        return 0.0, 0


def test_stale_padding_rows_fail_the_padding_check_only():
    report = check_graph_replay(StalePaddingRunner)
    assert failed_names(report) == {PADDING}
    text = str(report)
    assert f"✗ {PADDING}" in text and "hint: rows bs..graph_bs hold the last larger step's inputs" in text
    assert "padding row 3 kept the earlier step's slot_mapping 141" in text and "and context_lens 7" in text


def test_a_power_of_two_bucket_fails_padded_size_only():
    report = check_graph_replay(PowerOfTwoRunner)
    assert failed_names(report) == {PADDED_SIZE}
    assert "padded_size(33) is None; the smallest captured size that holds 33 rows is 48" in str(report)
    assert "hint: the first of the (sorted) batch_sizes >= the batch" in str(report)


def test_the_largest_graph_below_the_batch_fails_padded_size_only():
    report = check_graph_replay(LargestBelowRunner)
    assert failed_names(report) == {PADDED_SIZE}
    assert "padded_size(3) is 2; the smallest captured size that holds 3 rows is 4" in str(report)


def test_returning_the_padded_output_fails_the_returned_rows_check_only():
    report = check_graph_replay(PaddedOutputRunner)
    assert failed_names(report) == {RETURNS}
    assert "run returned shape (4, 8) for a batch of 3" in str(report)
    assert "hint: the graph writes all its padded rows into self.outputs: return self.outputs[:bs]" in str(report)


def test_forgotten_block_tables_fail_the_block_table_and_eager_checks():
    report = check_graph_replay(NoBlockTablesRunner)
    assert failed_names(report) == {BLOCK_TABLES, EAGER}
    assert "row 0 read blocks [32, 33], its table is [0, 1]" in str(report)


def test_capturing_smallest_first_fails_the_capture_order_check_only():
    report = check_graph_replay(SmallestFirstRunner)
    assert failed_names(report) == {CAPTURE_ORDER}
    assert "captured in the order [1, 2, 4, 8, 16]: the largest must go first" in str(report)


def test_a_stub_fails_every_check_without_raising():
    class Stub(CUDAGraphRunner):
        def __init__(self, *args):
            raise NotImplementedError("Exercise: implement CUDAGraphRunner.__init__ (see the markdown above)")

    report = check_graph_replay(Stub)
    assert not any(c.passed for c in report.checks)
    assert "NotImplementedError: Exercise" in str(report)


def test_stubbed_methods_with_the_buffers_kept_fail_their_checks():
    """The student edition may keep __init__ and static_step: then every check that runs a stubbed method fails."""
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise")

    Stubbed = type("Stubbed", (CUDAGraphRunner,), {"capture": stub, "padded_size": stub, "run": stub})
    report = check_graph_replay(Stubbed)
    assert not any(c.passed for c in report.checks), str(report)
