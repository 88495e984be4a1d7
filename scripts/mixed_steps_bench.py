"""Mixed prefill/decode steps against separate steps on one GPU (notebooks 06, 14 and 22 read the record).

    python scripts/mixed_steps_bench.py online  --json out/mixed_online.json    # 10 and 40 req/s, stall, chunk caps
    python scripts/mixed_steps_bench.py offline --json out/mixed_offline.json   # the seed benchmark, 3 runs each
    python scripts/mixed_steps_bench.py cost    --json out/mixed_cost.json      # one mixed step: eager vs a graph

Before/after runs share one engine: the scheduling policy (`scheduler.mixed_steps`) and the chunk cap
(`scheduler.chunk_cap`) are switched between runs while the engine is idle, so both policies run on the same
weights, KV cache and CUDA graphs, alternated within one process (the machine is noisy; compare within a call).
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from measure_cuda_graphs import median_ms

from nanovllm_edu.bench.checkpoint import random_weights_checkpoint
from nanovllm_edu.bench.online import fresh_prompts, run_rate, stall_summary, stall_timeline
from nanovllm_edu.bench.timing import time_generate
from nanovllm_edu.bench.workload import fit_to_vocab, make_workload, sampling_params_for, warmup_workload
from nanovllm_edu.utils.step_inputs import StepInputs

# name -> (mixed steps, piecewise CUDA graphs, full-step CUDA graphs) for prefill and mixed steps; the first is
# the engine before all three, "mixed, pieces" the mixed steps before full-step graphs
POLICIES = {"separate, eager prefill": (False, False, False), "separate, pieces": (False, True, False),
            "separate": (False, True, True), "mixed, pieces": (True, True, False), "mixed": (True, True, True)}


def set_policy(llm, policy: tuple[bool, bool, bool], chunk_cap: int | None = None) -> None:
    """Switch an idle engine's scheduling policy, its piecewise and full-step graphs on or off, and mixed
    steps' per-prompt chunk cap (0: none)."""
    assert llm.is_finished(), "switch policies only between runs"
    mixed, piecewise, full = policy
    llm.scheduler.mixed_steps = mixed
    cap = llm.config.long_prefill_token_threshold if chunk_cap is None else chunk_cap
    llm.scheduler.chunk_cap = cap or llm.config.max_num_batched_tokens
    forward = llm.model_runner.forward_pass
    if not hasattr(forward, "saved"):
        forward.saved = forward.piecewise, forward.full
    forward.piecewise = forward.saved[0] if piecewise else None
    forward.full = forward.saved[1] if full else None


def report(args, row: dict) -> None:
    """Print one measurement and append it to `<json>.partial.jsonl`: a run cut off by a time limit keeps what it
    measured (the record itself is written only at the end)."""
    print(json.dumps(row), flush=True)
    partial = Path(args.json + ".partial.jsonl")
    partial.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("a") as f:
        f.write(json.dumps(row) + "\n")


def latency(run: dict) -> dict:
    """The numbers the issue asks for, in ms, from one rate's record."""
    ms = lambda stats, q: None if stats[q] is None else round(1e3 * stats[q], 2)
    return {"rate": run["request_rate"], "ttft_p50_ms": ms(run["ttft_s"], "p50"), "ttft_p99_ms": ms(run["ttft_s"], "p99"),
            "tpot_p50_ms": ms(run["tpot_s"], "p50"), "tpot_p99_ms": ms(run["tpot_s"], "p99"),
            "req_s": round(run["request_throughput_req_s"], 2), "tok_s": round(run["output_throughput_tok_s"]),
            "preemptions": run["num_preemptions"], **run["steps"]}


