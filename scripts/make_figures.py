"""Redraw every figure in figures/ that needs no GPU, each as PNG next to the JSON it was drawn from.

    python scripts/make_figures.py                  # all of them
    python scripts/make_figures.py trace_tiny_cpu   # only the named ones
    python scripts/make_figures.py logits_row       # one diagram of scripts/diagrams.py, by its name

- trace_tiny_cpu: runs the small-cache workload of notebook 11 on the shipped tiny model (CPU, greedy,
  deterministic) and writes figures/trace_tiny_cpu.json (the trace, without wall times) and .png.
- cuda_graphs: redraws figures/cuda_graphs.png from the committed H200 measurements in
  figures/cuda_graphs.json (re-measuring them needs a GPU: scripts/gpu_suite.sh).
- tp_scaling: draws figures/tp_scaling.png from the committed benchmark records of the one day tensor
  parallelism was measured, figures/runs/history/2026-11-29/bench_*.json (throughput against GPUs, with that
  day's TP=1; collectives per decode step; measuring them: scripts/gpu_suite.sh tp).
- diagrams: draws every diagram of scripts/diagrams.py into figures/diagrams/ (the course map, the architecture
  of docs/architecture.md, block tables, the KV cache's slots, the prefix-hash chain, a scheduler step, online
  softmax, the decode kernel's grid, async scheduling's timeline, a CUDA graph's buffers, TP's split); each is
  shown in the lesson that teaches the idea.
"""
import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # small shapes: threads only add noise on a shared machine

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded from elsewhere (tests do)
from diagrams import DIAGRAMS, PNG_METADATA, draw  # noqa: E402  scripts/diagrams.py, next to this file

FIGURES = Path(__file__).resolve().parents[1] / "figures"


def trace_tiny_cpu() -> list[Path]:
    """The engine trace of a deliberately small KV cache (preemptions included)."""
    from nanovllm_edu.course.figures import trace_tiny_cpu as run
    from nanovllm_edu.course.plots import plot_trace
    from nanovllm_edu.course.trace import save_trace

    records, settings = run()
    json_path, png_path = FIGURES / "trace_tiny_cpu.json", FIGURES / "trace_tiny_cpu.png"
    save_trace(records, json_path, **settings)
    fig = plot_trace(records, "tiny model on CPU: 8 requests, 12 KV blocks of 16 tokens, 64-token budget")
    fig.savefig(png_path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return [json_path, png_path]


def cuda_graphs() -> list[Path]:
    """Decode step time, eager versus CUDA graph, from the committed GPU measurements."""
    json_path, png_path = FIGURES / "cuda_graphs.json", FIGURES / "cuda_graphs.png"
    if not json_path.exists():
        print(f"skipped cuda_graphs: {json_path} is missing (measure it on a GPU with scripts/gpu_suite.sh)")
        return []
    data = json.loads(json_path.read_text())
    sizes = data["batch_sizes"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(sizes, data["eager_step_ms"], "o-", label="eager")
    ax.plot(sizes, data["graph_step_ms"], "o-", label="CUDA graph")
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms per decode step")
    ax.set_xscale("log", base=2)
    ax.set_title(f"Qwen3-0.6B decode step, {data['device']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return [png_path]


def tp_scaling() -> list[Path]:
    """Tensor-parallel scaling and the collectives' cost per step, from the committed GPU benchmark records."""
    from nanovllm_edu.bench.plots import load_records, plot_tp_scaling, scaling_runs

    records = load_records(FIGURES / "runs" / "history" / "2026-11-29")  # TP=2 and its same-day TP=1
    if len(scaling_runs(records)) < 2:
        print("skipped tp_scaling: needs GPU benchmark records with --tensor-parallel-size > 1 "
              "(scripts/gpu_suite.sh tp)")
        return []
    png_path = FIGURES / "tp_scaling.png"
    fig = plot_tp_scaling(records)
    fig.savefig(png_path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return [png_path]


def diagrams() -> list[Path]:
    """The course's diagrams, drawn by code (scripts/diagrams.py)."""
    return [draw(name, FIGURES / "diagrams") for name in DIAGRAMS]


MAKERS: dict[str, Callable[[], list[Path]]] = {"trace_tiny_cpu": trace_tiny_cpu, "cuda_graphs": cuda_graphs,
                                               "tp_scaling": tp_scaling, "diagrams": diagrams}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"figures to redraw (default: all): {', '.join(MAKERS)}, or one diagram's name")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MAKERS and n not in DIAGRAMS]
    if unknown:
        parser.error(f"unknown figure {unknown[0]!r}; known: {', '.join(MAKERS)} and the diagrams {', '.join(DIAGRAMS)}")
    for name in args.names or MAKERS:
        paths = MAKERS[name]() if name in MAKERS else [draw(name, FIGURES / "diagrams")]
        for path in paths:
            print(f"wrote {path.relative_to(FIGURES.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
