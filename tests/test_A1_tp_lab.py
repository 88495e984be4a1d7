"""Appendix A1: the tensor-parallel shard checker (notebook 17) passes our TensorParallelLayers and names the
right check for realistic broken shard loaders."""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lab_helpers import failed_names

from nanovllm_edu.labs.report import LabReport
from nanovllm_edu.labs.tp_checks import check_tp_shards
from nanovllm_edu.layers.linear import Linear, QKVLinear
from nanovllm_edu.layers.parallel import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallelLayers,
    VocabParallelEmbedding,
    rank_slice,
)

ROOT = Path(__file__).resolve().parents[1]

SHAPES = "each rank's layers have its share of every size"
COLUMN = "column-parallel: a rank holds its output rows"
ROW = "row-parallel: a rank holds its input columns"
GATE_UP = "gate and up are cut part by part"
QKV = "q, k and v are cut by whole heads"
FEW_KV = "fewer KV heads than ranks: refused or replicated"
VOCAB = "vocab-parallel: a rank holds its vocabulary rows"
LOOKUP = "vocab-parallel lookups sum to the full embedding"
COMPOSE = "column then row: the summed partials equal the full layers"


def check(report: LabReport, name: str):
    return next(c for c in report.checks if c.name == name)


@pytest.mark.parametrize("target", [TensorParallelLayers, TensorParallelLayers(1, 2)],
                         ids=["class", "instance"])
def test_our_factory_passes(target):
    had_group = dist.is_initialized()
    report = check_tp_shards(target)
    assert report.passed is True, str(report)
    assert len(report.checks) >= 5 and len({c.name for c in report.checks}) == len(report.checks)
    assert all(c.hint for c in report.checks)
    assert report.stage == "tensor-parallel shards (15)" and "✗" not in str(report)
    assert dist.is_initialized() is had_group, "the checker leaves the process group as it found it"