def online(model: str, args) -> dict:
    from nanovllm_edu.online import OnlineLLM
    workload = make_workload(args.num_requests)
    runs, stalls, sweep, offset = [], {}, [], 0
    with OnlineLLM(model, attention_backend="triton") as llm:
        workload = fit_to_vocab(workload, llm.config.hf_config.vocab_size)
        small = warmup_workload(workload, llm.config.hf_config.vocab_size)
        for policy in POLICIES.values():  # compile with every policy before the clock runs
            set_policy(llm, policy)
            llm.generate(small.prompts, sampling_params_for(small), use_tqdm=False)
        for repeat in range(args.repeats):
            for name in args.policies:
                set_policy(llm, POLICIES[name])
                for rate in args.rates:
                    offset += 1
                    run = run_rate(llm, fresh_prompts(workload, offset, llm.config.hf_config.vocab_size), rate)
                    runs.append({"policy": name, "repeat": repeat} | latency(run))
                    report(args, runs[-1])
        for repeat in range(args.repeats):
            for name in args.policies:
                set_policy(llm, POLICIES[name])
                timeline = stall_timeline(llm, long_prompt_len=args.stall_prompt_len, seed=1 + repeat)
                summary = stall_summary(timeline)
                stall = {"prefill_ms": round(1e3 * summary["prefill_s"], 2),
                         "median_gap_ms": round(1e3 * summary["median_gap_s"], 2),
                         "largest_gap_ms": round(1e3 * max(b - a for a, b in summary["largest_gaps"]), 2)}
                report(args, {"policy": name, "repeat": repeat, "stall": stall})
                stalls.setdefault(name, []).append(stall | ({"timeline": timeline} if repeat == 0 else {}))
        for cap in args.caps:
            set_policy(llm, POLICIES["mixed"], cap)
            offset += 1
            run = run_rate(llm, fresh_prompts(workload, offset, llm.config.hf_config.vocab_size), args.sweep_rate)
            sweep.append({"chunk_cap": cap} | latency(run))
            report(args, sweep[-1])
        config = {"long_prefill_token_threshold": llm.config.long_prefill_token_threshold,
                  "max_num_batched_tokens": llm.config.max_num_batched_tokens}
    return {"workload": workload.describe(), "engine": config, "runs": runs, "stall": stalls, "cap_sweep": sweep}


def offline(model: str, args) -> dict:
    from nanovllm_edu.llm import LLM
    llm = LLM(model, attention_backend="triton")
    workload = fit_to_vocab(make_workload(), llm.config.hf_config.vocab_size)
    runs = []
    for repeat in range(args.repeats):
        for name in args.policies:
            set_policy(llm, POLICIES[name])
            seconds, _, steps = time_generate(llm, workload)
            runs.append({"policy": name, "repeat": repeat, "seconds": round(seconds, 3),
                         "tok_s": round(workload.total_tokens / seconds), **steps})
            report(args, runs[-1])
    medians = {name: statistics.median(r["tok_s"] for r in runs if r["policy"] == name) for name in args.policies}
    return {"total_tokens": workload.total_tokens, "runs": runs, "median_tok_s": medians}


def time_ms(fn) -> float:
    """Median milliseconds of `fn()` on the GPU (CUDA events), rounded for the record."""
    return round(median_ms(fn, repeats=20, warmup=1), 3)


