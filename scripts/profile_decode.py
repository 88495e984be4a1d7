"""Where one decode step's GPU time goes, kernel by kernel (a JSON record and a table), to compare versions.

    python scripts/profile_decode.py --json OUT.json [--batch 256] [--context 1024] [--steps 20]
                                     [--enforce-eager]
    python scripts/profile_decode.py --json OUT.json --smoke   # CPU check: tiny model, batch 4, context 40

Builds the engine (random Qwen3-0.6B weights), then a decode batch of `--batch` sequences whose contexts are
drawn uniformly from context * [1 - spread, 1 + spread] tokens (distinct KV blocks per sequence), and runs
what the engine's GPU runs per decode step, in three parts:

    forward  hidden = runner.forward_pass.graphs.run(step)   (graph replay; runner.model(...) eagerly without graphs)
    logits   runner.model.compute_logits(hidden)
    sample   runner.sample(logits, runner.prepare_sample(seqs))   (temperature 0.6, as the benchmark)

The same step is re-run (positions do not advance). After a warm-up it times `--timed-steps` steps with CUDA
events (median per part; as in the engine, prepare_sample's host work comes before the forward, outside the
timed span), then profiles each part in its own torch.profiler window of `--steps` repeats, so every kernel's
part is known by construction (the sample window holds prepare_sample's copy to the device). Kernels are
grouped by name into categories (nanovllm_edu/bench/profile.py, notebook 20) and sorted by time per step: "kernel_us_per_step" sums their durations, "ms_per_step" is time
on the GPU's clock, launch gaps included. To compare code versions, run the same script with PYTHONPATH
pointing at another copy of the package (`package_file` says which copy ran).
"""
import argparse
import itertools
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

import nanovllm_edu
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.bench import random_weights_checkpoint
from nanovllm_edu.bench.profile import kernel_rows, profile_part, summed  # grouping, categories: lesson 20
from nanovllm_edu.engine.sequence import Sequence
from nanovllm_edu.layers.sampler import SamplingInputs
from nanovllm_edu.llm import LLM
from nanovllm_edu.sampling_params import SamplingParams
from nanovllm_edu.utils.step_inputs import StepInputs

PARTS = ("forward", "logits", "sample")
TEMPERATURE = 0.6  # the benchmark workload's (nanovllm_edu/bench/workload.py)
WARMUP_STEPS = 5
SMOKE = {"batch": 4, "context": 40, "steps": 2, "timed_steps": 2}
TABLE_ROWS = 25


def context_lengths(batch: int, context: int, spread: float, seed: int) -> np.ndarray:
    """Per-row context lengths (the new token included), uniform in context * [1 - spread, 1 + spread]."""
    low, high = max(1, round(context * (1 - spread))), max(1, round(context * (1 + spread)))
    return np.random.default_rng(seed).integers(low, high + 1, size=batch)


def build_decode_batch(runner, context_lens: np.ndarray, vocab_size: int,
                       seed: int) -> tuple[StepInputs, list[Sequence]]:
    """Decode inputs on the runner's device for sequences of `context_lens` tokens, each on its own KV blocks,
    and the matching engine Sequence objects (their sampling parameters feed `prepare_sample`)."""
    batch, block_size = len(context_lens), runner.block_size
    num_blocks = (context_lens + block_size - 1) // block_size
    if num_blocks.sum() > runner.num_kvcache_blocks:
        raise SystemExit(f"the batch needs {num_blocks.sum()} KV blocks, the cache has "
                         f"{runner.num_kvcache_blocks}: lower --batch or --context")
    first_block = np.concatenate([[0], np.cumsum(num_blocks)[:-1]])
    columns = np.arange(int(num_blocks.max()))
    table = np.where(columns < num_blocks[:, None], first_block[:, None] + columns, -1).astype(np.int32)
    positions = context_lens - 1
    last_blocks = table[np.arange(batch), positions // block_size].astype(np.int64)
    slots = last_blocks * block_size + positions % block_size
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, vocab_size, size=batch)

    def on_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(array).to(device=runner.device, dtype=dtype)

    step = StepInputs(False, on_device(input_ids, torch.int64), on_device(positions, torch.int64),
                      on_device(slots, torch.int64), block_tables=on_device(table, torch.int32),
                      max_seqlen_k=int(context_lens.max()), context_lens=on_device(context_lens, torch.int32))
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=1024, ignore_eos=True)
    seqs = []
    for row, length in enumerate(context_lens):
        seq = Sequence(rng.integers(0, vocab_size, size=int(length)).tolist(), params, block_size)
        seq.block_table = table[row, :num_blocks[row]].tolist()
        seqs.append(seq)
    return step, seqs


