"""Decode kernel tables for Qwen3-0.6B on one CUDA GPU: the decode GEMMs and the paged decode attention
kernel, each against its floor; written as JSON records and printed as markdown tables.

    python3 scripts/kernel_tables.py --json-dir DIR [--smoke] [--copy-bandwidth-GBps X --peak-bf16-TFLOPs Y]

Writes DIR/gemm_decode.json and DIR/decode_attention.json ({"device", "torch", "triton",
"copy_bandwidth_GBps", "peak_bf16_TFLOPs", "empty_kernel_us", ..., "rows": [...]}); `markdown_table(record)`
renders one of them.

GEMM table: F.linear(x, w), x [M, K] and w [N, K] in bf16 (no bias), for the five decode GEMMs (qkv, o,
gate_up, down, lm_head; shapes from the model's config.json) and M = 1 .. 256, once with cuBLAS and once with
cuBLASLt preferred (torch.backends.cuda.preferred_blas_library; the previous choice is restored afterwards).
Each is timed two ways, in microseconds:
- do_bench: triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"). It zeroes a 256 MB buffer
  before every call, so the weight comes from HBM, and times each call alone between two CUDA events.
- graph: what the engine does (graph replay, weights not in the L2). `calls` back-to-back F.linear calls
  cycle over C copies of the weight, C the smallest number >= 2 whose bytes reach 4x the L2 (a copy is long
  evicted when its turn comes back), captured in one CUDA graph of at least 32 calls; the median time of 10
  replays divided by `calls`. It includes the gaps between kernels in a graph, as a decode step does.
The floor of a GEMM is max(bytes / copy bandwidth, flops / bf16 peak), bytes = (N*K + M*K + M*N) * 2 (the
weight, the activations in and out) and flops = 2*M*N*K; `fraction` = floor / measured. The copy bandwidth
and the bf16 peak come from nanovllm_edu.bench.hardware (measured first) unless both are given.

Attention table: nanovllm_edu.kernels.paged_attention.paged_decode with Qwen3-0.6B's per-layer heads (16
query, 8 KV, head_dim 128) and the engine's default KV block size (256), blocks drawn from a shuffled pool,
for batch 1 .. 256 x context 100 .. 2048 (every row of a batch the same length), plus "mix" rows: batch 256
with lengths drawn uniformly from 100 .. 2048 (seed 0), like the seed benchmark's decode steps, longest first
as the scheduler hands them over (notebook 06) and once in the order drawn; then the split sweep. Timed with
do_bench (`us`) and, without the Python that launches it, as the replay of a CUDA graph of the same call
under do_bench (`graph_us`). KV bytes = sum(context) * kv_heads * head_dim * 2 (k and v) * 2 bytes; GB/s and
the fraction of the copy bandwidth come from `us`; `over_empty_kernel` = us / the empty kernel's do_bench time
(paged_decode launches two kernels when num_splits > 1).

Decode steps (the record's "steps" and "steps_summary"): every 32nd decode step of the seed benchmark (row i
holds prompt_i + step + 1 tokens until its output is done), its batch padded to the CUDA graph's size with
empty rows and its block table as wide as max_model_len (4,096 tokens), as the engine replays it: the rows in
arrival order and longest first, with the split count paged_decode picks and with 1, 2 and 4 forced
(graph_us only). The summary adds each variant up over the whole benchmark (x 32 steps x the model's layers)
next to the floor (the same K/V bytes at the copy bandwidth).

Empty kernel: an empty Triton kernel with one program, timed both ways (do_bench; a graph of 128 launches).

On an H200 the whole run should take about 90 s (an estimate: imports ~10 s, rates ~2 s, GEMMs ~15 s for 110
do_bench calls of ~30 ms and 110 graph captures, attention ~15 s, most of it compiling the kernel's ~10
variants, decode steps ~45 s for 32 steps x 5 variants). Progress lines go to stdout as each part ends.

--smoke takes tiny sizes: M in (1, 4), batch in (1, 2), context in (100, 300), a 3-request workload. On a CPU it runs the kernels in
Triton's interpreter and times one call by the wall clock (no graphs: graph_us is null), so it checks the code
path, not speed; on a GPU it is a quick run of the real timers.
"""
import argparse
import functools
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
# isort: split
import nanovllm_edu  # first: without CUDA it sets TRITON_INTERPRET=1 (Triton's CPU interpreter)