def test_an_existing_group_of_one_is_used_and_left_alone():
    if dist.is_initialized():
        pytest.skip("this process is already in a process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert check_tp_shards(TensorParallelLayers).passed
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


# --- broken implementations ----------------------------------------------------------------------------

class FusedCutGateUp(MergedColumnParallelLinear):
    """Cuts the fused [gate | up] matrix into tp_size equal row blocks, as if it were one weight: rank 0 of 2
    gets all of gate and none of up."""

    def weight_loader(self, param, loaded_weight, loaded_shard_id):
        start = sum(self.output_sizes[:loaded_shard_id]) * self.tp_size  # the part's first row, fused
        mine = self.tp_rank * param.shape[0]  # this rank's first row of the full fused matrix
        lo, hi = max(start, mine), min(start + loaded_weight.shape[0], mine + param.shape[0])
        if lo < hi:
            param.data[lo - mine:hi - mine] = loaded_weight[lo - start:hi - start]


class FusedGateUpLayers(TensorParallelLayers):
    def merged_linear(self, input_size, output_sizes, bias):
        return FusedCutGateUp(input_size, output_sizes, bias, self.tp_rank, self.tp_size)


class RowsNotColumns(RowParallelLinear):
    """Slices the row-parallel weight by rows (dim 0, the outputs), as a column-parallel layer does."""

    def weight_loader(self, param, loaded_weight):
        part = loaded_weight if param.dim() == 1 else rank_slice(loaded_weight, 0, self.tp_rank, self.tp_size)
        Linear.weight_loader(self, param, part)


class RowsNotColumnsLayers(TensorParallelLayers):
    def output_linear(self, input_size, output_size, bias):
        return RowsNotColumns(input_size, output_size, bias, self.tp_rank, self.tp_size)


class InterleavedQKV(QKVParallelLinear):
    """Deals the rows of q, k and v out round-robin (rank r: rows r, r + tp, ...): every rank gets some
    channels of every head, and no whole head."""

    def weight_loader(self, param, loaded_weight, loaded_shard_id):
        QKVLinear.weight_loader(self, param, loaded_weight[self.tp_rank::self.tp_size], loaded_shard_id)


class InterleavedQKVLayers(TensorParallelLayers):
    def qkv_linear(self, hidden_size, head_dim, num_heads, num_kv_heads, bias):
        return InterleavedQKV(hidden_size, head_dim, num_heads, num_kv_heads, bias,
                              self.tp_rank, self.tp_size)


class BiasEveryRank(RowParallelLinear):
    """Adds the bias on every rank: the all-reduce then sums tp_size copies of it."""

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class BiasEveryRankLayers(TensorParallelLayers):
    def output_linear(self, input_size, output_size, bias):
        return BiasEveryRank(input_size, output_size, bias, self.tp_rank, self.tp_size)


class ClampedEmbedding(VocabParallelEmbedding):
    """Clamps foreign token ids into its range but forgets to zero them: they add a wrong row to the sum."""

    def forward(self, input_ids):
        local = (input_ids - self.vocab_start_idx).clamp(0, self.weight.shape[0] - 1)
        y = F.embedding(local, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class ClampedEmbeddingLayers(TensorParallelLayers):
    def embedding(self, vocab_size, hidden_size):
        return ClampedEmbedding(vocab_size, hidden_size, self.tp_rank, self.tp_size)


def test_gate_up_cut_as_one_matrix_fails_the_gate_up_check_only():
    report = check_tp_shards(FusedGateUpLayers)
    assert failed_names(report) == {GATE_UP}, str(report)
    detail = check(report, GATE_UP).detail
    assert detail == ("rank 0 of 2's gate_up_proj holds gate_proj rows 0-23; "
                      "want gate_proj rows 0-11, then up_proj rows 0-11"), detail
    assert "hint: the loader is called once per part (shard id 0 = gate, 1 = up)" in str(report)


def test_row_parallel_loader_slicing_rows_fails_the_row_checks():
    report = check_tp_shards(RowsNotColumnsLayers)
    assert failed_names(report) == {ROW, COMPOSE}, str(report)
    detail = check(report, ROW).detail
    assert detail.startswith("loading o_proj.weight, o_proj.bias on rank 0 of 2: shape mismatch"), detail
    assert "hint: a row-parallel loader keeps columns [r*in/tp, (r+1)*in/tp)" in str(report)


def test_qkv_cut_by_interleaved_channels_fails_the_whole_heads_check_only():
    report = check_tp_shards(InterleavedQKVLayers)
    assert failed_names(report) == {QKV}, str(report)
    detail = check(report, QKV).detail
    assert detail.startswith("with 8 query and 4 KV heads of 4 rows, rank 0 of 2's qkv_proj holds "
                             "q_proj rows 0, 2, 4, 6, 8, 10, ... (16 in all)"), detail
    assert "want q_proj rows 0-15, then k_proj rows 0-7, then v_proj rows 0-7" in detail
    assert "hint: cut each of q, k and v separately" in str(report)


def test_bias_on_every_rank_fails_the_composition_only():
    report = check_tp_shards(BiasEveryRankLayers)
    assert failed_names(report) == {COMPOSE}, str(report)
    detail = check(report, COMPOSE).detail
    assert detail == "2 ranks: the sum holds the output bias 2 times: every rank adds it", detail
    assert "hint: each rank feeds its column output straight into its row layer" in str(report)


def test_embedding_that_does_not_zero_foreign_ids_fails_the_lookup_only():
    report = check_tp_shards(ClampedEmbeddingLayers)
    assert failed_names(report) == {LOOKUP}, str(report)
    assert "another rank's: want zeros" in check(report, LOOKUP).detail


# --- fewer KV heads than ranks -------------------------------------------------------------------------

class ReplicatedKV(QKVParallelLinear):
    """vLLM's answer to fewer KV heads than ranks: each rank keeps one KV head, rank r head r * K // tp."""

    def __init__(self, hidden_size, head_dim, total_num_heads, total_num_kv_heads, bias=False,
                 tp_rank=0, tp_size=1):
        self.tp_rank, self.tp_size, self.total_num_kv_heads = tp_rank, tp_size, total_num_kv_heads
        QKVLinear.__init__(self, hidden_size, head_dim, total_num_heads // tp_size,
                           max(1, total_num_kv_heads // tp_size), bias)

    def weight_loader(self, param, loaded_weight, loaded_shard_id):
        if loaded_shard_id != "q" and self.total_num_kv_heads < self.tp_size:
            head = self.tp_rank * self.total_num_kv_heads // self.tp_size
            part = loaded_weight[head * self.head_dim:(head + 1) * self.head_dim]
        else:
            part = rank_slice(loaded_weight, 0, self.tp_rank, self.tp_size)
        QKVLinear.weight_loader(self, param, part, loaded_shard_id)


class NoKVHeads(QKVParallelLinear):
    """Floors the KV heads per rank without checking: 2 KV heads over 4 ranks builds a layer with none."""

    def __init__(self, hidden_size, head_dim, total_num_heads, total_num_kv_heads, bias=False,
                 tp_rank=0, tp_size=1):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        QKVLinear.__init__(self, hidden_size, head_dim, total_num_heads // tp_size,
                           total_num_kv_heads // tp_size, bias)


def qkv_layers(cls):
    class Layers(TensorParallelLayers):
        def qkv_linear(self, hidden_size, head_dim, num_heads, num_kv_heads, bias):
            return cls(hidden_size, head_dim, num_heads, num_kv_heads, bias, self.tp_rank, self.tp_size)
    return Layers


def test_replicating_kv_heads_is_accepted_as_well_as_refusing():
    report = check_tp_shards(qkv_layers(ReplicatedKV))
    assert report.passed, str(report)


def test_building_a_layer_without_kv_heads_fails_the_few_kv_heads_check_only():
    report = check_tp_shards(qkv_layers(NoKVHeads))
    assert failed_names(report) == {FEW_KV}, str(report)
    assert "built rather than refused" in check(report, FEW_KV).detail


# --- stubs ---------------------------------------------------------------------------------------------

def test_a_stubbed_factory_fails_every_check_without_raising():
    class Stub(TensorParallelLayers):
        def __init__(self, tp_rank, tp_size):
            raise NotImplementedError("Exercise: implement TensorParallelLayers.__init__")

    report = check_tp_shards(Stub)
    assert not any(c.passed for c in report.checks)
    assert all(c.detail.startswith("NotImplementedError: Exercise") for c in report.checks), str(report)


LESSON_CELLS = ("tp-linear-code", "tp-row-code", "tp-factory-code")  # where notebook 17 defines the target


@pytest.mark.parametrize("stubbed", [False, True], ids=["as-written", "student-stubs"])
def test_the_lesson_cells_pass_and_their_student_stubs_fail_every_check(stubbed):
    """Notebook 17's three cells run as one namespace (as in the notebook): as written they pass; with every
    body stubbed (the student edition) each check fails on a NotImplementedError, and none crashes."""
    nbformat = pytest.importorskip("nbformat")
    from nanovllm_edu.labs.student import stub_source

    cells = {c.get("id"): c.source for c in nbformat.read(ROOT / "notebooks" / "17_tensor_parallel.ipynb",
                                                          as_version=4).cells}
    namespace = {"__name__": "notebook15"}
    for cell_id in LESSON_CELLS:
        source = stub_source(cells[cell_id]) if stubbed else cells[cell_id]
        # the course's own cells, run in one namespace as Jupyter runs them
        exec(compile(source, cell_id, "exec"), namespace)  # noqa: S102
    report = check_tp_shards(namespace["TensorParallelLayers"])
    if not stubbed:
        assert report.passed, str(report)
    else:
        assert not any(c.passed for c in report.checks), str(report)
        assert all("NotImplementedError: Exercise: implement TensorParallelLayers.__init__ (" in c.detail
                   for c in report.checks), str(report)
    assert isinstance(torch.zeros(1), torch.Tensor)  # the namespace's imports did not disturb torch
