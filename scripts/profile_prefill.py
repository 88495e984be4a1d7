"""Where the seed benchmark's prefill time goes, kernel by kernel, against its compute floor.

    python scripts/profile_prefill.py --json OUT.json [--num-seqs 256]

Builds the engine on random Qwen3-0.6B weights (prefix caching off, so a repeat computes every prompt again),
then runs the seed workload's prompts with max_tokens=1: the benchmark's prefill steps (16,384 tokens each)
and one sampling step. Times three such runs by the wall clock, then profiles one with torch.profiler and
groups its CUDA kernels by name and category (nanovllm_edu/bench/profile.py, as scripts/profile_decode.py). The floor is the prefill's
FLOPs (the benchmark's count: GEMMs and causal attention) at the bf16 peak this script measures.
"""
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nanovllm_edu.bench import random_weights_checkpoint
from nanovllm_edu.bench.hardware import ModelShape, measure_bf16_flops, workload_cost
from nanovllm_edu.bench.profile import kernel_rows, profile_part, summed  # the grouping and categories
from nanovllm_edu.bench.workload import make_workload
from nanovllm_edu.llm import LLM
from nanovllm_edu.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    workload = make_workload(args.num_seqs)
    params = SamplingParams(temperature=workload.temperature, max_tokens=1, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(random_weights_checkpoint("qwen3-0.6b", tmp), enable_prefix_caching=False)
        try:
            shape = ModelShape.from_config(llm.config.hf_config.to_dict())
            llm.generate(workload.prompts[:32], params, use_tqdm=False)  # warm-up: compiles, captures
            seconds = []
            for _ in range(args.runs):
                torch.cuda.synchronize()
                start = time.perf_counter()
                llm.generate(workload.prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - start)
            events = {"prefill": profile_part(lambda: llm.generate(workload.prompts, params, use_tqdm=False),
                                                 1, True)}
        finally:
            llm.exit()
    rows = kernel_rows(events, 1)
    peak = measure_bf16_flops(torch.device("cuda"))
    flops = workload_cost(shape, [len(p) for p in workload.prompts], workload.max_tokens)["prefill_flops"]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "prompt_tokens": sum(map(len, workload.prompts)), "num_seqs": args.num_seqs,
              "wall_seconds": seconds, "median_seconds": statistics.median(seconds),
              "flops": flops, "peak_flops": peak, "floor_seconds": flops / peak,
              "kernel_us_by_category": summed(rows, "category", "us_per_step"), "kernels": rows}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"prefill of {result['prompt_tokens']} tokens: {[round(s, 3) for s in seconds]} s, floor "
          f"{result['floor_seconds']:.3f} s at {peak / 1e12:.0f} TFLOP/s")
    for category, us in result["kernel_us_by_category"].items():
        print(f"  {category:<17} {us / 1e3:8.1f} ms")
    for row in rows[:20]:
        print(f"  {row['us_per_step'] / 1e3:8.2f} ms {row['calls_per_step']:6.0f}  {row['name'][:100]}")


if __name__ == "__main__":
    main()
