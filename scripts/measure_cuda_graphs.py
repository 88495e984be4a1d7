"""Decode step time, eager versus CUDA-graph replay, per batch size, on a CUDA GPU (figures/cuda_graphs.json).

    python scripts/measure_cuda_graphs.py --json figures/cuda_graphs.json [--model PATH] [--context 512]

Builds the engine (random Qwen3-0.6B weights unless --model is given), then for each batch size fills a
decode context of `--context` cached tokens per sequence and times the model's forward pass both ways
with CUDA events (median of repeats after warm-up). The capture time and memory come from the engine.
"""
import argparse
import json
import math
import tempfile

import torch

from nanovllm_edu.bench import random_weights_checkpoint
from nanovllm_edu.llm import LLM
from nanovllm_edu.utils.step_inputs import StepInputs

BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def median_ms(fn, repeats: int = 30, warmup: int = 5) -> float:
    """Median wall time of fn() in milliseconds, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def measure(llm: LLM, context: int) -> dict:
    runner = llm.model_runner
    graphs = getattr(runner.forward_pass, "graphs", None)  # None: an eager forward (CPU, enforce_eager)
    assert graphs is not None, "the engine captured no CUDA graphs (enforce_eager, or a backend without capture)"
    device, block_size = runner.device, runner.block_size
    blocks_per_seq = math.ceil(context / block_size)
    vocab = llm.config.hf_config.vocab_size
    eager_ms, graph_ms = [], []
    sizes = [bs for bs in BATCH_SIZES if bs <= graphs.batch_sizes[-1] and bs * blocks_per_seq <= runner.num_kvcache_blocks]
    for bs in sizes:
        tables = torch.arange(bs * blocks_per_seq, dtype=torch.int32, device=device).view(bs, blocks_per_seq)
        last = context - 1
        slots = (tables[:, last // block_size].long() * block_size + last % block_size)
        ids = torch.randint(0, vocab, (bs,), device=device)
        positions = torch.full((bs,), last, dtype=torch.int64, device=device)
        context_lens = torch.full((bs,), context, dtype=torch.int32, device=device)
        step = StepInputs(False, ids, positions, slots, block_tables=tables, context_lens=context_lens)
        eager_ms.append(median_ms(lambda: runner.model(ids, positions, step)))
        graph_ms.append(median_ms(lambda: graphs.run(step)))
        print(f"batch {bs:4d}: eager {eager_ms[-1]:7.3f} ms  graph {graph_ms[-1]:7.3f} ms  "
              f"x{eager_ms[-1] / graph_ms[-1]:.1f}", flush=True)
    return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "context_len": context,
            "batch_sizes": sizes, "eager_step_ms": eager_ms, "graph_step_ms": graph_ms,
            "num_graphs": len(graphs.batch_sizes), "captured_sizes": graphs.batch_sizes,
            "capture_seconds": graphs.capture_seconds, "capture_bytes": graphs.capture_bytes,
            "attention_backend": runner.backend.name}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: random Qwen3-0.6B weights)")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    ap.add_argument("--json", default="figures/cuda_graphs.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_weights_checkpoint("qwen3-0.6b", tmp)
        llm = LLM(model, max_num_seqs=512, max_model_len=4096)
        result = measure(llm, args.context)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("num_graphs", "capture_seconds", "capture_bytes")}))


if __name__ == "__main__":
    main()