def mixed_step(runner, num_decodes: int, context: int, chunk: int) -> StepInputs:
    """A mixed step on the device: `num_decodes` rows of `context` cached tokens, then one `chunk`-token prompt
    (nothing cached), on distinct blocks of the idle engine's cache."""
    bs, dev = runner.block_size, runner.device
    per_row = -(-context // bs)
    tables = [[(i * per_row + j) % runner.num_kvcache_blocks for j in range(per_row)] for i in range(num_decodes)]
    chunk_blocks = [(num_decodes * per_row + j) % runner.num_kvcache_blocks for j in range(-(-chunk // bs))]
    width = max(per_row, len(chunk_blocks))
    table = torch.full((num_decodes + (chunk > 0), width), -1, dtype=torch.int32)
    for i, row in enumerate(tables + ([chunk_blocks] if chunk else [])):
        table[i, :len(row)] = torch.tensor(row)
    pos_d = torch.full((num_decodes,), context - 1)
    slots_d = table[:num_decodes, (context - 1) // bs].long() * bs + (context - 1) % bs
    pos_c = torch.arange(chunk)
    slots_c = torch.tensor(chunk_blocks)[pos_c // bs] * bs + pos_c % bs if chunk else pos_c
    ids = torch.randint(0, 1000, (num_decodes + chunk,))
    if not chunk:
        return StepInputs(False, ids, pos_d, slots_d, block_tables=table, context_lens=torch.full((num_decodes,), context, dtype=torch.int32)).to(dev)
    return StepInputs(True, ids, torch.cat([pos_d, pos_c]), torch.cat([slots_d, slots_c]), block_tables=table,
                      cu_seqlens_q=torch.tensor([num_decodes, num_decodes + chunk], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, chunk], dtype=torch.int32), max_seqlen_q=chunk, max_seqlen_k=chunk,
                      context_lens=torch.full((num_decodes,), context, dtype=torch.int32),
                      num_decode_rows=num_decodes).to(dev)


@torch.inference_mode()
def cost(model: str, args) -> dict:
    """A step's time run eagerly, replayed from a CUDA graph captured for exactly that shape (the most any graph
    scheme could save), replayed in pieces around eager attention (`PiecewiseGraphs`) and replayed from the
    full-step graph of its token bucket (`FullStepGraphs`, what the engine does when the step fits one)."""
    from nanovllm_edu.llm import LLM
    llm = LLM(model, attention_backend="triton")
    runner, rows = llm.model_runner, []
    pool = runner.forward_pass.graphs.pool
    for num_decodes in args.decode_rows:
        for chunk in args.chunks:
            step = mixed_step(runner, num_decodes, args.context, chunk)
            forward = lambda step=step: runner.model(step.input_ids, step.positions, step)
            forward()
            eager = time_ms(forward)
            cpu_start = time.perf_counter()
            for _ in range(10):
                forward()
            launch_ms = round(1e3 * (time.perf_counter() - cpu_start) / 10, 3)  # host time to launch one step
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                forward()
            replay = time_ms(graph.replay)
            del graph
            row = {"decode_rows": num_decodes, "chunk_tokens": chunk, "context": args.context,
                   "eager_ms": eager, "launch_ms": launch_ms, "graph_ms": replay}
            piecewise, full = runner.forward_pass.piecewise, runner.forward_pass.full
            for name, graphs, fits in (("piecewise", piecewise, chunk and piecewise.padded_size(num_decodes + chunk)),
                                       ("full", full, chunk and full.padded_size(step))):
                if not fits:
                    continue
                replay = lambda step=step, graphs=graphs: graphs.run(step)
                replay()
                row[f"{name}_ms"] = time_ms(replay)
                cpu_start = time.perf_counter()
                for _ in range(10):
                    replay()
                row[f"{name}_launch_ms"] = round(1e3 * (time.perf_counter() - cpu_start) / 10, 3)
                torch.cuda.synchronize()
            if "full_ms" in row:  # the full graph computes what the eager step does
                eager_hidden, full_hidden = forward(), full.run(step)
                row["full_max_abs_diff"] = (eager_hidden.float() - full_hidden.float()).abs().max().item()
            rows.append(row)
            report(args, rows[-1])
    return {"steps": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("online", "offline", "cost"))
    ap.add_argument("--json", required=True)
    ap.add_argument("--rates", type=float, nargs="+", default=[10.0, 40.0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=None, help="runs of each policy (default: online 1, offline 3)")
    ap.add_argument("--stall-prompt-len", type=int, default=4000)
    ap.add_argument("--caps", type=int, nargs="*", default=[256, 512, 1024, 2048, 0])
    ap.add_argument("--policies", nargs="+", default=None, choices=list(POLICIES),
                    help="default: online 'separate', 'mixed, pieces', 'mixed' (five policies overrun the suite's "
                         "5 minutes); offline 'separate, eager prefill', 'separate', 'mixed'")
    ap.add_argument("--sweep-rate", type=float, default=40.0)
    ap.add_argument("--decode-rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 512, 1024])
    ap.add_argument("--context", type=int, default=700)
    args = ap.parse_args()
    args.repeats = args.repeats or (3 if args.part == "offline" else 1)
    args.policies = args.policies or (["separate", "mixed, pieces", "mixed"] if args.part == "online"
                                      else ["separate, eager prefill", "separate", "mixed"])
    with tempfile.TemporaryDirectory() as tmp:
        model = random_weights_checkpoint("qwen3-0.6b", tmp)
        record = {"online": online, "offline": offline, "cost": cost}[args.part](model, args)
    record = {"part": args.part, "device": torch.cuda.get_device_name(), "argv": sys.argv[1:],
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())} | record
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