# isort: split
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from nanovllm_edu.bench.hardware import ModelShape, measure_bf16_flops, measure_copy_bandwidth
from nanovllm_edu.bench.workload import make_workload
from nanovllm_edu.config import Config
from nanovllm_edu.engine.cuda_graph import capture_sizes
from nanovllm_edu.kernels.paged_attention import decode_num_splits, paged_decode

MODEL_CONFIG = Path(nanovllm_edu.__file__).parent / "assets" / "qwen3-0.6b" / "config.json"
BLAS_LIBRARIES = ("cublas", "cublaslt")
EMPTY_GRAPH_CALLS = 128  # empty kernels per graph: enough to average the launch gap
GRAPH_REPLAYS = 10
SEED = 0
GEMM_TIMING = ("do_bench: median of triton.testing.do_bench (L2 flushed before each call); graph: median "
               "replay time / calls of a CUDA graph of back-to-back calls cycling over weight copies "
               ">= 4x the L2")
ATTENTION_TIMING = ("us: median of triton.testing.do_bench (L2 flushed before each call); graph_us: the same "
                    "of the replay of a CUDA graph of one call")


@dataclass(frozen=True)
class Sizes:
    """What to measure: GEMM row counts M, attention batch sizes and context lengths, the mixed batch."""
    gemm_ms: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    mix_batch: int
    mix_context_range: tuple[int, int]
    split_sweep_batches: tuple[int, ...]  # mixed batches of these sizes, split count forced to 1, 2, 4, 8
    steps_workload: tuple[int, int, int]  # the decode steps' workload: requests, min and max prompt/output length
    step_stride: int  # every step_stride-th decode step is timed
    max_model_len: int  # the CUDA graphs' block tables hold this many tokens


FULL = Sizes((1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256), (1, 4, 16, 64, 128, 256),
             (100, 256, 512, 1024, 1536, 2048), 256, (100, 2048), (64, 128, 256), (256, 100, 1024), 32, 4096)
SMOKE = Sizes((1, 4), (1, 2), (100, 300), 2, (100, 300), (2,), (3, 8, 40), 16, 64)
STEP_SPLITS = (None, 1, 2, 4)  # the split count paged_decode picks from shapes, then forced counts


@dataclass(frozen=True)
class Rates:
    """The GPU's limits the floors use: copy bandwidth (bytes/s, read + write) and bf16 peak (FLOP/s)."""
    copy_bandwidth: float
    peak_flops: float
    source: str  # "measured", "given" or "cpu stand-in"


# ---------------------------------------------------------------- timing


def wall_us(fn: Callable[[], object]) -> float:
    """Microseconds of one call of fn, by the wall clock (the CPU stand-in for the GPU timings)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn as a CUDA graph, captured after one eager call (which compiles kernels, makes cuBLAS workspaces)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


class GpuTimer:
    """Times on a CUDA GPU: do_bench with the L2 flushed before each call, and CUDA-graph replay."""
    min_graph_calls = 32  # GEMMs per graph at the least: the replay's own start cost is spread thin

    def __init__(self, device: torch.device):
        l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
        self.l2_defeat_bytes = 4 * l2_bytes

    def flushed_us(self, fn: Callable[[], object]) -> float:
        """Median microseconds of one call, the L2 flushed before each (do_bench)."""
        return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3

    def graph_us(self, fn: Callable[[], object], calls: int) -> float:
        """Median microseconds per call of fn (which makes `calls` calls) replayed as one CUDA graph."""
        graph = capture_graph(fn)
        for _ in range(2):
            graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(GRAPH_REPLAYS)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3 / calls

    def replayed_flushed_us(self, fn: Callable[[], object]) -> float:
        """flushed_us of fn's CUDA graph: the kernels' time without the Python that launches them."""
        return self.flushed_us(capture_graph(fn).replay)


class CpuTimer:
    """The --smoke stand-in on a CPU: one wall-clock call, no L2 to defeat, no graphs."""
    min_graph_calls = 2
    l2_defeat_bytes = 0

    def flushed_us(self, fn: Callable[[], object]) -> float:
        return wall_us(fn)

    def graph_us(self, fn: Callable[[], object], calls: int) -> float:
        return wall_us(fn) / calls

    def replayed_flushed_us(self, fn: Callable[[], object]) -> None:
        return None


Timer = GpuTimer | CpuTimer


@triton.jit
def _empty_kernel():
    tl.program_id(0)  # does nothing; Triton's CPU interpreter needs `tl` in the body


def launch_empty_kernel() -> None:
    _empty_kernel[(1,)]()


def empty_kernel_us(timer: Timer) -> dict[str, float]:
    """The floor of any kernel: an empty one's time by do_bench and per launch in a graph."""
    def back_to_back() -> None:
        for _ in range(EMPTY_GRAPH_CALLS):
            launch_empty_kernel()
    return {"do_bench": timer.flushed_us(launch_empty_kernel),
            "graph": timer.graph_us(back_to_back, EMPTY_GRAPH_CALLS)}


