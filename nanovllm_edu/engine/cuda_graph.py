# header
__all__ = ['MAX_CAPTURE_SIZE', 'capture_sizes', 'CUDAGraphRunner', 'CUDAGraphMixin', 'GraphModelRunner']

import math
import time

import torch

from torch import Tensor

from .model_runner import ModelRunner
from .step_inputs import StepInputs

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to max_num_seqs rounded up (at most 512)."""
    top = min(MAX_CAPTURE_SIZE, -(-max_num_seqs // 16) * 16) if max_num_seqs > 8 else max_num_seqs
    small = [bs for bs in (1, 2, 4, 8) if bs <= max(top, 1)]
    return sorted(set(small + list(range(16, top + 1, 16))))


class CUDAGraphRunner:
    """Decode forward passes captured as CUDA graphs, one per batch size, sharing one memory pool."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_num_blocks: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.batch_sizes = capture_sizes(max_num_seqs)
        max_bs = self.batch_sizes[-1]
        # static buffers: every replay reads its inputs from these exact addresses
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_bs, max_num_blocks), -1, dtype=torch.int32, device=device)
        self.outputs = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_seconds, self.capture_bytes = self.capture()

    def static_step(self, bs: int) -> StepInputs:
        """Decode inputs of `bs` rows that live in the static buffers: what a graph is captured with."""
        return StepInputs(False, self.input_ids[:bs], self.positions[:bs], self.slot_mapping[:bs],
                          block_tables=self.block_tables[:bs], context_lens=self.context_lens[:bs])

    @torch.inference_mode()
    def capture(self) -> tuple[float, int]:
        """Capture the largest batch first so its pool is big enough for all the others."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so the growth of reserved memory is what the graphs hold
        start, mem_before = time.perf_counter(), torch.cuda.memory_reserved()
        for bs in reversed(self.batch_sizes):
            step = self.static_step(bs)
            self.outputs[:bs] = self.model(step.input_ids, step.positions, step)  # warm-up: autotune, allocate
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.outputs[:bs] = self.model(step.input_ids, step.positions, step)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.memory_reserved() - mem_before

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest captured size that holds the batch, or None (run eagerly)."""
        return next((bs for bs in self.batch_sizes if bs >= batch_size), None)

    def run(self, step: StepInputs) -> Tensor:
        """Replay the decode graph for this step's batch; returns hidden states [bs, hidden]."""
        bs = step.input_ids.shape[0]
        graph_bs = self.padded_size(bs)
        self.input_ids[:bs] = step.input_ids
        self.positions[:bs] = step.positions
        self.slot_mapping[bs:graph_bs].fill_(-1)  # padding rows store nothing ...
        self.slot_mapping[:bs] = step.slot_mapping
        self.context_lens[bs:graph_bs].zero_()  # ... and attend to nothing
        self.context_lens[:bs] = step.context_lens
        self.block_tables[:bs, :step.block_tables.shape[1]] = step.block_tables
        self.graphs[graph_bs].replay()
        return self.outputs[:bs]

# %%
class CUDAGraphMixin:
    """Runner side of CUDA graphs: after the cache is allocated, capture decode for every batch size
    (GPU, `enforce_eager=False`, a backend whose decode is capturable); decode steps then replay."""
    graphs: CUDAGraphRunner | None = None

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if (self.device.type == "cuda" and not config.enforce_eager
                and getattr(self.backend, "supports_cuda_graphs", False)):
            self.graphs = CUDAGraphRunner(
                self.model, config.max_num_seqs, math.ceil(config.max_model_len / self.block_size),
                config.hf_config.hidden_size, self.dtype, self.device)

    def forward(self, step: StepInputs) -> Tensor | None:
        if step.is_prefill or self.graphs is None or self.graphs.padded_size(step.input_ids.shape[0]) is None:
            return super().forward(step)
        return self.model.compute_logits(self.graphs.run(step))

    def exit(self) -> None:
        self.graphs = None  # free the graphs first: under tensor parallelism they hold NCCL kernels
        super().exit()


class GraphModelRunner(CUDAGraphMixin, ModelRunner):
    """The model runner with CUDA graphs for decode."""
