"""Redraw every figure in figures/ that needs no GPU, each as PNG next to the JSON it was drawn from.

    python scripts/make_figures.py                  # all of them
    python scripts/make_figures.py trace_tiny_cpu   # only the named ones

- trace_tiny_cpu: runs the small-cache workload of notebook 10 on the shipped tiny model (CPU, greedy,
  deterministic) and writes figures/trace_tiny_cpu.json (the trace, without wall times) and .png.
- cuda_graphs: redraws figures/cuda_graphs.png from the committed H200 measurements in
  figures/cuda_graphs.json (re-measuring them needs a GPU: scripts/gpu_suite.sh).
- tp_scaling: draws figures/tp_scaling.png from the committed benchmark records of the one day tensor
  parallelism was measured, figures/runs/history/2026-11-29/bench_*.json (throughput against GPUs, with that
  day's TP=1; collectives per decode step; measuring them: scripts/gpu_suite.sh tp).
- architecture: draws figures/diagrams/architecture.png, the map of docs/architecture.md: which module owns
  what (engine/, the runner's three parts, the layers below) and the numbered path of one decode step.
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
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

FIGURES = Path(__file__).resolve().parents[1] / "figures"
PNG_METADATA = {"Software": None}  # keep the PNG free of version strings that change between machines


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


def architecture() -> list[Path]:
    """Which module owns what, and the path of one decode step on the default path (drawn, no package import)."""
    png_path = FIGURES / "diagrams" / "architecture.png"
    fig, ax = plt.subplots(figsize=(12, 7))
    ax.set_xlim(0, 120)
    ax.set_ylim(0, 70)
    ax.axis("off")
    fig.subplots_adjust(0, 0, 1, 1)
    colors = {"top": "#dbe9f6", "engine": "#fdf1e1", "part": "#fff9c4", "low": "#e3f1df", "runner": "#fde3c4"}

    def box(x0, y0, x1, y1, title, lines=(), kind="engine", title_size=9, size=8):
        ax.add_patch(FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0,rounding_size=0.8",
                                    fc=colors[kind], ec="#555555", lw=1))
        ax.text((x0 + x1) / 2, y1 - 0.8, title, ha="center", va="top", fontsize=title_size, fontweight="bold")
        ax.text((x0 + x1) / 2, y1 - 2.9, "\n".join(lines), ha="center", va="top", fontsize=size,
                linespacing=1.3)

    def link(p0, p1, label="", dx=0.0, dy=0.0, ha="center"):  # a structural relation: grey, thin
        ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle="-|>", mutation_scale=10, color="#888888", lw=1))
        if label:
            ax.text((p0[0] + p1[0]) / 2 + dx, (p0[1] + p1[1]) / 2 + dy, label, ha=ha, va="center", fontsize=7.5,
                    color="#666666", style="italic")

    def step(num, p0, p1, label="", at=0.5, dx=1.2, dy=0.0, ha="left", rad=0.0):  # the path of one step
        ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle="-|>", mutation_scale=14, color="#c0392b", lw=1.8,
                                     connectionstyle=f"arc3,rad={rad}", shrinkA=0, shrinkB=0))
        x, y = p0[0] + at * (p1[0] - p0[0]), p0[1] + at * (p1[1] - p0[1])
        x, y = x + rad / 2 * (p1[1] - p0[1]), y - rad / 2 * (p1[0] - p0[0])  # on an arc: its middle
        marker(x, y, num)
        if label:
            ax.text(x + dx, y + dy, label, ha=ha, va="center", fontsize=8, color="#922b21",
                    bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85})

    def marker(x, y, num):
        ax.text(x, y, str(num), ha="center", va="center", fontsize=8, fontweight="bold", color="white",
                bbox={"boxstyle": "circle,pad=0.2", "fc": "#c0392b", "ec": "none"})

    ax.text(60, 68.8, "nanovllm_edu: which module owns what, and the path of one decode step (LLM, default path)",
            ha="center", va="center", fontsize=11, fontweight="bold")
    ax.text(60, 66.7, "(NN): the notebook that exports it.  Grey: how the classes relate.  Red: one step, in order.",
            ha="center", va="center", fontsize=8, style="italic", color="#666666")
    # top: the user-facing classes
    box(3, 58, 44, 65.3, "LLM  (llm.py, 15)", ["class LLM(AsyncLLMEngine): generate, chat",
                                               "build_runner: the runner's parts from the engine args"], "top")
    box(52, 58, 84, 65.3, "OnlineLLM  (online.py, 19)", ["class OnlineLLM(LLM): an engine loop in a",
                                                         "thread; submit, abort, streams"], "top")
    box(91, 58, 117, 65.3, "serve/  (21, 22)", ["app.py, protocol.py: an OpenAI-", "compatible server on OnlineLLM"],
        "top")
    link((52, 61.8), (44, 61.8), "subclass", dy=1.0)
    link((91, 61.8), (84, 61.8), "uses", dy=1.0)
    # engine/
    ax.add_patch(FancyBboxPatch((1.5, 18.5), 117, 37, boxstyle="round,pad=0,rounding_size=1", fc="#fbfaf6",
                                ec="#999999", lw=1, ls="--"))
    ax.text(2.5, 54.6, "engine/", fontsize=10, fontweight="bold", va="center")
    ax.text(117.5, 54.6, "engine/ never imports llm.py, online.py, serve/, course/, bench/, labs/", ha="right",
            va="center", fontsize=7.5, style="italic", color="#666666")
    box(3, 44.5, 44, 53, "EngineCore / LLMEngine / AsyncLLMEngine", ["engine_core.py (08), llm_engine.py (09),",
                                                                       "async_scheduling.py (12): generate, steps:",
                                                                       "launch + complete; record_outputs, fork"])
    box(3, 29.5, 24, 39, "Scheduler", ["scheduler.py (06): schedule,", "reserve + commit, abort;",
                                       "AsyncScheduler (12):", "can_schedule_ahead"], size=7.5)
    box(27, 29.5, 44, 39, "Sequence", ["sequence.py (03)", "tokens, status,", "block_table"], size=7.5)
    box(3, 20, 44, 26.5, "BlockManager / PrefixCachingBlockManager",
        ["block_manager.py (03), prefix_cache.py (05)"], size=7.5)
    box(53, 20, 117, 53, "ModelRunner  (model_runner.py, 07)",
        ["one device: the model (its shard), the paged KV cache, the Sampler",
         "launch: prepare_prefill | prepare_decode, ranks.run_step(execute)",
         "execute: device_inputs, forward, sample; token_ids: wait",
         "and parts it holds, chosen by build_runner (also features, 09):"], "runner")
    parts = [("carry", ["NoCarry (07) |", "AsyncCarry (12)", "async_scheduling.py", "mark_pending, fill_pending"]),
             ("ranks", ["LocalRanks (07) |", "TensorParallelRanks (15)", "tp_worker.py", "run_step, call, wait"]),
             ("forward", ["EagerForward (07) |", "CUDAGraphForward (13)", "cuda_graph.py",
                          "runner.forward_pass(step)"])]
    for i, (name, lines) in enumerate(parts):
        x0 = 55 + i * 20.5
        box(x0, 21.5, x0 + 19, 34, name, lines, "part", size=7.5)
    # below the engine
    ax.text(2.5, 17.2, "below the engine: layers/, kernels/, models/, utils/ never import engine/", fontsize=7.5,
            style="italic", color="#666666", va="center")
    box(3, 7, 44, 15.5, "StepInputs  (utils/step_inputs.py, 04)",
        ["one per step: input_ids, positions, slot_mapping,", "block_tables, cu_seqlens, context_lens;",
         "read by the attention backends"], "low", size=7.5)
    box(53, 7, 71, 15.5, "kernels/ (Triton)", ["store_kvcache (04)", "paged_attention,", "qk_norm_rope (11)",
                                                "sampling (14)"], "low", size=7.5)
    box(75, 7, 95, 15.5, "layers/", ["backends/: torch,", "triton, flash_attn (04, 11)", "Sampler (07)",
                                      "linear, norms, RoPE (02)"], "low", size=7.5)
    box(99, 7, 117, 15.5, "models/", ["registry: model_type", "-> Qwen3ForCausalLM", "qwen3.py (02)"], "low", size=7.5)
    link((40, 58), (62, 53), "build_runner", dx=2, dy=1.2, ha="left")
    # the path of one step
    step(1, (10, 58), (10, 53), "generate -> steps()")
    step(6, (25, 53), (25, 58), "results")
    step(2, (8, 44.5), (8, 39), "schedule")
    step(2, (8, 29.5), (8, 26.5), "blocks")
    step(6, (17, 44.5), (17, 39), "reserve |\ncommit")
    step(3, (44, 50.5), (53, 50.5), "launch", at=0.5, dx=0, dy=1.4, ha="center")
    step(6, (53, 47), (44, 47), "token_ids\n(wait)", at=0.5, dx=0, dy=-2.2, ha="center")
    step(3, (55, 24), (40, 15.5), "prepare", at=0.55, dx=1.4, dy=-0.3)
    step(4, (65.5 + 20.5, 34), (65.5 + 41, 34), "run_step -> execute", dx=0, dy=2.2, ha="center", rad=-0.35)
    step(4, (106.5, 21.5), (106.5, 15.5), "forward")
    step(4, (99, 11), (95, 11))
    step(4, (75, 11), (71, 11))
    step(5, (86, 21.5), (86, 15.5), "sample")
    # the legend: the path in words
    legend = ["LLMEngine.generate -> steps() (LLM is an AsyncLLMEngine)",
              "Scheduler.schedule: the batch; it asks the BlockManager for blocks",
              "LLMEngine.launch -> ModelRunner.launch: StepInputs, SamplingInputs; reserve",
              "ranks.run_step -> execute: the forward part -> Qwen3ForCausalLM -> attention backend -> kernels",
              "sample: the Sampler (layers/sampler.py) on the SamplingInputs, one token per row",
              "LLMEngine.complete: token_ids (wait) -> Scheduler.commit -> record_outputs -> results"]
    for i, text in enumerate(legend):
        x, y = 3 + (i // 3) * 57, 5 - (i % 3) * 1.9
        marker(x, y, i + 1)
        ax.text(x + 1.3, y, text, va="center", fontsize=7.5)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return [png_path]


MAKERS: dict[str, Callable[[], list[Path]]] = {"trace_tiny_cpu": trace_tiny_cpu, "cuda_graphs": cuda_graphs,
                                               "tp_scaling": tp_scaling, "architecture": architecture}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"figures to redraw (default: all): {', '.join(MAKERS)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MAKERS]
    if unknown:
        parser.error(f"unknown figure {unknown[0]!r}; known: {', '.join(MAKERS)}")
    for name in args.names or MAKERS:
        for path in MAKERS[name]():
            print(f"wrote {path.relative_to(FIGURES.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