def decode_parts(runner, step: StepInputs, seqs: list[Sequence]) -> tuple[dict[str, Callable], bool]:
    """A decode step's work as functions: prepare() -> SamplingInputs, forward() -> hidden, logits(hidden),
    sample(logits, sampling); and whether the forward replays a CUDA graph."""
    graphs = getattr(runner.forward_pass, "graphs", None)  # None: an eager forward (CPU, enforce_eager)
    use_graph = graphs is not None and graphs.padded_size(len(seqs)) is not None

    def forward() -> torch.Tensor:
        return graphs.run(step) if use_graph else runner.model(step.input_ids, step.positions, step)

    def sample(logits: torch.Tensor, sampling: SamplingInputs) -> torch.Tensor:
        return runner.sample(logits, sampling)[0]  # (tokens, logprobs): the tokens

    return {"prepare": lambda: runner.prepare_sample(seqs), "forward": forward,
            "logits": runner.model.compute_logits, "sample": sample}, use_graph


def run_step(parts: dict[str, Callable]) -> torch.Tensor:
    sampling = parts["prepare"]()
    return parts["sample"](parts["logits"](parts["forward"]()), sampling)


def clock_mark(cuda: bool):
    """A point in time: a recorded CUDA event on a GPU, time.perf_counter() seconds on a CPU."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed_ms(start, end, cuda: bool) -> float:
    return start.elapsed_time(end) if cuda else (end - start) * 1e3


def time_parts(parts: dict[str, Callable], steps: int, cuda: bool) -> dict[str, float]:
    """Median milliseconds per step of each part and of the whole step: CUDA events (one sync per step) on a
    GPU, time.perf_counter on a CPU. prepare_sample runs before the first mark: the engine prepares first."""
    samples = defaultdict(list)
    for _ in range(steps):
        sampling = parts["prepare"]()
        marks = [clock_mark(cuda)]
        hidden = parts["forward"]()
        marks.append(clock_mark(cuda))
        logits = parts["logits"](hidden)
        marks.append(clock_mark(cuda))
        parts["sample"](logits, sampling)
        marks.append(clock_mark(cuda))
        if cuda:
            torch.cuda.synchronize()
        ms = [elapsed_ms(a, b, cuda) for a, b in itertools.pairwise(marks)]
        for part, value in zip(PARTS, ms):
            samples[part].append(value)
        samples["total"].append(sum(ms))
    return {key: round(statistics.median(values), 4) for key, values in samples.items()}


@torch.inference_mode()
def measure(llm: LLM, batch: int, context: int, spread: float, steps: int, timed_steps: int,
            seed: int) -> dict:
    """The record: a decode batch of `batch` rows around `context` tokens, its parts timed and profiled."""
    runner = llm.model_runner
    cuda = runner.device.type == "cuda"
    lens = context_lengths(batch, context, spread, seed)
    step, seqs = build_decode_batch(runner, lens, llm.config.hf_config.vocab_size, seed)
    parts, use_graph = decode_parts(runner, step, seqs)
    for _ in range(WARMUP_STEPS if cuda else 1):
        run_step(parts)
    if cuda:
        torch.cuda.synchronize()
    ms_per_step = time_parts(parts, timed_steps, cuda)
    hidden = parts["forward"]()
    logits = parts["logits"](hidden)
    windows = {"forward": parts["forward"], "logits": lambda: parts["logits"](hidden),
               "sample": lambda: parts["sample"](logits, parts["prepare"]())}
    events = {part: profile_part(windows[part], steps, cuda) for part in PARTS}
    rows = kernel_rows(events, steps)
    calls, kernel_us = summed(rows, "part", "calls_per_step"), summed(rows, "part", "us_per_step")
    warnings = [f"the profiler recorded nothing in the {part} part" for part in PARTS if part not in calls]
    return {
        "device": torch.cuda.get_device_name(runner.device) if cuda else "cpu",
        "torch": torch.__version__, "package_file": nanovllm_edu.__file__,
        "batch": batch, "context": context,
        "context_lens": {"min": int(lens.min()), "max": int(lens.max()),
                         "mean": round(float(lens.mean()), 1)},
        "max_model_len": llm.config.max_model_len, "max_num_seqs": llm.config.max_num_seqs,
        "steps": steps, "timed_steps": timed_steps,
        "forward_mode": "cuda_graph" if use_graph else "eager",
        "attention_backend": getattr(runner.backend, "name", type(runner.backend).__name__),
        "sampler": type(runner.sampler).__name__,
        "profiled": "CUDA kernels" if cuda else "CPU operators (self time): --smoke",
        "ms_per_step": ms_per_step,
        "kernels_per_step": {part: calls.get(part, 0.0) for part in (*PARTS, "total")},
        "kernel_us_per_step": {part: kernel_us.get(part, 0.0) for part in (*PARTS, "total")},
        "by_category_us_per_step": summed(rows, "category", "us_per_step"),
        "warnings": warnings,
        "kernels": rows,
    }


def print_summary(result: dict) -> None:
    """The top kernels and the totals per category and per part, as a table."""
    print(f"{result['device']}, torch {result['torch']}, {result['package_file']}")
    lens = result["context_lens"]
    print(f"batch {result['batch']}, context {lens['min']}-{lens['max']} (mean {lens['mean']}), forward "
          f"{result['forward_mode']}, attention {result['attention_backend']}, sampler {result['sampler']}, "
          f"profiled {result['steps']} steps per part ({result['profiled']})")
    print(f"\n{'us/step':>10} {'calls':>6}  {'part':<8} {'category':<17} name")
    for row in result["kernels"][:TABLE_ROWS]:
        name = row["name"] if len(row["name"]) <= 90 else row["name"][:87] + "..."
        print(f"{row['us_per_step']:10.1f} {row['calls_per_step']:6.1f}  {row['part']:<8} "
              f"{row['category']:<17} {name}")
    if len(result["kernels"]) > TABLE_ROWS:
        print(f"{'':>10} ... {len(result['kernels']) - TABLE_ROWS} more kernels in the JSON")
    print(f"\n{'category':<17} {'us/step':>10}")
    for category, us in result["by_category_us_per_step"].items():
        print(f"{category:<17} {us:10.1f}")
    print(f"\n{'part':<8} {'kernels/step':>12} {'kernel us/step':>14} {'timed ms/step':>13}")
    for part in (*PARTS, "total"):
        print(f"{part:<8} {result['kernels_per_step'][part]:12.1f} "
              f"{result['kernel_us_per_step'][part]:14.1f} {result['ms_per_step'][part]:13.3f}")
    for warning in result["warnings"]:
        print(f"WARNING: {warning}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the record")
    ap.add_argument("--batch", type=int, default=256, help="sequences in the decode batch")
    ap.add_argument("--context", type=int, default=1024, help="mean cached tokens per sequence")
    ap.add_argument("--spread", type=float, default=0.1,
                    help="contexts are uniform in context * [1 - spread, 1 + spread]")
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="the engine's max_model_len (default: Config's, as the benchmark; raised to fit the "
                         "contexts): it sets the graphs' block-table width, which picks the decode splits")
    ap.add_argument("--steps", type=int, default=20, help="steps profiled per part")
    ap.add_argument("--timed-steps", type=int, default=100, help="steps timed with CUDA events (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: the forward runs eagerly")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the code path: tiny model, batch 4, context 40, 2 steps, "
                         "CPU operators instead of kernels")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    max_model_len = max(args.max_model_len, round(args.context * (1 + args.spread)))
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            llm = LLM(tiny_model_path(), device="cpu", max_num_seqs=args.batch, max_model_len=max_model_len)
        else:
            llm = LLM(random_weights_checkpoint("qwen3-0.6b", tmp), max_num_seqs=args.batch,
                      max_model_len=max_model_len, enforce_eager=args.enforce_eager)
        try:
            result = measure(llm, args.batch, args.context, args.spread, args.steps, args.timed_steps,
                             args.seed)
        finally:
            llm.exit()
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print_summary(result)


if __name__ == "__main__":
    main()
