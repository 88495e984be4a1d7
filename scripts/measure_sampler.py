"""The torch Sampler against the one-pass TritonSampler on a CUDA GPU (figures/sampler_h200.json).

    python scripts/measure_sampler.py --json figures/sampler_h200.json [--batch 256] [--vocab 151936]

For the benchmark's decode batch (256 rows of Qwen3's vocabulary, bf16 logits as the LM head returns them)
and each way a batch may ask (the seed workload's temperature 0.6; top_k=20 with top_p=0.95; every row
seeded; top_p alone, which still sorts; all greedy), it times one sampling call of each sampler with CUDA
events (median of 50 after warm-up), counts the kernels one call launches (torch.profiler), and counts the
rows where the two disagree on seeded rows (none expected: same noise bits). About 20 s on an H200.
"""
import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm_edu.layers.sampler import Sampler
from nanovllm_edu.layers.triton_sampler import TritonSampler

from measure_cuda_graphs import median_ms  # this folder is on sys.path when a script runs

SEED_WORKLOAD_T = 0.6  # the benchmark's temperature (notebook 18)


def kernels_per_call(fn, calls: int = 5) -> float:
    """GPU kernels one call launches (memsets and copies not counted)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
               and "memset" not in e.name.lower()]
    return len(kernels) / calls


def cases(batch: int, vocab: int) -> dict[str, dict]:
    """Sampling arguments of each case, as the model runner's prepare_sample builds them."""
    dev = "cuda"
    temps = torch.full((batch,), SEED_WORKLOAD_T, device=dev)
    seeds = torch.arange(batch, device=dev) * 7919 + 11
    positions = torch.randint(100, 2000, (batch,), device=dev)
    return {
        "temperature 0.6 (seed workload)": dict(temperatures=temps),
        "top_k=20, top_p=0.95": dict(temperatures=temps, top_ks=torch.full((batch,), 20, device=dev),
                                      top_ps=torch.full((batch,), 0.95, device=dev), top_k_max=20),
        "every row seeded": dict(temperatures=temps, seeds=seeds, positions=positions,
                                 seeded_rows=torch.arange(batch, device=dev)),
        "top_p=0.95 alone (sorts)": dict(temperatures=temps, top_ps=torch.full((batch,), 0.95, device=dev)),
        "all greedy": dict(temperatures=torch.zeros(batch, device=dev), all_greedy=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    args = parser.parse_args()
    torch.manual_seed(0)
    logits = (torch.randn(args.batch, args.vocab, device="cuda") * 2).to(torch.bfloat16)
    reference, one_pass = Sampler(), TritonSampler()
    rows = []
    for name, kw in cases(args.batch, args.vocab).items():
        row = {"case": name}
        for label, sampler in (("torch", reference), ("one_pass", one_pass)):
            row[f"{label}_ms"] = median_ms(lambda: sampler(logits, **kw), repeats=50, warmup=10)
            row[f"{label}_kernels"] = kernels_per_call(lambda: sampler(logits, **kw))
        if "seeds" in kw:
            row["seeded_rows_differing"] = int((reference(logits, **kw) != one_pass(logits, **kw)).sum())
        row["speedup"] = row["torch_ms"] / row["one_pass_ms"]
        rows.append(row)
        print(f"{name:34s} torch {row['torch_ms']:.3f} ms ({row['torch_kernels']:.0f} kernels)  one pass "
              f"{row['one_pass_ms']:.3f} ms ({row['one_pass_kernels']:.0f} kernels)  x{row['speedup']:.1f}", flush=True)
    read_bytes = logits.numel() * logits.element_size()
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
              "vocab": args.vocab, "logits_dtype": "bfloat16", "logits_bytes": read_bytes, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
