"""Tile sizes for the attention kernels on the seed benchmark's own steps (kernels/paged_attention.py).

    python scripts/sweep_attention.py --json OUT.json [--step-stride 64]

Decode: every step_stride-th decode step of the seed benchmark (rows longest first, padded to the captured
graph size, block tables max_model_len wide, as scripts/kernel_tables.py lays them out), timed as a replayed
CUDA graph (L2 flushed) for each tile length, warps, pipeline stages and split count (the count from shapes
times 1/2, 1 or 2); each variant's sum is scaled to seconds over the whole benchmark (x stride x layers).
Prefill: the seed prompts packed into steps of 16,384 tokens as the scheduler packs them (a prompt cut at a
step's end continues in the next, its first part already cached), each step timed with do_bench for each
(block_m, block_n, warps, stages); the sum is seconds over the benchmark (x layers). Floors: the decode steps'
K/V bytes at the copy bandwidth; the prefill's causal attention FLOPs at the bf16 peak.
"""
import argparse
import dataclasses
import functools
import itertools
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_tables as kt  # noqa: E402  (sets up the package's imports and the GPU timer)

import torch  # noqa: E402
import triton  # noqa: E402

from nanovllm_edu.config import Config  # noqa: E402
from nanovllm_edu.kernels.paged_attention import (MAX_SPLITS, SHORT_TILES_FROM, decode_num_splits, paged_decode,
                                                 varlen_prefill)  # noqa: E402

DECODE_CONFIGS = [dict(block_n=bn, num_warps=w, num_stages=s) for bn, (w, s) in
                  itertools.product((32, 64, 128), ((2, 2), (4, 2), (4, 3), (8, 2)))]
SPLIT_SCALES = (0.5, 1, 2)
PREFILL_CONFIGS = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s) for bm, bn, w, s in
                   ((64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3),
                    (128, 32, 4, 4), (64, 32, 4, 4), (128, 64, 8, 4))]
TOKEN_BUDGET = 16384