def measure_rates(device: torch.device, given: Rates | None) -> Rates:
    """The copy bandwidth and bf16 peak: given, measured on the GPU, or rough CPU stand-ins for --smoke."""
    if given is not None:
        return given
    if device.type == "cuda":
        peak = measure_bf16_flops(device)  # first: the matmuls raise the clocks from idle for the copy too
        return Rates(measure_copy_bandwidth(device), peak, "measured")
    src = torch.empty(1 << 26, dtype=torch.uint8)
    dst, a = torch.empty_like(src), torch.randn(512, 512)
    return Rates(2 * src.nbytes / (wall_us(lambda: dst.copy_(src)) / 1e6),
                 2 * 512**3 / (wall_us(lambda: a @ a) / 1e6), "cpu stand-in")


# ---------------------------------------------------------------- GEMM table


def decode_gemm_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(N, K) of each decode GEMM: the four of a decoder layer and the output layer."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {"qkv": (q + 2 * kv, shape.hidden), "o": (shape.hidden, q),
            "gate_up": (2 * shape.intermediate, shape.hidden), "down": (shape.hidden, shape.intermediate),
            "lm_head": (shape.vocab, shape.hidden)}


def gemm_floor(m: int, n: int, k: int, rates: Rates) -> dict:
    """Bytes, FLOPs and the floor on the time of x [M, K] @ w[N, K].T in bf16."""
    nbytes, flops = 2 * (n * k + m * k + m * n), 2 * m * n * k
    memory_s, compute_s = nbytes / rates.copy_bandwidth, flops / rates.peak_flops
    return {"bytes": nbytes, "flops": flops, "floor_us": max(memory_s, compute_s) * 1e6,
            "bound": "memory" if memory_s >= compute_s else "compute"}


@contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's GEMMs prefer cuBLAS or cuBLASLt inside the block; the previous choice comes back after.
    On a CPU there is nothing to choose and the block runs unchanged."""
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def weight_copies(n: int, k: int, device: torch.device, l2_defeat_bytes: int) -> list[torch.Tensor]:
    """At least two copies of a random [N, K] bf16 weight, together at least l2_defeat_bytes."""
    weight = torch.randn(n, k, dtype=torch.bfloat16, device=device)
    count = max(2, math.ceil(l2_defeat_bytes / weight.nbytes))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def cycled_graph_us(gemm: Callable[[torch.Tensor, torch.Tensor], object], x: torch.Tensor,
                    weights: list[torch.Tensor], timer: Timer) -> float:
    """Microseconds per call of gemm(x, w) in a CUDA graph of back-to-back calls cycling over the weight copies
    (so every call reads its weights from memory, as a decode step's layers do)."""
    calls = len(weights) * math.ceil(timer.min_graph_calls / len(weights))

    def back_to_back() -> None:
        for i in range(calls):
            gemm(x, weights[i % len(weights)])
    return timer.graph_us(back_to_back, calls)


def time_gemm(x: torch.Tensor, weights: list[torch.Tensor], timer: Timer) -> dict[str, float]:
    """F.linear(x, w) alone under do_bench, and per call in a graph cycling over the weight copies."""
    return {"do_bench": timer.flushed_us(lambda: F.linear(x, weights[0])),
            "graph": cycled_graph_us(F.linear, x, weights, timer)}


def gemm_rows(shape: ModelShape, ms: tuple[int, ...], timer: Timer, rates: Rates,
              device: torch.device) -> list[dict]:
    """One row per (GEMM, M): floor, and time and floor fraction per BLAS library and method."""
    rows = []
    for name, (n, k) in decode_gemm_shapes(shape).items():
        weights = weight_copies(n, k, device, timer.l2_defeat_bytes)
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            row = {"gemm": name, "M": m, "N": n, "K": k, **gemm_floor(m, n, k, rates),
                   "weight_copies": len(weights)}
            for library in BLAS_LIBRARIES:
                with blas_library(library):
                    times = time_gemm(x, weights, timer)
                for method, us in times.items():
                    row[f"{library}_{method}_us"] = us
                    row[f"{library}_{method}_fraction"] = row["floor_us"] / us
            rows.append(row)
        print(f"gemm {name}: {len(ms)} sizes done", flush=True)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- attention table


def attention_cases(sizes: Sizes) -> list[tuple[str, list[int], int | None]]:
    """(kind, context length of each row, forced split count or None): every batch size x every length, the
    mixed batch longest first (as the scheduler orders a decode step) and in the order drawn, then mixed
    batches of several sizes, longest first, with the split count forced to 1, 2, 4 and 8 (how many splits
    balance a batch of uneven rows best?)."""
    cases = [("uniform", [ctx] * batch, None) for batch in sizes.batch_sizes for ctx in sizes.context_lens]
    low, high = sizes.mix_context_range
    generator = torch.Generator().manual_seed(SEED)
    drawn = torch.randint(low, high + 1, (sizes.mix_batch,), generator=generator).tolist()
    sweep = [(f"{kind}, {splits} splits", lens, splits) for batch in sizes.split_sweep_batches
             for kind, lens in (("mix", sorted(drawn[:batch], reverse=True)),
                                ("uniform", [sizes.context_lens[len(sizes.context_lens) // 2]] * batch))
             for splits in (1, 2, 4, 8)]
    return cases + [("mix", sorted(drawn, reverse=True), None), ("mix, arrival order", drawn, None)] + sweep


def kv_pool(num_blocks: int, block_size: int, shape: ModelShape,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's random bf16 k and v caches, [num_blocks, block_size, kv_heads, head_dim]."""
    dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    return (torch.randn(dims, dtype=torch.bfloat16, device=device),
            torch.randn(dims, dtype=torch.bfloat16, device=device))


def shuffled_block_tables(lens: list[int], width: int, block_size: int, num_blocks: int,
                          generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """int32 [len(lens), width]: row b holds the ceil(lens[b] / block_size) blocks its context needs, distinct
    and drawn at random from the pool (so not contiguous), then -1 as the engine pads a table."""
    need = [math.ceil(n / block_size) for n in lens]
    blocks = torch.randperm(num_blocks, generator=generator)[:sum(need)].to(torch.int32)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    for b, (start, n) in enumerate(zip(itertools.accumulate(need, initial=0), need)):
        tables[b, :n] = blocks[start:start + n]
    return tables.to(device)


def layer_kv_bytes(lens: list[int], shape: ModelShape) -> int:
    """Bytes of K and V one layer reads for rows holding `lens` tokens."""
    return sum(lens) * shape.kv_bytes_per_token // shape.num_layers


def split_count(forced: int | None, batch: int, max_context: int, shape: ModelShape, device: torch.device) -> int:
    """The split count paged_decode uses: the forced one, or the one it picks on a GPU from static shapes (the
    interpreter always uses one)."""
    if forced:
        return forced
    if device.type != "cuda":
        return 1
    return decode_num_splits(batch, shape.num_kv_heads, max_context,
                             torch.cuda.get_device_properties(device).multi_processor_count)


def attention_row(kind: str, lens: list[int], forced_splits: int | None, caches: tuple[torch.Tensor, torch.Tensor],
                  shape: ModelShape, generator: torch.Generator, timer: Timer, rates: Rates, empty_us: float) -> dict:
    """Time paged_decode on one batch (row b has lens[b] cached tokens) and compare it with its floors."""
    k_cache, v_cache = caches
    device, block_size = k_cache.device, k_cache.shape[1]
    batch, width = len(lens), math.ceil(max(lens) / block_size)
    tables = shuffled_block_tables(lens, width, block_size, k_cache.shape[0], generator, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
    scale = shape.head_dim ** -0.5

    def decode() -> None:
        paged_decode(q, k_cache, v_cache, tables, context_lens, scale, num_splits=forced_splits)
    us = timer.flushed_us(decode)
    kv_bytes = layer_kv_bytes(lens, shape)
    return {"kind": kind, "batch": batch, "context_len": round(sum(lens) / batch), "context_min": min(lens),
            "context_max": max(lens), "num_splits": split_count(forced_splits, batch, width * block_size, shape, device),
            "kv_bytes": kv_bytes, "us": us,
            "graph_us": timer.replayed_flushed_us(decode), "GBps": kv_bytes / us / 1e3,
            "copy_fraction": kv_bytes / (us / 1e6) / rates.copy_bandwidth, "over_empty_kernel": us / empty_us}


def attention_rows(shape: ModelShape, sizes: Sizes, timer: Timer, rates: Rates, empty_us: float,
                   device: torch.device) -> list[dict]:
    """One row per attention case, all drawing blocks from one pool big enough for the largest."""
    block_size = Config.kvcache_block_size
    cases = attention_cases(sizes)
    num_blocks = max(len(lens) * math.ceil(max(lens) / block_size) for _, lens, _ in cases)
    caches = kv_pool(num_blocks, block_size, shape, device)
    generator = torch.Generator().manual_seed(SEED)
    rows = []
    for kind, lens, splits in cases:
        rows.append(attention_row(kind, lens, splits, caches, shape, generator, timer, rates, empty_us))
        if len(rows) % len(sizes.context_lens) == 0:
            print(f"attention: {len(rows)}/{len(cases)} cases done", flush=True)
    return rows


def seed_decode_steps(sizes: Sizes) -> list[tuple[int, list[int]]]:
    """(step, each running row's context length in arrival order) for every step_stride-th decode step of the
    seed workload: after its prefill, row i holds prompt_i + step + 1 tokens while step < max_tokens_i - 1."""
    num_seqs, low, high = sizes.steps_workload
    workload = make_workload(num_seqs, high, high, min_input_len=low, min_output_len=low)
    steps = []
    for step in range(0, max(workload.max_tokens) - 1, sizes.step_stride):
        steps.append((step, [prompt + step + 1 for prompt, n in zip(workload.prompt_lens, workload.max_tokens)
                             if step < n - 1]))
    return steps


ORDERS = ("arrival", "longest first")  # a decode step's rows as requests arrived, and as the scheduler hands them


@dataclass
class DecodeBatch:
    """One sampled decode step of the seed workload laid out as a CUDA graph replays it."""
    step: int
    lens: list[int]  # the running rows' context lengths, in arrival order
    padded: int  # the captured graph size that holds them (padding rows are empty)
    max_context: int  # the block tables' width in tokens (max_model_len)
    args: dict[str, tuple]  # order -> paged_decode's (q, k_cache, v_cache, block_tables, context_lens)


def seed_decode_batches(shape: ModelShape, sizes: Sizes, device: torch.device,
                        orders: tuple[str, ...] = ORDERS) -> Iterator[DecodeBatch]:
    """Every step_stride-th decode step of the seed workload, its rows in each of `orders`, padded to the captured
    size with empty rows, block tables max_model_len wide, all drawing blocks from one shuffled pool."""
    block_size = Config.kvcache_block_size
    width = math.ceil(sizes.max_model_len / block_size)
    steps = seed_decode_steps(sizes)
    graph_sizes = capture_sizes(sizes.steps_workload[0])
    num_blocks = max(sum(math.ceil(n / block_size) for n in lens) for _, lens in steps)
    k_cache, v_cache = kv_pool(num_blocks, block_size, shape, device)
    generator = torch.Generator().manual_seed(SEED)
    for step, lens in steps:
        padded = next(bs for bs in graph_sizes if bs >= len(lens))
        args = {}
        for order in orders:
            ordered = lens if order == "arrival" else sorted(lens, reverse=True)
            rows_lens = ordered + [0] * (padded - len(lens))  # the graph's padding rows: empty
            tables = shuffled_block_tables(rows_lens, width, block_size, num_blocks, generator, device)
            context_lens = torch.tensor(rows_lens, dtype=torch.int32, device=device)
            q = torch.randn(padded, shape.num_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
            args[order] = (q, k_cache, v_cache, tables, context_lens)
        yield DecodeBatch(step, lens, padded, width * block_size, args)


def decode_step_rows(shape: ModelShape, sizes: Sizes, timer: Timer, device: torch.device) -> list[dict]:
    """paged_decode on each sampled decode step as a CUDA graph replays it (`seed_decode_batches`): rows in
    arrival order and longest first, the split count from shapes or forced (STEP_SPLITS)."""
    rows = []
    for batch in seed_decode_batches(shape, sizes, device):
        for order, args in batch.args.items():
            for forced in STEP_SPLITS if order == "longest first" else (None,):
                decode = functools.partial(paged_decode, *args, shape.head_dim ** -0.5, num_splits=forced)
                rows.append({"step": batch.step, "batch": len(batch.lens), "padded": batch.padded, "order": order,
                             "forced": forced is not None,
                             "num_splits": split_count(forced, batch.padded, batch.max_context, shape, device),
                             "kv_bytes": layer_kv_bytes(batch.lens, shape), "graph_us": timer.replayed_flushed_us(decode)})
        print(f"decode step {batch.step}: batch {len(batch.lens)} done", flush=True)
    return rows


def steps_summary(rows: list[dict], sizes: Sizes, shape: ModelShape, rates: Rates) -> dict:
    """Each variant's attention seconds over the whole benchmark (every sampled step stands for step_stride
    steps, every layer runs it once), and the floor: the same K/V bytes at the copy bandwidth."""
    scale = sizes.step_stride * shape.num_layers
    variants = {}
    for row in rows:
        name = f"{row['order']}, " + (f"{row['num_splits']} splits" if row["forced"] else "splits from shapes")
        variants.setdefault(name, []).append(row)
    first = next(iter(variants.values()))
    return {"seconds": {name: (sum(row["graph_us"] for row in group) * scale / 1e6
                               if all(row["graph_us"] is not None for row in group) else None)
                        for name, group in variants.items()},
            "floor_seconds": sum(row["kv_bytes"] for row in first) * scale / rates.copy_bandwidth,
            "steps": len(first), "step_stride": sizes.step_stride}


# ---------------------------------------------------------------- records and tables


def record_header(table: str, device: torch.device, rates: Rates, empty: dict[str, float],
                  smoke: bool) -> dict:
    """The fields both JSON records share: what ran where, the rates and the empty-kernel floor."""
    return {"table": table, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "model": "qwen3-0.6b", "smoke": smoke,
            "copy_bandwidth_GBps": rates.copy_bandwidth / 1e9, "peak_bf16_TFLOPs": rates.peak_flops / 1e12,
            "rates_source": rates.source, "empty_kernel_us": empty["do_bench"],
            "empty_kernel_graph_us": empty["graph"]}


GEMM_COLUMNS = [("gemm", "GEMM", "{}"), ("M", "M", "{}"), ("N", "N", "{}"), ("K", "K", "{}"),
                ("floor_us", "floor us", "{:.1f}"),
                ("cublas_do_bench_us", "cuBLAS do_bench us", "{:.1f}"),
                ("cublas_graph_us", "cuBLAS graph us", "{:.1f}"),
                ("cublaslt_do_bench_us", "cuBLASLt do_bench us", "{:.1f}"),
                ("cublaslt_graph_us", "cuBLASLt graph us", "{:.1f}"),
                ("cublas_graph_fraction", "floor/graph cuBLAS", "{:.2f}"),
                ("cublaslt_graph_fraction", "floor/graph cuBLASLt", "{:.2f}")]
ATTENTION_COLUMNS = [("kind", "kind", "{}"), ("batch", "batch", "{}"), ("context", "context", "{}"),
                     ("num_splits", "splits", "{}"), ("kv_MB", "KV MB", "{:.1f}"), ("us", "us", "{:.1f}"),
                     ("graph_us", "graph us", "{:.1f}"), ("GBps", "GB/s", "{:.0f}"),
                     ("copy_fraction", "of copy bw", "{:.2f}"),
                     ("over_empty_kernel", "x empty kernel", "{:.1f}")]


def attention_display_row(row: dict) -> dict:
    """An attention row with the cells its table derives: context (a range for the mix) and KV in MB."""
    context = (f"{row['context_min']}..{row['context_max']}" if row["context_min"] != row["context_max"]
               else row["context_len"])
    return {**row, "context": context, "kv_MB": row["kv_bytes"] / 1e6}


def markdown_table(record: dict) -> str:
    """A record (gemm_decode or decode_attention) as a title line and a markdown table; nulls show as '-'."""
    if record["table"] == "gemm_decode":
        columns, rows = GEMM_COLUMNS, record["rows"]
    else:
        columns, rows = ATTENTION_COLUMNS, map(attention_display_row, record["rows"])
    title = (f"{record['table']} on {record['device']} (torch {record['torch']}, triton {record['triton']}): "
             f"copy bandwidth {record['copy_bandwidth_GBps']:.0f} GB/s, bf16 peak "
             f"{record['peak_bf16_TFLOPs']:.0f} TFLOP/s, empty kernel {record['empty_kernel_us']:.1f} us "
             f"(do_bench), {record['empty_kernel_graph_us']:.2f} us (per launch in a graph)")
    lines = [title, "", "| " + " | ".join(header for _, header, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        cells = ("-" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_tables(json_dir: Path, sizes: Sizes, given_rates: Rates | None = None) -> dict[str, dict]:
    """Measure both tables on the GPU (or the CPU stand-in), write them as JSON in json_dir, return them.
    Each is written as soon as it is done, so a failure in the second keeps the first."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = GpuTimer(device) if device.type == "cuda" else CpuTimer()
    shape = ModelShape.from_config(json.loads(MODEL_CONFIG.read_text()))
    rates = measure_rates(device, given_rates)
    empty = empty_kernel_us(timer)
    smoke = sizes != FULL  # recorded so a tiny run is never mistaken for the table
    blas_default = str(torch.backends.cuda.preferred_blas_library()) if device.type == "cuda" else None
    json_dir.mkdir(parents=True, exist_ok=True)
    gemm = {**record_header("gemm_decode", device, rates, empty, smoke), "timing": GEMM_TIMING,
            "blas_default": blas_default, "l2_defeat_bytes": timer.l2_defeat_bytes,
            "rows": gemm_rows(shape, sizes.gemm_ms, timer, rates, device)}
    (json_dir / "gemm_decode.json").write_text(json.dumps(gemm, indent=2) + "\n")
    attention = {**record_header("decode_attention", device, rates, empty, smoke), "timing": ATTENTION_TIMING,
                 "block_size": Config.kvcache_block_size, "num_heads": shape.num_heads,
                 "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                 "rows": attention_rows(shape, sizes, timer, rates, empty["do_bench"], device)}
    attention["steps"] = decode_step_rows(shape, sizes, timer, device)
    attention["steps_summary"] = steps_summary(attention["steps"], sizes, shape, rates)
    (json_dir / "decode_attention.json").write_text(json.dumps(attention, indent=2) + "\n")
    return {"gemm_decode": gemm, "decode_attention": attention}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json-dir", type=Path, required=True,
                    help="folder for gemm_decode.json and decode_attention.json")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (on a CPU: Triton's interpreter)")
    ap.add_argument("--copy-bandwidth-GBps", type=float, help="skip measuring it (give the bf16 peak too)")
    ap.add_argument("--peak-bf16-TFLOPs", type=float, help="skip measuring it (give the copy bandwidth too)")
    args = ap.parse_args(argv)
    if (args.copy_bandwidth_GBps is None) != (args.peak_bf16_TFLOPs is None):
        ap.error("give both --copy-bandwidth-GBps and --peak-bf16-TFLOPs, or neither")
    if not args.smoke and not torch.cuda.is_available():
        ap.error("the full tables need a CUDA GPU; on a CPU run with --smoke")
    given = (Rates(args.copy_bandwidth_GBps * 1e9, args.peak_bf16_TFLOPs * 1e12, "given")
             if args.copy_bandwidth_GBps is not None else None)
    start = time.perf_counter()
    records = write_tables(args.json_dir, SMOKE if args.smoke else FULL, given)
    for record in records.values():
        print("\n" + markdown_table(record))
    summary = records["decode_attention"]["steps_summary"]
    print(f"\nthe seed benchmark's decode attention (floor {summary['floor_seconds']:.2f} s):")
    for name, seconds in summary["seconds"].items():
        print(f"  {name}: " + ("-" if seconds is None else f"{seconds:.2f} s"))
    print(f"\nwrote {', '.join(f'{name}.json' for name in records)} to {args.json_dir} "
          f"in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