def decode_sweep(shape, timer, rates, stride: int) -> dict:
    sizes = dataclasses.replace(kt.FULL, step_stride=stride)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    totals, floor, rows = {}, 0.0, []
    for batch in kt.seed_decode_batches(shape, sizes, device, orders=("longest first",)):
        floor += kt.layer_kv_bytes(batch.lens, shape) / rates.copy_bandwidth
        base = decode_num_splits(batch.padded, shape.num_kv_heads, batch.max_context, sms)
        for cfg, scale in itertools.product(DECODE_CONFIGS, SPLIT_SCALES):
            splits = max(1, min(MAX_SPLITS, round(base * scale)))
            fn = functools.partial(paged_decode, *batch.args["longest first"], shape.head_dim ** -0.5,
                                   num_splits=splits, **cfg)
            name = f"block_n={cfg['block_n']} warps={cfg['num_warps']} stages={cfg['num_stages']} splits x{scale}"
            us = timer.replayed_flushed_us(fn)
            totals[name] = totals.get(name, 0.0) + us / 1e6
            rows.append({"step": batch.step, "batch": len(batch.lens), "padded": batch.padded, "num_splits": splits,
                         **cfg, "split_scale": scale, "graph_us": us})
        print(f"decode step {batch.step}: batch {len(batch.lens)} done", flush=True)
    steps = len({row["step"] for row in rows})
    factor = stride * shape.num_layers
    seconds = {name: s * factor for name, s in sorted(totals.items(), key=lambda kv: kv[1])}
    record = {"seconds": seconds, "floor_seconds": floor * factor, "steps": steps, "step_stride": stride,
              "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "num_sms": sms, "rows": rows}
    record["rules"] = rule_seconds(record)
    return record


def rule_seconds(decode: dict) -> dict[str, float]:
    """Seconds over the benchmark of whole tile rules (each step timed with the split count from shapes):
    one tile configuration everywhere, or paged_decode's rule (short tiles from SHORT_TILES_FROM programs per SM)."""
    steps = {}
    for row in decode["rows"]:
        if row["split_scale"] == 1:
            steps.setdefault((row["step"], row["padded"]), {})[row["block_n"], row["num_warps"], row["num_stages"]] = \
                row["graph_us"]
    full = lambda padded: padded * decode["num_kv_heads"] >= SHORT_TILES_FROM * decode["num_sms"]
    rules = {"32-token tiles, 2 warps everywhere": lambda padded, t: t[32, 2, 2],
             "64-token tiles, 4 warps everywhere": lambda padded, t: t[64, 4, 2],
             "paged_decode's rule: 32/2 on a full GPU, else 64/4": lambda padded, t: t[(32, 2, 2) if full(padded) else (64, 4, 2)]}
    factor = decode["step_stride"] * decode["num_layers"] / 1e6
    return {name: sum(rule(padded, t) for (_, padded), t in steps.items()) * factor for name, rule in rules.items()}


def prefill_steps(prompt_lens: list[int]) -> list[list[tuple[int, int]]]:
    """(new tokens, tokens already cached) of each sequence in each prefill step of TOKEN_BUDGET tokens."""
    steps, current, room = [], [], TOKEN_BUDGET
    for n in prompt_lens:
        done = 0
        while done < n:
            take = min(n - done, room)
            current.append((take, done))
            done, room = done + take, room - take
            if room == 0:
                steps.append(current)
                current, room = [], TOKEN_BUDGET
    return steps + ([current] if current else [])


def prefill_sweep(shape, timer, rates) -> dict:
    device, block_size = torch.device("cuda"), Config.kvcache_block_size
    workload = kt.make_workload()
    steps = prefill_steps([len(p) for p in workload.prompts])
    totals, flops = {}, 0
    for chunks in steps:
        tokens = sum(n for n, _ in chunks)
        q = torch.randn(tokens, shape.num_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
        k, v = (torch.randn(tokens, shape.num_kv_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
                for _ in range(2))
        cu_q = torch.tensor([0, *itertools.accumulate(n for n, _ in chunks)], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, *itertools.accumulate(n + c for n, c in chunks)], dtype=torch.int32, device=device)
        if not any(c for _, c in chunks):  # a step of whole prompts: keys are the new tokens (no block tables)
            cu_k = cu_q
        lens = [n + c for n, c in chunks]
        num_blocks = sum(math.ceil(n / block_size) for n in lens)
        k_cache, v_cache = kt.kv_pool(num_blocks, block_size, shape, device)
        tables = kt.shuffled_block_tables(lens, max(math.ceil(n / block_size) for n in lens), block_size,
                                          num_blocks, torch.Generator().manual_seed(kt.SEED), device)
        max_q = max(n for n, _ in chunks)
        flops += sum(4 * shape.num_heads * shape.head_dim * (n * c + n * (n + 1) // 2) for n, c in chunks)
        for cfg in PREFILL_CONFIGS:
            fn = functools.partial(varlen_prefill, q, k, v, k_cache, v_cache, cu_q, cu_k, max_q,
                                   tables if any(c for _, c in chunks) else None,
                                   shape.head_dim ** -0.5, **cfg)
            name = " ".join(f"{k}={v}" for k, v in cfg.items())
            try:
                totals[name] = totals.get(name, 0.0) + timer.flushed_us(fn) / 1e6
            except Exception as error:  # noqa: BLE001  (a config the compiler rejects)
                totals[name] = math.inf
                print(f"prefill {name}: {type(error).__name__}: {str(error)[:100]}", flush=True)
        print(f"prefill step of {tokens} tokens, {len(chunks)} sequences done", flush=True)
    seconds = {name: s * shape.num_layers for name, s in sorted(totals.items(), key=lambda kv: kv[1])}
    return {"seconds": seconds, "floor_seconds": flops * shape.num_layers / rates.peak_flops,
            "steps": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--step-stride", type=int, default=64)
    ap.add_argument("--parts", default="prefill,decode")
    args = ap.parse_args()
    device = torch.device("cuda")
    timer = kt.GpuTimer(device)
    shape = kt.ModelShape.from_config(json.loads(kt.MODEL_CONFIG.read_text()))
    rates = kt.measure_rates(device, None)
    start, record = time.perf_counter(), {"device": torch.cuda.get_device_name(), "triton": triton.__version__}
    for part in args.parts.split(","):
        record[part] = prefill_sweep(shape, timer, rates) if part == "prefill" else \
            decode_sweep(shape, timer, rates, args.step_stride)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{part}: floor {record[part]['floor_seconds']:.3f} s")
        for name, seconds in [*record[part].get("rules", {}).items(), *list(record[part]["seconds"].items())[:12]]:
            print(f"  {seconds:.3f} s  {name}")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
