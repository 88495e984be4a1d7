"""The course's diagrams, drawn by code: each function draws one figure of an idea, with the code's names.

`python scripts/make_figures.py diagrams` redraws them all into figures/diagrams/ (`DIAGRAMS` says which lesson
shows each one; tests/test_00_diagrams.py checks that the lesson does and that a redraw gives the same picture).
They need matplotlib only, but for two: `logits_row` computes its eight numbers per stage with the package's own
processors (CPU arithmetic on one row, rounded to 2 decimals) so that the picture is what the code does, and
`decode_step_kernels` reads a committed record in figures/. No diagram draws a run's live numbers.
"""
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

PNG_METADATA = {"Software": None}  # keep the PNG free of version strings that change between machines
# one colour per role, the same in every diagram
BLUE, ORANGE, GREEN, PURPLE, RED, GREY = "#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#c0392b", "#e0e0e0"
OWNER_COLOURS = [BLUE, ORANGE, GREEN, PURPLE]
INK, NOTE = "#222222", "#666666"


def canvas(width: float, height: float, xmax: float, ymax: float, ymin: float = 0) -> tuple[Figure, plt.Axes]:
    """A blank drawing area in data units (0..xmax, ymin..ymax), no axes."""
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, xmax)
    ax.set_ylim(ymin, ymax)
    ax.axis("off")
    fig.subplots_adjust(0, 0, 1, 1)
    return fig, ax


def box(ax, x, y, w, h, text="", fc="white", ec="#555555", size=8, weight="normal", rounded=False, **kw):
    """A labelled rectangle with its lower-left corner at (x, y)."""
    style = "round,pad=0,rounding_size=0.3" if rounded else "square,pad=0"
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, fc=fc, ec=ec, lw=1, **kw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, fontweight=weight, color=INK)


def arrow(ax, p0, p1, color=INK, lw=1.2, rad=0.0, style="-|>", label="", size=7.5, dx=0.0, dy=0.0):
    ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle=style, mutation_scale=10, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=1, shrinkB=1))
    if label:
        ax.text((p0[0] + p1[0]) / 2 + dx, (p0[1] + p1[1]) / 2 + dy, label, ha="center", va="center", fontsize=size,
                color=color, style="italic")


def title(ax, x, y, text, sub=""):
    ax.text(x, y, text, ha="center", va="center", fontsize=11, fontweight="bold", color=INK)
    if sub:
        ax.annotate(sub, (x, y), xytext=(0, -15), textcoords="offset points", ha="center", va="center", fontsize=8,
                    style="italic", color=NOTE)


# --- docs/architecture.md and 08: which module owns what --------------------------------------------------

def architecture() -> Figure:
    """Which module owns what, and the path of one decode step on the default path."""
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
    box(3, 58, 44, 65.3, "LLM  (llm.py, 17)", ["class LLM(LLMEngine): make_runner picks the",
                                               "runner: build_runner, its parts from the engine args"], "top")
    box(52, 58, 84, 65.3, "OnlineLLM  (online.py, 21)", ["class OnlineLLM(LLM): an engine loop in a",
                                                         "thread; submit, abort, streams"], "top")
    box(91, 58, 117, 65.3, "serve/  (23)", ["app.py, protocol.py: an OpenAI-", "compatible server on OnlineLLM"],
        "top")
    link((52, 61.8), (44, 61.8), "subclass", dy=1.0)
    link((91, 61.8), (84, 61.8), "uses", dy=1.0)
    # engine/
    ax.add_patch(FancyBboxPatch((1.5, 18.5), 117, 37, boxstyle="round,pad=0,rounding_size=1", fc="#fbfaf6",
                                ec="#999999", lw=1, ls="--"))
    ax.text(2.5, 54.6, "engine/", fontsize=10, fontweight="bold", va="center")
    ax.text(117.5, 54.6, "engine/ never imports llm.py, online.py, serve/, course/, bench/, labs/", ha="right",
            va="center", fontsize=7.5, style="italic", color="#666666")
    box(3, 44.5, 44, 53, "LLMEngine", ["llm_engine.py (08, grown by 10 and 13), completion.py",
                                       "(10): generate, steps: launch + complete;",
                                       "record_outputs, fork_requests"])
    box(3, 29.5, 24, 39, "Scheduler", ["scheduler.py (06): schedule", "-> ScheduledBatch; reserve +",
                                       "commit, abort; grown by 13:", "can_schedule_ahead"], size=7.5)
    box(27, 29.5, 44, 39, "Sequence", ["sequence.py (03)", "tokens, status,", "block_table"], size=7.5)
    box(3, 20, 44, 26.5, "BlockManager (enable_prefix_caching)",
        ["block_manager.py (03, grown by 05)"], size=7.5)
    box(53, 20, 117, 53, "ModelRunner  (model_runner.py, 07)",
        ["one device: the model (its shard), the paged KV cache, the Sampler",
         "launch: prepare_step (a ScheduledBatch -> StepInputs), ranks.run_step(execute)",
         "execute: device_inputs, forward, sample; token_ids: wait",
         "its own methods, grown in place by 09, 10 and 13, and two parts (14, 17; build_runner):"], "runner")
    box(55, 21.5, 74, 34, "grown in place", ["prepare_step (07, 13)", "prepare_sample, sample,",
                                             "release (09)", "last_sampled (13)"], "runner", size=7.5)
    parts = [("ranks", ["LocalRanks (17) |", "TensorParallelRanks (17)", "tp_worker.py", "run_step, call, wait"]),
             ("forward", ["EagerForward (14) |", "CUDAGraphForward (14)", "cuda_graph.py",
                          "runner.forward_pass(step)"])]
    for i, (name, lines) in enumerate(parts, start=1):
        x0 = 55 + i * 20.5
        box(x0, 21.5, x0 + 19, 34, name, lines, "part", size=7.5)
    # below the engine
    ax.text(2.5, 17.2, "below the engine: layers/, kernels/, models/, utils/ never import engine/", fontsize=7.5,
            style="italic", color="#666666", va="center")
    box(3, 7, 44, 15.5, "StepInputs  (utils/step_inputs.py, 04)",
        ["one per step: input_ids, positions, slot_mapping,", "block_tables, cu_seqlens, context_lens;",
         "read by the attention backends"], "low", size=7.5)
    box(53, 7, 71, 15.5, "kernels/ (Triton)", ["store_kvcache (04)", "paged_attention,", "qk_norm_rope (12)",
                                                "sampling (15)"], "low", size=7.5)
    box(75, 7, 95, 15.5, "layers/", ["backends/: torch,", "triton, flash_attn (04, 12)", "Sampler (07)",
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
    legend = ["LLMEngine.generate -> steps() (LLM subclasses LLMEngine)",
              "Scheduler.schedule: a ScheduledBatch; it asks the BlockManager for blocks",
              "LLMEngine.launch -> ModelRunner.launch: prepare_step, prepare_sample; reserve",
              "ranks.run_step -> execute: the forward part -> Qwen3ForCausalLM -> attention backend -> kernels",
              "sample: the Sampler (layers/sampler.py) on the SamplingInputs, one token per row",
              "LLMEngine.complete: token_ids (wait) -> Scheduler.commit -> record_outputs -> results"]
    for i, text in enumerate(legend):
        x, y = 3 + (i // 3) * 57, 5 - (i % 3) * 1.9
        marker(x, y, i + 1)
        ax.text(x + 1.3, y, text, va="center", fontsize=7.5)
    return fig


# --- 00: the course map ------------------------------------------------------------------------------------

LESSONS = [  # (number, title, what it adds to the package), in the course's three parts
    ("make it work", [("00", "setup", "utils/device, assets"), ("01", "tokenizer", "config"),
                      ("02", "Qwen3 model", "layers/, models/"), ("03", "paged blocks", "sequence,\nblock_manager"),
                      ("04", "KV cache", "store kernel,\nstep_inputs,\nbackends"), ("05", "prefix\nhashing", "block_manager"),
                      ("06", "scheduler", "scheduler"), ("07", "model runner", "sampler,\nmodel_runner"),
                      ("08", "engine", "llm_engine"), ("09", "logit\nprocessors", "sampling_\nfeatures"),
                      ("10", "request\nfeatures", "completion"), ("11", "watching", "course/")]),
    ("make it fast", [("12", "Triton\nattention", "paged_attention,\nqk_norm_rope"),
                      ("13", "async\nscheduling", "grows scheduler,\nrunner, engine"),
                      ("14", "CUDA graphs", "cuda_graph"), ("15", "Triton\nsampler", "kernels/sampling"),
                      ("16", "decode GEMMs", "skinny_gemm,\npdl_chain"),
                      ("17", "tensor\nparallel", "layers/parallel,\ntp_worker, llm"), ("18", "benchmark", "bench/"),
                      ("19", "where the\nseconds go", "bench/plots"), ("20", "profiling a\ndecode step", "bench/profile")]),
    ("serve it", [("21", "serving: loop", "online"), ("22", "serving:\nlatency", "bench/online,\nbench/flags"),
                  ("23", "OpenAI server", "serve/")]),
]
APPENDICES = [("A1", "labs", "checkers per stage,\nstudent editions"), ("A2", "server CLI", "python -m\nnanovllm_edu.serve"),
              ("B1", "performance log", "every speed change\nand its record"), ("C1", "solutions", "an answer for every\nquestion Q<NN>.<k>"),
              ("D1", "benchmark CLI", "python -m\nnanovllm_edu.bench")]


def course_map() -> Figure:
    """Which lesson builds which part of the package, in the order the course builds them."""
    fig, ax = canvas(14, 5.4, 140, 62, ymin=8)
    title(ax, 70, 60.5, "The course: each lesson adds one part of nanovllm_edu",
          "lesson, title, and what it exports (modules of nanovllm_edu); every notebook runs on a CPU; 12-20 measure on an H200")
    colours = [GREEN, BLUE, ORANGE]
    for row, ((part, lessons), colour) in enumerate(zip(LESSONS, colours)):
        y = 44 - row * 14
        ax.text(1, y + 5, part, fontsize=10, fontweight="bold", va="center", rotation=90, ha="center")
        pitch = min(12.4, 135 / len(lessons))  # a row of twelve boxes fits the canvas as one of three does
        for i, (num, name, exports) in enumerate(lessons):
            x = 3.5 + i * pitch
            box(ax, x, y, pitch - 1, 10, "", fc=colour, rounded=True)
            ax.text(x + (pitch - 1) / 2, y + 7.2, f"{num}\n{name}", ha="center", va="center", fontsize=7.2,
                    fontweight="bold", linespacing=1.1)
            ax.text(x + (pitch - 1) / 2, y + 2.4, exports, ha="center", va="center", fontsize=6.2, color=INK,
                    linespacing=1.1)
            if i:
                arrow(ax, (x - 1.0, y + 5), (x, y + 5), color=NOTE, lw=0.8)
    for i, (num, name, what) in enumerate(APPENDICES):
        x = 44 + i * 19.2
        box(ax, x, 16, 18, 10, "", fc=GREY, rounded=True)
        ax.text(x + 9, 23.4, f"{num} {name}", ha="center", va="center", fontsize=7.6, fontweight="bold")
        ax.text(x + 9, 19.2, what, ha="center", va="center", fontsize=6.6, linespacing=1.2)
    ax.text(44, 28, "appendices", fontsize=9, fontweight="bold", va="center")
    ax.text(3.5, 12, "Order rule: a lesson imports only from lessons before it (tests/test_00_import_rules.py).\n"
                       "The engine generates text in 07-08 on the torch attention backend; 12-17 make the same "
                       "engine fast without changing its greedy output.", fontsize=8, va="top", color=NOTE,
            linespacing=1.4)
    return fig


# --- 01: bytes to unicode, then a BPE merge tree ------------------------------------------------------------

def bpe_merge_tree() -> Figure:
    """' café' to one token: its UTF-8 bytes, bytes_to_unicode's character for each, and Qwen3's merges in rank
    order as a tree (the ranks and ids are the tokenizer's: lesson 01's bpe() prints them)."""
    fig, ax = canvas(12, 5.3, 120, 53)
    title(ax, 60, 51, "Byte-level BPE: ' café' becomes one token",
          "text -> UTF-8 bytes -> one printable character per byte (bytes_to_unicode) -> Qwen3's merges, the "
          "lowest rank first")
    def cell(x, y, w, h, text, fc="white", size=8.5, weight="normal"):  # a box with a monospace label
        box(ax, x, y, w, h, fc=fc)
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, family="monospace",
                fontweight=weight, color=INK)

    xs = [36 + 9 * i + 3.7 for i in range(6)]  # the centres of the six byte columns
    chars = ["Ġ", "c", "a", "f", "Ã", "©"]
    for y, label in ((42, "text"), (36, "UTF-8 bytes"), (30, "bytes_to_unicode")):
        ax.text(1, y, label, fontsize=8, fontweight="bold", va="center")
    for x, ch in zip(xs[:4], ["space", "c", "a", "f"]):
        box(ax, x - 3.7, 40, 7.4, 4, ch, fc=GREY, size=8 if ch != "space" else 7)
    box(ax, xs[4] - 3.7, 40, 16.4, 4, "é", fc=GREY, size=8)
    for x, b in zip(xs, ["0x20", "0x63", "0x61", "0x66", "0xc3", "0xa9"]):
        cell(x - 3.7, 34, 7.4, 4, b, size=7.5)
    for x, ch in zip(xs, chars):
        cell(x - 3.7, 28, 7.4, 4, ch, fc=ORANGE if ch == "Ġ" else BLUE, size=9)
    ax.text(xs[4] + 4.5, 45.2, "one character, two bytes", ha="center", fontsize=7, color=NOTE, style="italic")
    # the merges: (left, right, rank); a merge of rank r makes token id 256 + r
    merges = [("Ġ", "c", 16), ("Ã", "©", 707), ("Ġc", "a", 1906), ("Ġca", "f", 28847), ("Ġcaf", "Ã©", 51694)]
    where = {ch: (x, 30.0) for x, ch in zip(xs, chars)}
    for step, (left, right, rank) in enumerate(merges, 1):
        (lx, ly), (rx, ry), y = where[left], where[right], 30 - 5.2 * step
        x = (lx + rx) / 2
        for cx, cy in ((lx, ly), (rx, ry)):
            ax.plot([cx, x], [cy - 2, y + 1.8], color=NOTE, lw=0.9)
        token = left + right
        width = 1.4 * len(token) + 3
        cell(x - width / 2, y - 1.8, width, 3.6, token, fc=GREEN, weight="bold" if step == len(merges) else "normal")
        where[token] = (x, y)
        ax.text(1, y, f"merge {step}: ({left}, {right})", fontsize=7.5, va="center", family="monospace")
        ax.text(20, y, f"rank {rank:>6,} -> id {256 + rank:>6,}", fontsize=7.5, va="center", color=NOTE,
                family="monospace")
    ax.text(where["ĠcafÃ©"][0] + 6.5, where["ĠcafÃ©"][1], "= token 51,950, decodes to ' café'", fontsize=8,
            va="center", fontweight="bold")
    ax.text(92, 44.5, "bytes_to_unicode", fontsize=8.5, fontweight="bold", va="top")
    ax.text(92, 41.5, "A printable byte keeps its own character\n(blue: 0x63 -> c, 0xc3 -> Ã, 0xa9 -> ©).\n"
                      "The 68 others (control bytes, the space,\na few Latin-1 ones) move, in order, to\n"
                      "U+0100 on (orange: 0x20 -> Ġ, U+0120).", fontsize=7.2, va="top", linespacing=1.35)
    ax.text(92, 20.5, "Each step merges the adjacent pair of\nlowest rank in model.merges; a merge\nof rank r "
                      "makes token id 256 + r.\nMerges ignore character borders:\nĠ + c (rank 16) comes before "
                      "é's\ntwo bytes join (rank 707).", fontsize=7.2, va="top", linespacing=1.35)
    return fig


# --- 02: one decoder layer ----------------------------------------------------------------------------------

def decoder_layer() -> Figure:
    """One Qwen3 decoder layer at Qwen3-0.6B's shapes: the packed qkv GEMM, QK-norm, RoPE, GQA attention, o_proj,
    the residual adds, and the packed gate/up GEMM with its SiLU gate (lesson 02 prints the config's shapes)."""
    fig, ax = canvas(12, 7.6, 120, 76)
    title(ax, 60, 74, "One decoder layer (Qwen3DecoderLayer) at Qwen3-0.6B's shapes",
          "config.json: hidden_size 1024, 16 query heads and 8 KV heads of head_dim 128, intermediate_size 3072; "
          "T tokens, one of 28 layers")
    yq, yk, yv, yc = 56, 50, 44, 50
    # the attention block
    box(ax, 1, 45, 9, 10, "hidden_states\n[T, 1024]", fc=GREY, size=7.5)
    arrow(ax, (10, yc), (13, yc))
    box(ax, 13, 45, 11, 10, "input_layernorm\nRMSNorm(1024)", fc=GREEN, size=7.2)
    arrow(ax, (24, yc), (27, yc))
    box(ax, 27, 41, 12, 18, "qkv_proj\n(QKVLinear)\n1024 -> 4096\n(q 2048, k 1024,\nv 1024)\none GEMM", fc=BLUE, size=7.2)
    for y, label in ((yq, "q [T, 16, 128]"), (yk, "k [T, 8, 128]")):
        arrow(ax, (39, y), (51, y), label=label, dy=1.5)
    arrow(ax, (39, yv), (75, yv), label="v [T, 8, 128]", dx=-12, dy=1.5)
    ax.text(55.5, 61, "QK-norm: RMSNorm(128)\nof every head", ha="center", fontsize=7, color=NOTE, linespacing=1.2)
    for y, name in ((yq, "q_norm"), (yk, "k_norm")):
        box(ax, 51, y - 2.2, 9, 4.4, name, fc=GREEN, size=7.5)
        arrow(ax, (60, y), (63, y))
        arrow(ax, (71, y), (75, y))
    box(ax, 63, 47.5, 8, 11, "RoPE\nrotary_emb\n(positions)", fc=PURPLE, size=7.2)
    box(ax, 75, 41, 13, 18, "attn\nGQA, causal:\n16 query heads\nread 8 KV heads\n-> [T, 16, 128]", fc=ORANGE,
        size=7.2)
    arrow(ax, (88, yc), (96, yc), label="[T, 2048]", dy=1.5)
    box(ax, 96, 45, 9, 10, "o_proj\n2048 -> 1024", fc=BLUE, size=7.2)
    arrow(ax, (105, yc), (107.6, yc))
    # GQA: query heads 2j and 2j + 1 read KV head j
    ax.text(61.5, 38, "16 query heads", ha="right", va="center", fontsize=7)
    ax.text(61.5, 34.5, "8 KV heads", ha="right", va="center", fontsize=7)
    for h in range(16):
        box(ax, 62.5 + h * 2.2, 37, 2.0, 2.0, fc=ORANGE)
    for j in range(8):
        box(ax, 62.5 + j * 4.4, 33.5, 4.2, 2.0, str(j), fc=BLUE, size=7)
        ax.plot([63.5 + j * 4.4, 62.5 + j * 4.4 + 2.1], [37, 35.5], color=NOTE, lw=0.6)
        ax.plot([65.7 + j * 4.4, 62.5 + j * 4.4 + 2.1], [37, 35.5], color=NOTE, lw=0.6)
    ax.text(51, 36.2, "query heads 2j and 2j+1 share\nKV head j: the KV cache holds\n8 heads per token, not 16",
            ha="right", fontsize=7, va="center", color=NOTE, linespacing=1.2)
    # the residual stream, and the (+) each norm does for the block before it
    for y in (yc, 17):
        ax.add_patch(plt.Circle((110, y), 2.2, fc="white", ec=INK, lw=1.2))
        ax.text(110, y, "+", ha="center", va="center", fontsize=12, fontweight="bold")
    ax.plot([5.5, 5.5, 110], [55, 65, 65], color=RED, lw=1.4)
    arrow(ax, (110, 65), (110, yc + 2.2), color=RED, lw=1.4)
    ax.text(57, 66.3, "residual [T, 1024] (the layer's input)", ha="center", fontsize=7.5, color=RED, style="italic")
    ax.plot([110, 110, 5.5, 5.5], [yc - 2.2, 30, 30, 17], color=INK, lw=1.2)
    ax.text(30, 31.3, "h = hidden_states + attention: [T, 1024]", ha="center", fontsize=7.5, style="italic")
    # the MLP block
    arrow(ax, (5.5, 17), (12, 17))
    box(ax, 12, 12, 15, 10, "post_attention_layernorm\nRMSNorm(1024)", fc=GREEN, size=7.2)
    arrow(ax, (27, 17), (31, 17))
    ax.add_patch(Rectangle((30, 10.5), 38.5, 13, fill=False, ec=NOTE, lw=0.9, ls="--"))
    ax.text(49, 25, "gate_up_proj (GateUp): one GEMM, then the gate", ha="center", fontsize=7, color=NOTE)
    box(ax, 31, 12, 11, 10, "GEMM\n1024 -> 6144", fc=BLUE, size=7.2)
    arrow(ax, (42, 17), (54, 17), label="[T, 6144]\n= [gate | up]", dy=2.6)
    box(ax, 54, 12, 13.5, 10, "silu(gate) * up\n(silu_and_mul)", fc=ORANGE, size=7.2)
    arrow(ax, (67.5, 17), (79, 17), label="[T, 3072]", dy=1.5)
    box(ax, 79, 12, 11, 10, "down_proj\n3072 -> 1024", fc=BLUE, size=7.2)
    arrow(ax, (90, 17), (107.6, 17), label="[T, 1024]", dy=1.5)
    ax.plot([5.5, 5.5, 110], [17, 5, 5], color=RED, lw=1.4)
    arrow(ax, (110, 5), (110, 17 - 2.2), color=RED, lw=1.4)
    ax.text(57, 6.3, "residual: h", ha="center", fontsize=7.5, color=RED, style="italic")
    arrow(ax, (112.2, 17), (119.5, 17))
    ax.text(115.5, 20.5, "next\nlayer", ha="center", fontsize=7, linespacing=1.1)
    ax.text(108, 27, "each + is done by the norm after it: norm(x, residual)", ha="right", va="center", fontsize=7,
            color=NOTE)
    return fig


# --- 03: block tables over the block pool ------------------------------------------------------------------

def block_tables() -> Figure:
    """Three sequences, their block tables, and the shared pool of KV blocks those tables point into."""
    block_size, num_blocks = 4, 12
    seqs = [("seq A", 10, [7, 2, 5]), ("seq B", 6, [0, 9]), ("seq C", 3, [4])]  # name, tokens, block_table
    fig, ax = canvas(12, 5.0, 120, 50)
    title(ax, 60, 48, "Paged KV blocks: each sequence's block_table maps its logical blocks to pool blocks",
          f"block_size = {block_size}: token i of a sequence lives in block block_table[i // block_size], at offset "
          "i % block_size")
    pool_xy = {b: (84 + (b % 4) * 8.6, 33 - (b // 4) * 8) for b in range(num_blocks)}
    owners = {b: (row, j) for row, (_, _, table) in enumerate(seqs) for j, b in enumerate(table)}
    for row, (name, num_tokens, table) in enumerate(seqs):
        y = 36 - row * 11
        ax.text(1, y + 1.6, name, fontsize=9, fontweight="bold", va="center")
        for t in range(len(table) * block_size):  # the tokens, grouped in logical blocks
            x = 8 + t * 3 + (t // block_size) * 0.8
            filled = t < num_tokens
            box(ax, x, y, 3, 3.2, str(t) if filled else "", fc=OWNER_COLOURS[row] if filled else "white", size=7,
                ls="-" if filled else ":")
        for j in range(len(table)):
            ax.text(8 + j * (block_size * 3 + 0.8) + 6, y - 1.1, f"logical block {j}", ha="center", fontsize=6.5,
                    color=NOTE, va="center")
        ax.text(53, y + 4.6, "block_table", fontsize=7.5, family="monospace", va="center")
        for j, block_id in enumerate(table):  # the table: one pool block id per logical block
            box(ax, 53 + j * 4, y, 4, 3.2, str(block_id), fc=OWNER_COLOURS[row], size=8, weight="bold")
    # one token's way: seq A's token 9 -> block_table[9 // 4 = 2] = 5 -> block 5, offset 9 % 4 = 1
    token9 = (8 + 9 * 3 + 2 * 0.8 + 1.5, 36)
    arrow(ax, token9, (53 + 2 * 4 + 2, 36), color=RED, lw=1.4, rad=0.35, label="9 // 4 = 2", dy=-3.2)
    bx, by = pool_xy[5]
    arrow(ax, (53 + 3 * 4, 37.6), (bx, by + 4), color=RED, lw=1.4, rad=0.1, label="block 5,\noffset 9 % 4 = 1",
          dx=-1, dy=2.5)
    ax.text(98, 42, "the block pool (BlockManager)", ha="center", fontsize=9, fontweight="bold")
    for b, (x, y) in pool_xy.items():
        if b in owners:
            row, j = owners[b]
            box(ax, x, y, 7.6, 6, f"block {b}\n{seqs[row][0]} [{j}]", fc=OWNER_COLOURS[row], size=6.8,
                weight="bold" if b == 5 else "normal")
        else:
            box(ax, x, y, 7.6, 6, f"block {b}\nfree", fc=GREY, size=6.8)
    ax.text(1, 7, "A sequence takes a new block only when its last one is full (seq A's block 5 has 2 free slots). "
                  "Any free block will do:\na sequence's blocks need not be adjacent, and no memory is reserved for "
                  f"tokens not yet generated. Free: {num_blocks - len(owners)} of {num_blocks} blocks.",
            fontsize=8, va="top", color=NOTE, linespacing=1.4)
    return fig


# --- 04: the KV-cache tensor and the slot formula ----------------------------------------------------------

def kv_cache_slots() -> Figure:
    """The one cache tensor, one layer's K view as a grid of slots, and how a token's slot is computed."""
    block_size, num_blocks = 4, 8
    fig, ax = canvas(12, 5.4, 120, 54)
    title(ax, 60, 52, "The KV cache: one tensor, and a slot for every token",
          "kv_cache[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]: K and V of every layer")
    # the tensor's first two axes
    for i, name in enumerate(["K", "V"]):
        for layer in range(3):
            x, y = 3 + i * 13 + layer * 1.2, 34 - layer * 1.2
            box(ax, x, y, 10, 7, f"{name}, layer {2 - layer}" if layer == 2 else "", fc=BLUE if i == 0 else ORANGE,
                size=7.5)
    ax.text(16, 28, "kv_cache[0] = K, kv_cache[1] = V;\nk_cache = kv_cache[0, layer] is what\nlayer `layer`'s "
                    "attention reads and writes", ha="center", va="top", fontsize=7.5, color=NOTE, linespacing=1.3)
    arrow(ax, (9, 41.5), (43.5, 42.5), color=NOTE, rad=-0.25)  # from the K stack, over the V stack
    ax.text(24, 45.2, "one layer's K", ha="center", fontsize=7, color=NOTE, style="italic")
    # the slot grid of one layer's K
    x0, y0, cw, ch = 44, 10, 6, 4
    ax.text(x0 + block_size * cw / 2, y0 + num_blocks * ch + 2.4, "k_cache viewed as [num_slots, kv_heads, head_dim]",
            ha="center", fontsize=8, fontweight="bold")
    for b in range(num_blocks):
        y = y0 + (num_blocks - 1 - b) * ch
        ax.text(x0 - 1, y + ch / 2, f"block {b}", ha="right", va="center", fontsize=7.5)
        for off in range(block_size):
            slot = b * block_size + off
            mark = slot == 21
            box(ax, x0 + off * cw, y, cw, ch, f"slot {slot}", fc=RED if mark else (BLUE if b in (7, 2, 5) else "white"),
                size=6.5, weight="bold" if mark else "normal")
    for off in range(block_size):
        ax.text(x0 + off * cw + cw / 2, y0 - 1.3, f"offset {off}", ha="center", fontsize=6.5, color=NOTE)
    ax.text(x0, y0 - 4, "blue: the blocks of the sequence on the right (block_table = [7, 2, 5]);\neach slot holds one "
            "token's keys for every KV head: [num_kv_heads, head_dim]", fontsize=7, color=NOTE, va="top",
            linespacing=1.3)
    # the formula, worked for one token
    fx = 78
    ax.text(fx, 44, "slot_mapping: where each new token is stored", fontsize=9, fontweight="bold")
    lines = ["block_table = [7, 2, 5], block_size = 4;",
             "the token at position p = 9:",
             "",
             "block  = block_table[p // block_size]",
             "       = block_table[2] = 5",
             "offset = p % block_size = 1",
             "slot   = block * block_size + offset",
             "       = 5 * 4 + 1 = 21",
             "",
             "The store kernel writes the step's new",
             "keys and values to k_cache[slot] and",
             "v_cache[slot]; slot -1 marks a padding",
             "row, never stored. Attention reads",
             "them back through the block table."]
    ax.text(fx, 41, "\n".join(lines), fontsize=7.6, va="top", family="monospace", linespacing=1.45)
    return fig


# --- 05: the prefix-hash chain -----------------------------------------------------------------------------

def prefix_hash_chain() -> Figure:
    """Two prompts sharing two full blocks: chained hashes, the hash -> block map, ref counts."""
    fig, ax = canvas(12, 5.2, 120, 52)
    title(ax, 60, 50, "Prefix caching: a full block is found by a hash of its tokens and of every block before it",
          "h_i = hash(h_(i-1), tokens of block i), h_(-1) = -1: equal hashes mean equal prefixes, not just equal blocks")
    rows = [("prompt 1", ["system", "prompt", "question 1"], [3, 8, 1]), ("prompt 2", ["system", "prompt", "question 2"],
                                                                         [3, 8, 6])]
    hashes = ["h0 = hash(-1, system)", "h1 = hash(h0, prompt)", ["h2 = hash(h1, question 1)", "h2' = hash(h1, question 2)"]]
    for r, (name, blocks, table) in enumerate(rows):
        y = 34 - r * 13
        ax.text(1, y + 2, name, fontsize=9, fontweight="bold", va="center")
        for j, tokens in enumerate(blocks):
            x = 10 + j * 19
            shared = j < 2
            box(ax, x, y, 16, 4, tokens, fc=GREEN if shared else OWNER_COLOURS[r], size=8)
            h = hashes[j] if shared else hashes[2][r]
            ax.text(x + 8, y - 1.6, h, ha="center", fontsize=6.8, family="monospace", color=INK)
            if j:
                arrow(ax, (x - 3, y + 2), (x, y + 2), color=NOTE, lw=0.8)
        ax.text(10, y - 4.4, f"block_table = {table}", fontsize=8, family="monospace", va="center")
    # the map and the pool
    ax.text(95, 42, "hash_to_block_id  ->  pool", ha="center", fontsize=9, fontweight="bold")
    pool = [(3, "h0", 2, GREEN), (8, "h1", 2, GREEN), (1, "h2", 1, BLUE), (6, "h2'", 1, ORANGE), (4, "h(old)", 0, GREY)]
    for i, (block_id, h, ref, colour) in enumerate(pool):
        y = 36 - i * 5.5
        ax.text(84, y + 2, h, ha="right", fontsize=8, family="monospace", va="center")
        arrow(ax, (85, y + 2), (89, y + 2), color=NOTE, lw=0.8)
        box(ax, 89, y, 14, 4, f"block {block_id}", fc=colour, size=8)
        ax.text(104, y + 2, f"ref_count {ref}", fontsize=7.5, va="center")
    ax.text(89, 11.5, "ref_count 0: free, yet still cached; a new\nprompt with h(old) revives it, unless the pool\n"
                      "handed it out first (then its hash is dropped)", fontsize=7, color=NOTE, va="top",
            linespacing=1.3)
    ax.text(1, 8, "Prompt 2 arrives after prompt 1: its first two hashes are in the map, so blocks 3 and 8 are shared "
                  "(ref_count 2) and its\nnum_cached_tokens is 2 blocks' worth; only its third block is computed. "
                  "Only full blocks are hashed: a partial block can still change.", fontsize=8, va="top", color=NOTE,
            linespacing=1.4)
    return fig


# --- 06: one scheduler step --------------------------------------------------------------------------------

def scheduler_step() -> Figure:
    """The queues, the token budget, a chunked prefill step, and a decode step that must preempt."""
    fig, ax = canvas(12, 6.4, 120, 64)
    title(ax, 60, 62, "The scheduler: one step at a time, prefill or decode",
          "max_num_batched_tokens = 64 (the token budget), max_num_seqs = 4, blocks of 16 tokens")
    # panel 1: a prefill step
    ax.text(2, 54, "a prefill step", fontsize=10, fontweight="bold")
    ax.text(2, 50.5, "waiting", fontsize=8, va="center")
    for i, (name, n) in enumerate([("r3: 40", BLUE), ("r4: 50", ORANGE), ("r5: 20", GREEN)]):
        box(ax, 12 + i * 10, 48.8, 9, 3.4, name, fc=n, size=7.5)
    ax.text(2, 44.5, "budget", fontsize=8, va="center")
    box(ax, 12, 43, 40 * 0.9, 3.4, "r3: all 40 tokens", fc=BLUE, size=7.5)
    box(ax, 12 + 36, 43, 24 * 0.9, 3.4, "r4: a chunk of 24", fc=ORANGE, size=7.5)
    ax.add_patch(Rectangle((12, 43), 64 * 0.9, 3.4, fill=False, ec=RED, lw=1.6))
    ax.text(12 + 64 * 0.9 + 1, 44.7, "64", color=RED, fontsize=8, va="center", fontweight="bold")
    ax.text(2, 39, "Waiting prompts are admitted in order while blocks, seats and budget last. The last one is cut "
                   "to a chunk (r4: 24 of 50;\nthe rest next step); r5 waits. A prefill step holds no decodes (the "
                   "separate-steps policy).", fontsize=7.5, color=NOTE, va="top", linespacing=1.35)
    # panel 2: a decode step that preempts
    ax.text(2, 29, "a decode step that preempts", fontsize=10, fontweight="bold")
    ax.text(2, 25, "running", fontsize=8, va="center")
    states = [("r0", "16/16: needs a block", BLUE), ("r1", "9/16", ORANGE), ("r2", "16/16: needs a block", GREEN),
              ("r3", "newest", PURPLE)]
    for i, (name, note, colour) in enumerate(states):
        x = 12 + i * 19
        box(ax, x, 23.3, 17, 3.4, f"{name}  ({note})", fc=colour, size=7)
    ax.text(2, 19, "pool", fontsize=8, va="center")
    box(ax, 12, 17.3, 17, 3.4, "1 free block", fc=GREY, size=7.5)
    arrow(ax, (20.5, 20.7), (20.5, 23.3), color=INK, lw=1, label="r0 takes it", dx=5)
    arrow(ax, (12 + 3 * 19 + 8.5, 23.3), (94, 15), color=RED, lw=1.4, rad=-0.2, label="preempt the newest:\nits "
          "blocks are freed", dx=6, dy=2)
    box(ax, 88, 11.5, 22, 3.4, "waiting: r3 (front)", fc=PURPLE, size=7.5)
    ax.text(59.5, 21.5, "r2 takes one\nof r3's blocks", ha="center", va="top", fontsize=7, style="italic")
    ax.text(2, 13, "Every running request decodes one token. A request whose last block is full needs a new one; "
                   "when the pool is empty the\nscheduler preempts from the back of running (the newest request, "
                   "least work to lose): its blocks return to the pool,\nand it goes back to the front of waiting, to "
                   "be recomputed later (prefix caching may keep its full blocks).", fontsize=7.5, color=NOTE,
            va="top", linespacing=1.35)
    return fig



def mixed_step() -> Figure:
    """One mixed step: the decodes first, then prefill chunks under the token budget; the rows the runner sees."""
    budget, cap, x0, k = 48, 16, 16, 2.0  # tokens, chunk_cap, where token 0 is drawn, units per token
    decodes = ["r0", "r1", "r2", "r3"]
    chunks = [("r4", 16, 32, 80, "running, part-way"), ("r5", 16, 0, 40, "new, from waiting"),
              ("r6", 12, 0, 12, "new, from waiting")]  # name, tokens this step, computed before, prompt length, whence
    n = len(decodes)
    fig, ax = canvas(12, 6.2, 120, 66, ymin=4)
    title(ax, 60, 64, "One mixed step: decodes first, then prefill chunks under the token budget",
          f"mixed_steps = True (as in vLLM V1): max_num_batched_tokens = {budget}, long_prefill_token_threshold = "
          f"{cap} (the scheduler's chunk_cap)")
    # panel 1: the budget, filled left to right
    ax.text(2, 56, "the token budget (_schedule_mixed)", fontsize=10, fontweight="bold")
    ax.text(2, 46.2, "budget", fontsize=8, va="center")
    for i, name in enumerate(decodes):
        box(ax, x0 + i * k, 44.5, k, 3.4, name, fc=GREEN, size=6.3)
    ax.text(x0 + n * k / 2, 49.2, "decode rows:\n1 token each", ha="center", va="bottom", fontsize=7,
            linespacing=1.2)
    start = n
    for name, num, done, length, whence in chunks:
        x = x0 + start * k
        box(ax, x, 44.5, num * k, 3.4, f"{name} ({whence}): {num}", fc=BLUE, size=7)
        ends = ": it completes" if done + num == length else ""
        ax.text(x + num * k / 2, 42.8, f"prompt tokens {done}-{done + num - 1} of {length}{ends}", ha="center",
                va="top", fontsize=6.8, color=NOTE)
        capped = num == cap
        arrow(ax, (x + 0.3, 49.3), (x + num * k - 0.3, 49.3), color=INK if capped else RED, lw=0.9,
              style="<|-|>", label=f"capped: chunk_cap = {cap}" if capped else f"what the budget has left: {num}",
              dy=1.3, size=7)
        start += num
    ax.add_patch(Rectangle((x0, 44.5), budget * k, 3.4, fill=False, ec=RED, lw=1.6))
    ax.text(x0 + budget * k + 1, 46.2, str(budget), color=RED, fontsize=8, va="center", fontweight="bold")
    ax.text(x0 + budget * k, 53.3, "budget end: max_num_batched_tokens", ha="right", va="center", fontsize=7.5,
            color=RED, fontweight="bold")
    ax.text(2, 39, f"_schedule_decode first: every running sequence with one token left to compute, 1 token each "
                   f"({n} of the {budget}). Then _schedule_chunks fills the rest:\nprompts already part-way first "
                   f"(r4), then new ones from waiting (r5, r6), each at most chunk_cap tokens, while blocks, "
                   f"max_num_seqs and budget last; r7 waits.", fontsize=7.5, color=NOTE, va="top", linespacing=1.35)
    # panel 2: the rows the model runner sees
    ax.text(2, 30, "the step's rows, as the model runner sees them (prepare_mixed)", fontsize=10, fontweight="bold")
    ax.text(2, 20.7, "input_ids\nrows", fontsize=8, va="center", linespacing=1.2)
    for i in range(n):
        box(ax, x0 + i * k, 19, k, 3.4, str(i), fc=GREEN, size=6.3)
    row = n
    for name, num, done, length, _ in chunks:
        for j in range(num):  # one row per token
            ax.add_patch(Rectangle((x0 + (row + j) * k, 19), k, 3.4, fc=BLUE, ec="#7fa9c6", lw=0.5))
        box(ax, x0 + row * k, 19, num * k, 3.4, fc="none")
        ax.text(x0 + (row + num / 2) * k, 20.7, f"{name}: rows {row}-{row + num - 1}", ha="center", va="center",
                fontsize=7, color=INK, bbox={"boxstyle": "square,pad=0.15", "fc": BLUE, "ec": "none"})
        row += num
    # the rows that sample: logits_indices
    samples = list(range(n)) + [row - 1]  # the decode rows and the last row of r6, whose prompt completes here
    ax.plot([x0 + (r + 0.5) * k for r in samples], [23.4] * len(samples), "v", color=RED, ms=5)
    ax.text(x0 + n * k / 2, 24.6, "samples", ha="center", va="bottom", fontsize=7, color=RED)
    ax.text(x0 + (row - 0.5) * k, 24.6, "samples", ha="center", va="bottom", fontsize=7, color=RED)
    # the split between the two kernels
    split = x0 + n * k
    ax.plot([split, split], [12.5, 27.5], color=INK, lw=1.3, ls="--")
    ax.text(split + 0.8, 26.6, f"num_decode_rows = {n}", fontsize=7.5, va="center", fontweight="bold")
    ax.text(split - 0.8, 17.6, "decode kernel\n(context_lens,\nblock_tables[:4])", ha="right", va="top",
            fontsize=7.5, linespacing=1.3)
    ax.text(split + 0.8, 17.6, "varlen prefill kernel (cu_seqlens_q/k from the first chunk row, block_tables[4:])",
            va="top", fontsize=7.5)
    ax.text(split + 0.8, 15.0, "cu_seqlens_q = [0, 16, 32, 44],  cu_seqlens_k = [0, 48, 64, 76]", va="top",
            fontsize=7, family="monospace")
    ax.text(2, 9.5, f"logits_indices = {samples}: rows 0-3 (the decodes) and the last row of each prompt that "
                    "completes in this step (r6, all 12 of 12); r4 and r5 sample\nnothing until their last chunk. "
                    "Every layer stores the step's keys and values, runs both kernels on their rows, and "
                    "concatenates the outputs in row order.", fontsize=7.5, color=NOTE, va="top", linespacing=1.35)
    return fig

# --- 07: a chunked prefill step, row by row ------------------------------------------------------------------

def chunked_batch() -> Figure:
    """One prefill step of notebook 07's toy: A's whole prompt and the first chunk of B's, as the rows of StepInputs."""
    bs, x0, k = 16, 12, 4.2  # block size; where row 0 is drawn; units per row
    a_ids, b_ids = list(range(100, 105)), list(range(200, 219))  # A: 5 prompt tokens; B: 19 of its 30
    a_table, b_table = [0], [1, 2]
    rows = [("A", t, p, a_table[p // bs] * bs + p % bs) for p, t in enumerate(a_ids)]
    rows += [("B", t, p, b_table[p // bs] * bs + p % bs) for p, t in enumerate(b_ids)]
    fig, ax = canvas(13.5, 5.0, 12 + 24 * 4.2 + 14, 56, ymin=6)
    title(ax, 58, 54, "One prefill step, row by row: what prepare_prefill builds",
          "budget 24 tokens (max_num_batched_tokens): A's 5-token prompt whole, B's 30-token prompt chunked "
          "(19 now, 11 next step); block size 16, A's blocks [0], B's [1, 2]")
    colour = {"A": BLUE, "B": ORANGE}
    for y, label, field in ((40, "input_ids", 1), (34, "positions", 2), (28, "slot_mapping", 3)):
        ax.text(x0 - 1, y + 1.6, label, ha="right", va="center", fontsize=8, family="monospace")
        for i, row in enumerate(rows):
            box(ax, x0 + i * k, y, k, 3.2, str(row[field]), fc=colour[row[0]], size=6.5)
    for i in range(len(rows)):
        ax.text(x0 + (i + 0.5) * k, 44.2, str(i), ha="center", va="bottom", fontsize=6, color=NOTE)
    ax.text(x0 - 1, 44.9, "row", ha="right", va="center", fontsize=7, color=NOTE)
    # which sequence each row belongs to: cu_seqlens_q
    for name, lo, hi in (("A: rows 0-4, its whole prompt", 0, 5), ("B: rows 5-23, its first chunk (positions 0-18)", 5, 24)):
        arrow(ax, (x0 + lo * k + 0.3, 48.5), (x0 + hi * k - 0.3, 48.5), style="<|-|>", lw=0.9)
        ax.text(x0 + (lo + hi) / 2 * k, 49.6, name, ha="center", va="bottom", fontsize=7.5)
    for cut in (0, 5, 24):
        ax.plot([x0 + cut * k] * 2, [26.5, 47.5], color=RED, lw=1.2, ls="--")
        ax.text(x0 + cut * k, 25.6, str(cut), ha="center", va="top", fontsize=7.5, color=RED, fontweight="bold")
    ax.text(x0 - 1, 24.9, "cu_seqlens_q", ha="right", va="center", fontsize=8, family="monospace", color=RED)
    ax.text(x0 + 24 * k + 2.5, 24.9, "= [0, 5, 24]", va="center", fontsize=7.5, color=RED)
    # a slot: block_table[position // block_size] * block_size + position % block_size
    ax.text(x0 + 16.5 * k, 21.5, "row 21: B's position 16 starts its second block: slot = 2 * 16 + 0 = 32",
            ha="center", va="center", fontsize=7.2, color=NOTE)
    arrow(ax, (x0 + 21.5 * k, 22.6), (x0 + 21.5 * k, 27.8), color=NOTE, lw=0.8)
    # the one row that gets logits
    arrow(ax, (x0 + 4.5 * k, 27.8), (x0 + 4.5 * k, 17.5), color=RED, lw=1.4)
    box(ax, x0 + 0.5 * k, 12.5, 8 * k, 5, "logits row 0 = hidden row 4 (logits_indices = [4])\n"
        "-> the sampler -> A's first completion token", fc=GREEN, size=7.5)
    ax.text(x0 + 10 * k, 17.5, "B's rows get no logits: its prompt is not complete (row 23 is position 18 of 30).\n"
            "Next step: B's 11 remaining tokens, positions 19-29, cu_seqlens_q = [0, 11], cu_seqlens_k = [0, 30]\n"
            "(they attend to the 19 keys already in the cache, read through B's block table); logits_indices = [10].",
            va="top", fontsize=7.5, color=NOTE, linespacing=1.4)
    return fig

# --- 11: online softmax and the decode kernel's grid -------------------------------------------------------

def online_softmax() -> Figure:
    """One row of scores read in tiles: the running max m and sum l, rescaled whenever m grows."""
    import numpy as np

    scores = np.array([0.5, 1.0, 0.2, 0.8, 2.6, 1.9, 0.1, 2.2, 3.4, 0.3, 1.1, 2.0])  # one query's scores, 3 tiles of 4
    tile = 4
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.25, 1]})
    ax = axes[0]
    ax.bar(range(len(scores)), scores, color=[OWNER_COLOURS[i // tile] for i in range(len(scores))], ec="#555555")
    m, l, ms, ls = -np.inf, 0.0, [], []
    for t in range(len(scores) // tile):
        s = scores[t * tile:(t + 1) * tile]
        m_new = max(m, s.max())
        l = l * np.exp(m - m_new) + np.exp(s - m_new).sum()  # the old sum, rescaled to the new max, plus this tile
        m = m_new
        ms.append(m)
        ls.append(l)
        ax.hlines(m, t * tile - 0.4, t * tile + tile - 0.6, color=RED, lw=2)
        ax.text(t * tile + 1.5, m + 0.15, f"m = {m:.1f}", ha="center", color=RED, fontsize=8)
        ax.text(t * tile + 1.5, -0.45, f"tile {t}", ha="center", fontsize=8)
    ax.set_ylim(-0.7, 4.2)
    ax.set_xticks(range(len(scores)))
    ax.set_xlabel("key position")
    ax.set_ylabel("score q·k / sqrt(d)")
    ax.set_title("the running max m after each tile", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    ax = axes[1]
    ax.axis("off")
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10)
    ax.text(0, 9.6, "per tile, for each query row:", fontsize=9, fontweight="bold")
    ax.text(0, 8.9, "m' = max(m, max(s_tile))\nl  = l * exp(m - m') + sum(exp(s_tile - m'))\n"
                    "acc = acc * exp(m - m') + exp(s_tile - m') @ V_tile\nat the end: out = acc / l",
            fontsize=8.5, family="monospace", va="top", linespacing=1.5)
    rows = ["tile    m      l (the running sum)"]
    for t, (m_t, l_t) in enumerate(zip(ms, ls)):
        rows.append(f"{t:>4}  {m_t:5.2f}  {l_t:8.4f}")
    full = np.exp(scores - scores.max()).sum()
    rows += ["", f"one pass over the whole row: l = {full:.4f}", "(the same: no tile needs the others' scores)"]
    ax.text(0, 5.4, "\n".join(rows), fontsize=8.5, family="monospace", va="top", linespacing=1.45)
    ax.text(0, 0.3, "exp(m - m') < 1 shrinks what was summed against the old max;\nthe kernels use exp2 with log2(e) "
                    "folded into the scale.", fontsize=7.5, color=NOTE)
    fig.suptitle("Online softmax: attention over a long row in tiles, never holding the whole row", fontsize=11,
                 fontweight="bold")
    fig.tight_layout()
    return fig


def decode_grid() -> Figure:
    """The flash-decoding grid: programs (kv_head, sequence, split), GQA rows per program, then the reduce."""
    fig, ax = canvas(12, 5.8, 120, 58, ymin=1)
    title(ax, 60, 56, "The decode kernel's grid: one program per (KV head, sequence, split), then a reduce",
          "Qwen3-0.6B: 16 query heads, 8 KV heads: GROUP = 2 query heads share each KV head")
    # one sequence's context split in parts
    ax.text(2, 44, "sequence b, KV head h:\nits context (block_table's tiles)", fontsize=8, va="center")
    splits, tiles_per_split = 3, 4
    for sp in range(splits):
        for t in range(tiles_per_split):
            x = 24 + (sp * tiles_per_split + t) * 5.2 + sp * 1.5
            last = sp == splits - 1 and t == tiles_per_split - 1
            box(ax, x, 42, 5.2, 4, "" if not last else "...", fc=OWNER_COLOURS[sp] if not last else "white", size=7,
                ls=":" if last else "-")
        xs = 24 + sp * (tiles_per_split * 5.2 + 1.5)
        ax.text(xs + tiles_per_split * 2.6, 48, f"split {sp}", ha="center", fontsize=8, fontweight="bold")
    ax.text(24, 39.5, "BLOCK_N keys per tile; a split covers tiles_per_split = ceil(tiles / num_splits) of them; the "
                      "last split may be short", fontsize=7, color=NOTE)
    # the programs
    for sp in range(splits):
        x = 24 + sp * (tiles_per_split * 5.2 + 1.5)
        box(ax, x, 24, tiles_per_split * 5.2, 11, "", fc=OWNER_COLOURS[sp], rounded=True)
        ax.text(x + tiles_per_split * 2.6, 33.2, f"program (h, b, {sp})", ha="center", fontsize=8, fontweight="bold")
        ax.text(x + tiles_per_split * 2.6, 29.2, "rows: query heads 2h, 2h+1\n(padded to BLOCK_G = 16)\nreads each "
                "K/V tile once", ha="center", va="center", fontsize=7, linespacing=1.3)
        arrow(ax, (x + tiles_per_split * 2.6, 42), (x + tiles_per_split * 2.6, 35), color=NOTE, lw=0.8)
        box(ax, x + 2, 15, tiles_per_split * 5.2 - 4, 4.5, "m, l, acc (float32)", fc="white", size=7)
        arrow(ax, (x + tiles_per_split * 2.6, 24), (x + tiles_per_split * 2.6, 19.5), color=NOTE, lw=0.8)
        arrow(ax, (x + tiles_per_split * 2.6, 15), (60, 10.5), color=RED, lw=1)
    box(ax, 47, 6, 26, 4.5, "reduce: one program per (b, query head)", fc=GREY, size=7.5, weight="bold")
    ax.text(60, 3.2, "out = sum_s acc_s * exp(m_s - m) / sum_s l_s * exp(m_s - m),  m = max_s m_s", fontsize=7.5,
            family="monospace", va="center", ha="center")
    ax.text(2, 30, "grid =\n(num_kv_heads,\n batch,\n num_splits)", fontsize=8.5, family="monospace", va="center",
            linespacing=1.4)
    ax.text(2, 18, "num_splits from shapes only\n(batch, KV heads, the block\ntable's width): CUDA-graph\nsafe. "
                   "Small batches get more\nsplits to fill 132 SMs.", fontsize=7, color=NOTE, va="center",
            linespacing=1.3)
    return fig


# --- 12: async scheduling's timeline -----------------------------------------------------------------------

def async_timeline() -> Figure:
    """CPU and GPU lanes for three decode steps, one after another and overlapped."""
    fig, ax = canvas(12, 5.0, 120, 50)
    title(ax, 60, 48, "Async scheduling: plan step n+1 on the CPU while step n runs on the GPU",
          "S: schedule + prepare inputs (CPU)   F: forward + sample (GPU)   C: commit the sampled ids (CPU); "
          "durations illustrative")
    cpu_s, gpu_f, cpu_c = 3.0, 8.0, 1.5
    lanes = [("synchronous", 35), ("async", 14)]
    for name, y in lanes:
        ax.text(2, y + 6.5, name, fontsize=10, fontweight="bold")
        ax.text(2, y + 3.2, "CPU", fontsize=8, va="center")
        ax.text(2, y - 0.8, "GPU", fontsize=8, va="center")
        ax.hlines([y + 1.4], 10, 116, color="#dddddd", lw=0.8)
    # synchronous: S F C one after another; the GPU waits for the CPU
    t = 10.0
    for n in range(3):
        box(ax, t, 36.5, cpu_s * 1.6, 3.4, f"S{n}", fc=BLUE, size=7.5)
        t += cpu_s * 1.6
        box(ax, t, 32.5, gpu_f * 1.6, 3.4, f"F{n}", fc=ORANGE, size=7.5)
        t += gpu_f * 1.6
        box(ax, t, 36.5, cpu_c * 1.6, 3.4, f"C{n}", fc=GREEN, size=7.5)
        t += cpu_c * 1.6
        if n < 2:
            ax.add_patch(Rectangle((t - cpu_c * 1.6, 32.5), (cpu_c + cpu_s) * 1.6, 3.4, fc="white", ec=RED, ls=":",
                                   lw=1))
    sync_end = t
    ax.text(sync_end + 1, 34.2, "3 steps", fontsize=7.5, va="center")
    # async: the CPU plans S(n+1) while F(n) runs, then waits for F(n) and commits it (C(n)); the GPU runs back to back
    k = 1.6
    f_start = [10 + cpu_s * k + n * gpu_f * k for n in range(3)]
    cpu = [("S0", 10, BLUE), ("S1", f_start[0], BLUE)]
    for n in range(3):
        cpu.append((f"C{n}", f_start[n] + gpu_f * k, GREEN))
        if n + 2 < 3:
            cpu.append((f"S{n + 2}", f_start[n] + gpu_f * k + cpu_c * k, BLUE))
    for name, t, colour in cpu:
        box(ax, t, 15.5, (cpu_s if name[0] == "S" else cpu_c) * k, 3.4, name, fc=colour, size=7.5)
    for n in range(3):
        box(ax, f_start[n], 11.5, gpu_f * k, 3.4, f"F{n}", fc=ORANGE, size=7.5)
    t_gpu = f_start[-1] + gpu_f * k
    ax.text(t_gpu + cpu_c * 1.6 + 1, 13.2, "3 steps", fontsize=7.5, va="center")
    ax.text(sync_end - 20, 29.5, "red dotted: the GPU idles while the CPU commits and schedules", fontsize=7,
            color=RED)
    ax.text(2, 7.5, "S(n+1) is planned before F(n)'s tokens exist: each sequence gets a placeholder (PENDING_TOKEN) "
                    "that reserve appends and commit fills;\nthe step's input ids for those rows are read on the GPU "
                    "from F(n)'s output, so the host never waits for them. Finish rules that need an id (EOS, "
                    "stop)\nrun in commit, so a sequence may be planned one step past its end: that step's token is "
                    "dropped.", fontsize=7.5, va="top", color=NOTE, linespacing=1.4)
    return fig


# --- 13: a CUDA graph's static buffers and shared pool -----------------------------------------------------

def cuda_graph_buffers() -> Figure:
    """Static input buffers of max_bs rows, one graph per batch size, a 5-row step padded to the 8-row graph."""
    fig, ax = canvas(12, 5.6, 120, 56)
    title(ax, 60, 54, "CUDA graphs: replay a captured decode step on fixed buffers",
          "capture_sizes: 1, 2, 4, 8, then every 16 up to max_num_seqs (at most 512); captured largest first, sharing one "
          "memory pool")
    names = ["input_ids", "positions", "slot_mapping", "context_lens", "block_tables", "outputs"]
    rows, used, padded = 10, 5, 8
    ax.text(3, 45, "static buffers (max_bs rows; the same addresses at every replay)", fontsize=8.5, fontweight="bold")
    for c, name in enumerate(names):
        x = 3 + c * 9.5
        ax.text(x + 4.25, 42.5, name, ha="center", fontsize=7, family="monospace")
        for r in range(rows):
            y = 38 - r * 3
            if r < used:
                fc, text = BLUE, "step"
            elif r < padded:
                fc, text = GREY, {"slot_mapping": "-1", "context_lens": "0"}.get(name, "stale")
            else:
                fc, text = "white", ""
            box(ax, x, y, 8.5, 2.6, text, fc=fc, size=6.3)
    ax.text(3, 5.5, "A step of 5 decode rows: its inputs are copied into rows 0-4 (blue), the 8-row graph is replayed."
                    " Rows 5-7 (grey) are padding:\nslot_mapping -1 stores nothing and context_lens 0 attends to "
                    "nothing; their other inputs are stale, and their outputs are ignored.", fontsize=7.5, color=NOTE,
            va="top", linespacing=1.4)
    # graphs by batch size
    gx = 69
    ax.text(gx, 45, "one graph per batch size", fontsize=8.5, fontweight="bold")
    for i, bs in enumerate([1, 2, 4, 8, 16]):
        y = 38 - i * 5.2
        chosen = bs == padded
        box(ax, gx, y, 14, 3.8, f"graph bs={bs}", fc=ORANGE if chosen else "white", size=7.5,
            weight="bold" if chosen else "normal", rounded=True)
        ax.text(gx + 15, y + 1.9, "reads row 0" if bs == 1 else f"reads rows 0-{bs - 1}", fontsize=7, va="center",
                color=NOTE)
    ax.text(gx, 11.2, "...  up to 512", fontsize=7.5, color=NOTE)
    arrow(ax, (59.3, 27.3), (gx, 24.3), color=RED, lw=1.3)
    ax.text(64.2, 31.5, "5 rows ->\npadded_size = 8", ha="center", va="center", fontsize=7, color=RED, style="italic",
            linespacing=1.3)
    box(ax, 99, 14, 20, 26, "", fc="#f4f1fa", rounded=True)
    ax.text(109, 37.5, "shared memory pool", ha="center", fontsize=8, fontweight="bold")
    ax.text(109, 27, "the intermediate tensors\nof every graph live here;\ncaptured largest first,\nthe others reuse "
                     "its\nmemory: graphs never\nrun at the same time", ha="center", va="center", fontsize=7,
            linespacing=1.35)
    arrow(ax, (93.5, 24.3), (99, 24.3), color=NOTE, lw=0.8)
    return fig


# --- 15: tensor parallelism: column then row, one all-reduce ----------------------------------------------

def tp_split() -> Figure:
    """A column-parallel layer then a row-parallel one on 2 ranks: split output, partial sums, one all-reduce."""
    fig, ax = canvas(12, 5.6, 120, 56)
    title(ax, 60, 54, "Tensor parallelism on 2 ranks: column-parallel, then row-parallel, then one all-reduce",
          "the MLP (gate_up_proj -> SiLU-gate -> down_proj); attention is the same with qkv_proj -> attention -> o_proj")
    for rank, y in ((0, 30), (1, 9)):
        c = OWNER_COLOURS[rank]
        ax.text(2, y + 7, f"rank {rank}", fontsize=10, fontweight="bold")
        box(ax, 2, y, 10, 5, "x\n[T, hidden]", fc="white", size=7)          # the full input on every rank
        box(ax, 17, y - 2, 14, 9, f"W1: rows, half {rank}\nof the outputs\n(gate's and up's,\neach cut)", fc=c, size=7)
        box(ax, 36, y, 10, 5, "gate, up\n[T, 2 x inter/2]", fc=c, size=7)
        box(ax, 50, y, 10, 5, "SiLU(gate) * up\n[T, inter/2]", fc=c, size=6.5)
        box(ax, 64, y - 2, 14, 9, f"W2: columns,\nhalf {rank} of\nthe inputs", fc=c, size=7)
        box(ax, 82, y, 11, 5, f"partial z{rank}\n[T, hidden]", fc=c, size=7)
        for x0, x1 in ((12, 17), (31, 36), (46, 50), (60, 64), (78, 82)):
            arrow(ax, (x0, y + 2.5), (x1, y + 2.5), color=NOTE, lw=0.8)
        box(ax, 105, y, 12, 5, "z = z0 + z1\n[T, hidden]", fc="white", size=7, weight="bold")
    box(ax, 95, 21, 8, 6, "all-\nreduce\n(sum)", fc=RED, size=7.5, weight="bold")
    for y in (32.5, 11.5):
        arrow(ax, (93, y), (95, 24), color=RED, lw=1.2)
        arrow(ax, (103, 24), (105, y), color=RED, lw=1.2)
    ax.text(17, 41.5, "ColumnParallelLinear\n(MergedColumnParallelLinear)", ha="left", fontsize=7.5, color=NOTE)
    ax.text(64, 41.5, "RowParallelLinear", ha="left", fontsize=7.5, color=NOTE)
    ax.text(2, 4.5, "Column-parallel: each rank holds a slice of the output features and needs no communication; its "
                    "split output is exactly the input slice the\nrow-parallel layer's shard expects. Row-parallel: "
                    "each rank computes a partial sum of the full output; one all-reduce adds them. Two all-reduces "
                    "per layer\n(o_proj, down_proj). QKV and gate/up are cut part by part (whole heads of q, k and v; "
                    "rows of gate and of up), never the fused matrix as one.", fontsize=7.3, color=NOTE, va="top",
            linespacing=1.4)
    return fig


def tp_processes() -> Figure:
    """Who runs what under tensor parallelism: rank 0 drives, workers follow; two channels between them."""
    fig, ax = canvas(12, 5.0, 120, 50)
    title(ax, 60, 48, "Tensor parallelism: one driver process, N - 1 workers, two channels",
          "commands travel through a pipe per worker; the forward pass's tensors through torch.distributed")
    box(ax, 3, 8, 44, 32, "", fc="#eef4fb", rounded=True)
    ax.text(25, 37.8, "rank 0: your Python process", ha="center", fontsize=9, fontweight="bold")
    ax.text(25, 35.2, "LLM: tokenizer, Scheduler, BlockManager, runner 0", ha="center", fontsize=7.5)
    box(ax, 73, 8, 44, 32, "", fc="#fdf1e1", rounded=True)
    ax.text(95, 37.8, "rank 1 ... N-1: spawned workers", ha="center", fontsize=9, fontweight="bold")
    ax.text(95, 35.2, "worker_main, runner r: no scheduler, no sequences", ha="center", fontsize=7.5)
    left = ["build the StepInputs (CPU)", "inputs to its device", "forward: its shard", "gather the logits",
            "sample, commit"]
    right = ["wait for a command", "inputs to its device", "forward: its shard", "send its logits' slice",
             "wait again"]
    for i, (a, b) in enumerate(zip(left, right)):
        y = 30 - i * 4.6
        box(ax, 6, y, 38, 3.4, a, fc=BLUE if i != 2 else GREEN, size=7.5)
        box(ax, 76, y, 38, 3.4, b, fc=ORANGE if i != 2 else GREEN, size=7.5)
    arrow(ax, (44, 31.7), (76, 31.7), color=INK, label='pipe: ("run", StepInputs)', dy=1.3)
    arrow(ax, (44, 22.5), (76, 22.5), color=RED, style="<|-|>", label="all-reduce, 2 per layer (gloo / NCCL)",
          dy=1.3)
    arrow(ax, (76, 17.9), (44, 17.9), color=RED, label="gather", dy=1.3)
    ax.text(3, 5.5, "Each rank holds its shard of the model and of the KV cache, so every rank runs the same forward "
                    "pass on the same StepInputs. Only rank 0 samples;\nunder async scheduling it broadcasts the "
                    "sampled ids, which the next step's inputs read on every rank. A pipe can wait forever and "
                    "reports a dead peer at once.", fontsize=7.5, color=NOTE, va="top", linespacing=1.4)
    return fig


# --- 14: the sampler's race, one program per tile of a row, then one per row ---------------------------------

def race_tiles() -> Figure:
    """One row of logits in tiles of RACE_BLOCK tokens: each program scores its tile on its own and keeps its best
    (score, token); a second kernel picks the row's winner among the tiles."""
    fig, ax = canvas(12, 5.0, 120, 50, ymin=1)
    title(ax, 60, 48, "The race in one pass: each tile of a row finds its best token alone, then one program per row",
          "score_i = l_i / T - log E_i  (E_i = -log U_i, U_i = hash(seed, position, token i)): no softmax, no sum")
    ax.text(3, 36, "row r of the\nlogits [B, V]\n(bf16, read once)", fontsize=7.5, va="center")
    labels = ["tokens 0 .. 4,095", "4,096 .. 8,191", "8,192 .. 12,287", "...", "151,552 .. 151,935"]
    colours = [BLUE, ORANGE, GREEN, "white", PURPLE]
    for t, (label, fc) in enumerate(zip(labels, colours)):
        x = 20 + t * 20
        box(ax, x, 33, 18, 6, label, fc=fc, size=7)
        if label == "...":
            ax.text(x + 9, 22, "38 tiles a row\n(RACE_BLOCK = 4,096)", fontsize=7, ha="center", va="center",
                    color=NOTE)
            continue
        name = f"tile {t if t < 4 else 37}"
        box(ax, x, 19, 18, 8, f"program (r, {name[5:]})\nscores its tile:\n-inf below the threshold", fc=fc,
            size=6.5, rounded=True)
        arrow(ax, (x + 9, 33), (x + 9, 27), color=NOTE, lw=0.8)
        box(ax, x + 2, 10, 14, 4.5, "best (score, token)", fc="white", size=6.5)
        arrow(ax, (x + 9, 19), (x + 9, 14.5), color=NOTE, lw=0.8)
        arrow(ax, (x + 9, 10), (60, 6.5), color=RED, lw=0.9)
    box(ax, 40, 2, 40, 4.5, "_race_reduce_kernel, program r: argmax over the 38 tiles -> token", fc=GREY, size=7.5,
        weight="bold")
    ax.text(3, 12, "nothing passes\nbetween tiles;\nties go to the\nlower token id", fontsize=7, va="center",
            color=NOTE)
    return fig


# --- 16: the decode GEMM with the gate fused, and K split -----------------------------------------------------

def decode_gemm() -> Figure:
    """One program of the fused gate GEMM (gate and up rows N apart, two accumulators), and K split in parts."""
    fig, ax = canvas(12, 5.6, 120, 56, ymin=1)
    title(ax, 60, 54, "A decode GEMM: one program per output tile, the gate fused; K split when N has few tiles",
          "x [M, K] has few rows (a decode batch) and stays in the L2; w streams from memory once")
    # left: the gated program
    box(ax, 9, 40, 28, 4, "x  [M, K]   (M <= 256 rows)", fc=GREY, size=7.5)
    box(ax, 9, 20, 28, 17, "", fc="white")
    box(ax, 9, 29, 28, 8, "", fc=BLUE)
    ax.text(23, 35, "gate rows 0 .. N-1", fontsize=7.5, ha="center", va="center")
    box(ax, 9, 20, 28, 8, "", fc=ORANGE)
    ax.text(23, 26, "up rows N .. 2N-1", fontsize=7.5, ha="center", va="center")
    ax.text(7.5, 28.5, "w\n[2N, K]", fontsize=8, ha="right", va="center")
    for y0, fc in ((30.5, "#3182bd"), (21.5, "#e6550d")):  # the program's BLOCK_N rows in each half
        box(ax, 9, y0, 28, 1.6, "", fc=fc, ec=fc)
        ax.text(36.5, y0 + 0.8, "BLOCK_N", fontsize=6.5, ha="right", va="center", color="white")
    for k in range(1, 5):
        ax.plot([9 + 5.6 * k] * 2, [20, 37], color=NOTE, lw=0.5, ls=":")
    ax.text(23, 17.5, "the loop walks K in BLOCK_K steps (dotted); each step loads\nBLOCK_N gate rows and the same "
                      "BLOCK_N up rows (N apart)", fontsize=7, color=NOTE, ha="center", va="center")
    box(ax, 41, 30, 18, 5, "acc  = x gate_tile.T", fc=BLUE, size=7.5, rounded=True)
    box(ax, 41, 22, 18, 5, "acc_up = x up_tile.T", fc=ORANGE, size=7.5, rounded=True)
    arrow(ax, (37, 31.3), (41, 32.5), color=NOTE, lw=0.8)
    arrow(ax, (37, 22.3), (41, 24.5), color=NOTE, lw=0.8)
    box(ax, 41, 9, 18, 6, "silu(acc) * acc_up\nrounded once", fc=GREEN, size=7.5, rounded=True)
    arrow(ax, (50, 22), (50, 15), color=NOTE, lw=0.8)
    box(ax, 41, 2.5, 18, 4, "out [M, N]: one tile", fc="white", size=7.5)
    arrow(ax, (50, 9), (50, 6.5), color=NOTE, lw=0.8)
    ax.text(23, 9, "no [M, 2N] intermediate,\nno separate gate kernel", fontsize=7.5, ha="center", va="center",
            color=RED)
    # right: split K
    ax.text(90, 45, "o_proj, down_proj: N = 1,024 columns, few tiles: split K", fontsize=8.5, ha="center",
            fontweight="bold")
    for s in range(4):
        x = 67 + s * 12.5
        box(ax, x, 35, 11, 5, f"K part {s}", fc=OWNER_COLOURS[s], size=7.5)
        box(ax, x, 24, 11, 6, f"program\n(tile, split {s})", fc=OWNER_COLOURS[s], size=7, rounded=True)
        arrow(ax, (x + 5.5, 35), (x + 5.5, 30), color=NOTE, lw=0.8)
        box(ax, x, 14, 11, 5, f"partial {s}\nfloat32", fc="white", size=7)
        arrow(ax, (x + 5.5, 24), (x + 5.5, 19), color=NOTE, lw=0.8)
        arrow(ax, (x + 5.5, 14), (91.5, 9.5), color=RED, lw=0.9)
    box(ax, 74, 5, 35, 4.5, "_split_sum_kernel: 0 + 1 + 2 + 3, in order", fc=GREY, size=7.5, weight="bold")
    ax.text(91.5, 2.5, "a fixed order, no atomics: the same bits every run", fontsize=7, ha="center", color=NOTE)
    return fig


def pdl_chain() -> Figure:
    """Kernels of one layer in a CUDA graph, launched in stream order and with programmatic dependent launch."""
    fig, ax = canvas(12, 4.6, 120, 46)
    title(ax, 60, 44, "Programmatic dependent launch: the next kernel is resident before the previous one ends",
          "the MLP's chained kernels (norm, gate_up GEMM with the gate, down GEMM) for a few rows; QK-norm + RoPE launches normally; durations illustrative (a few us each, the gaps well "
          "under one)")
    k = 2.6  # drawing units per illustrative time unit
    kernels = [("norm", 5, BLUE), ("gate_up", 12, ORANGE), ("down", 7, GREEN)]
    gap, start_cost = 1.2, 1.5  # the launch gap, then the programs' start (scheduled, first operands loaded)
    for name, y in (("stream order", 28), ("PDL", 9)):
        ax.text(2, y + 6.5, name, fontsize=10, fontweight="bold")
    t = 14.0
    for name, work, fc in kernels:  # stream order: each kernel is launched when the previous one has finished
        ax.add_patch(Rectangle((t, 28), gap * k, 4, fc="white", ec=RED, ls=":", lw=1))
        box(ax, t + gap * k, 28, start_cost * k, 4, "", fc=GREY)
        box(ax, t + (gap + start_cost) * k, 28, work * k, 4, name, fc=fc, size=7.5)
        t += (gap + start_cost + work) * k
    ax.text(t + 1, 30, f"{(t - 14) / k:.1f} units", fontsize=7.5, va="center")
    ax.text(14, 25, "red dotted: launch gap (the previous kernel drains, the next is scheduled); grey: the programs "
                    "start and load what does not depend on the previous kernel", fontsize=7, color=NOTE)
    t = 14.0 + start_cost * k
    box(ax, 14.0, 9, start_cost * k, 4, "", fc=GREY)
    for i, (name, work, fc) in enumerate(kernels):  # PDL: each kernel is resident while the previous one runs
        box(ax, t, 9, work * k, 4, name, fc=fc, size=7.5)
        if i + 1 < len(kernels):
            arrow(ax, (t + 0.6, 13.2), (t + 0.6, 16.0), color="#6a51a3", lw=0.9)
            ax.text(t + 1.2, 15.2, "gdc_launch_dependents", fontsize=6.5, color="#6a51a3")
            box(ax, t + 1.5, 3.5, start_cost * k, 4, "", fc=GREY)
            ax.add_patch(Rectangle((t + 1.5 + start_cost * k, 3.5), work * k - 1.5 - start_cost * k, 4, fc="white",
                                   ec="#6a51a3", ls="--", lw=0.8))
            ax.text(t + 1.5 + start_cost * k + 0.8, 5.5, f"{kernels[i + 1][0]}:\ngdc_wait", fontsize=6.5, va="center",
                    color="#6a51a3", linespacing=1.1)
        t += work * k
    ax.text(t + 1, 11, f"{(t - 14) / k:.1f} units", fontsize=7.5, va="center")
    ax.text(14, 0.8, "dashed: the next kernel's programs wait (griddepcontrol.wait) until the previous kernel's writes "
                     "are visible; every kernel launched this way must wait before it reads and before it ends",
            fontsize=7, color=NOTE)
    return fig


def generate_timeline() -> Figure:
    """One `generate` call over time: validate and queue, then schedule -> run -> postprocess per step, then results."""
    fig, ax = canvas(12, 4.6, 120, 46)
    title(ax, 60, 44, "One generate call: requests in, one step per loop turn, results out",
          "two prompts, greedy, max_tokens=3; step 1 prefills both prompts, steps 2-3 decode; durations illustrative")
    lanes = {"LLMEngine": 30, "Scheduler": 20, "ModelRunner": 10}
    for name, y in lanes.items():
        ax.text(2, y + 1.7, name, fontsize=8.5, fontweight="bold", va="center")
        ax.hlines([y + 1.7], 16, 117, color="#dddddd", lw=0.8)
    box(ax, 16, 30, 9, 3.4, "make_requests\n(validate)", fc=GREY, size=6.5)
    box(ax, 25.5, 30, 5, 3.4, "queue", fc=GREY, size=6.5)
    t = 32.0
    for n, (kind, width) in enumerate([("prefill", 12), ("decode", 7), ("decode", 7)], start=1):
        start = t
        box(ax, t, 20, 5.5, 3.4, "schedule", fc=BLUE, size=6)
        t += 5.5
        box(ax, t, 10, width, 3.4, f"run: {kind}", fc=ORANGE, size=6.5)
        t += width
        box(ax, t, 20, 7, 3.4, "postprocess", fc=GREEN, size=6)
        t += 7
        arrow(ax, (start + 2.7, 30), (start + 2.7, 23.6), lw=0.8)
        ax.text(start, 35.5, f"step {n}", fontsize=7.5)
        box(ax, start, 30, t - start - 0.5, 3.4, "step()", fc="white", size=7)
        t += 1.0
    ax.text(t - 8, 17.3, "finished:\nblocks freed", fontsize=6.5, va="top")
    box(ax, t, 30, 10, 3.4, "results in\nprompt order", fc=GREY, size=6.5)
    ax.text(16, 4.5, "while not scheduler.is_finished(): batch = scheduler.schedule(); token_ids = runner.run(batch); "
                     "scheduler.postprocess(batch.seqs, token_ids)", fontsize=7, family="monospace")
    ax.text(16, 1.5, "run = launch (prepare + execute) then token_ids (wait); a bad request fails in make_requests, "
                     "before any step", fontsize=7, color=INK)
    return fig


def request_path() -> Figure:
    """One OpenAI request through the server: body -> SamplingParams -> OnlineLLM -> RequestOutput -> SSE chunks, and
    the abort edge a client that hangs up takes back to the engine."""
    fig, ax = canvas(12, 3.8, 120, 44, ymin=3)
    title(ax, 60, 42, "One request through the OpenAI door",
          "POST /v1/completions with stream=true: serve/protocol.py turns bodies into engine calls, serve/app.py carries them over HTTP")
    steps = [(7, "HTTP body\n(JSON dict)", GREY, "the client's request"),
             (29, "SamplingParams\n+ prompt", BLUE, "parse_completion_request,\nsampling_params"),
             (51, "OnlineLLM\n.submit", ORANGE, "the engine loop\n(lesson 21)"),
             (73, "RequestOutput\n(index, text)", GREEN, "RequestStream,\none per step"),
             (95, "SSE chunks\ndata: {...}", PURPLE, "StreamChunks, sse;\nlast: data: [DONE]")]
    for x, text, colour, note in steps:
        box(ax, x, 18, 18, 8, text, fc=colour, size=8, rounded=True)
        ax.text(x + 9, 30, note, ha="center", va="center", fontsize=6.8, color=NOTE, linespacing=1.15)
    for x in (25, 47, 69, 91):
        arrow(ax, (x, 22), (x + 4, 22))
    ax.text(38, 14.5, "a bad field: 400, param names it", fontsize=6.8, ha="center", color=RED)
    ax.text(93, 35.5, "n > 1: index per choice; text held back\nas a stop string's possible start: no chunk", fontsize=6.8,
            ha="center")
    arrow(ax, (104, 18), (60, 18), color=RED, rad=-0.3, label="client hangs up: stream.abort(), blocks freed", dy=-9.5)
    return fig


# --- 10: the incremental detokenizer's offsets, a split UTF-8 character, a stop string across tokens ------------

def detokenizer_offsets() -> Figure:
    """`IncrementalDetokenizer` and `StopStrings` over ' the café. Raise' (the tiny model's tokenizer, as notebook 10
    prints it): the offsets per token, é's two bytes in two tokens, and '. Raise' found across two tokens."""
    fig, ax = canvas(12, 5.8, 120, 58)
    title(ax, 60, 56, "The incremental detokenizer, token by token: ' the café. Raise' with stop=['. Raise']",
          "the tiny model's tokenizer (notebook 10 prints these rows); é is two bytes, C3 A9, and they arrive "
          "in two tokens")
    tokens = ["263", "1935", "69", "127", "102", "13", "3850"]
    rows = [("token id", tokens),
            ("its bytes", ["20 74 68 65", "20 63 61", "66", "C3", "A9", "2E", "20 52 61 69 73 65"]),
            ("offsets before (prefix, read)", ["0, 0", "0, 1", "1, 2", "2, 3", "2, 3", "3, 5", "5, 6"]),
            ("decode(tokens[prefix:])", ["' the'", "' the ca'", "' caf'", "'f\ufffd'", "'fé'", "'é.'", "'. Raise'"]),
            ("minus decode(tokens[prefix:read])", ["''", "' the'", "' ca'", "'f'", "'f'", "'é'", "'.'"]),
            ("= new text", ["' the'", "' ca'", "'f'", "'' (wait)", "'é'", "'.'", "' Raise'"]),
            ("offsets after", ["0, 1", "1, 2", "2, 3", "2, 3 (kept)", "3, 5", "5, 6", "6, 7"])]
    x0, w, h = 25, 13, 4
    colours = [GREY, BLUE, GREEN, ORANGE, ORANGE, PURPLE, "#f4c7c3"]  # one per token, the same in the text below
    fills = {3: "#fdd0a2", 4: "#fdd0a2", 6: "#fbe3e0"}
    for r, (label, cells) in enumerate(rows):
        y = 45 - r * h
        ax.text(1, y + h / 2, label, fontsize=7.5, va="center", fontweight="bold" if r == 0 else "normal")
        for c, text in enumerate(cells):
            box(ax, x0 + c * w, y, w, h, text, fc=fills.get(c, "white") if r else colours[c], size=7.5,
                weight="bold" if r == 0 else "normal")
    ax.text(x0 + 3.5 * w, 49.6, "127 ends inside é: the window decodes to 'f' + U+FFFD, so add returns '' and "
            "keeps both offsets; 102 completes it", fontsize=7, ha="center", color="#a04000")
    # the text so far, one cell per character, coloured by the token that brought it
    text, owner = " the café. Raise", [0, 0, 0, 0, 1, 1, 1, 2, 3, 5, 6, 6, 6, 6, 6, 6]
    cx, cw, cy = 25, 4.6, 8
    ax.text(1, cy + 2, "the text, by character\n(colour: its token)", fontsize=7.5, va="center")
    for i, (ch, t) in enumerate(zip(text, owner)):
        box(ax, cx + i * cw, cy, cw, 4, "\u2423" if ch == " " else ch, fc=colours[t], size=8.5)
        ax.text(cx + i * cw + cw / 2, cy - 1.6, str(i), fontsize=7, ha="center", va="center", color=NOTE)
    ax.text(cx + 8 * cw + cw / 2, cy + 4.9, "é: 127 + 102", fontsize=7, ha="center", color="#a04000")
    # the window a stop may begin in, and the match
    held = (cx + 4 * cw, cx + 10 * cw)
    ax.annotate("", (held[0], cy + 7.6), (held[1], cy + 7.6), arrowprops=dict(arrowstyle="|-|", color="#6a51a3",
                                                                              lw=1, mutation_scale=3))
    ax.text(held[0] - 1, cy + 9.4, "when ' Raise' arrives, the search starts at len(text) - len('. Raise') + 1 = 10 "
            "- 7 + 1 = 4: a stop may begin in the old text's last 6 characters", fontsize=7, color="#6a51a3")
    ax.add_patch(Rectangle((cx + 9 * cw, cy - 0.4), 7 * cw, 4.8, fill=False, ec=RED, lw=2))
    ax.text(cx + 16 * cw + 1.5, cy + 2, "'. Raise' found at 9, across\ntokens 13 and 3850: the text\nis cut to "
            "' the café';\n3850 stays in token_ids", fontsize=7, va="center", color=RED, linespacing=1.1)
    ax.text(1, 1.5, "while a request runs, a stream shows only text[:len(text) - 6]: the last len('. Raise') - 1 "
            "characters may still be the start of the stop string (after '.' that is ' café.', the window above)",
            fontsize=7, color=INK)
    return fig


# --- 23: the server's sequence diagram, a streamed request and a client that hangs up ---------------------------

def server_sequence() -> Figure:
    """A streamed completion through serve/app.py and online.py in time, one lifeline per party (the engine loop is
    a thread of its own), then the abort path a client that hangs up takes while another request goes on."""
    fig, ax = canvas(12, 9, 120, 90)
    title(ax, 60, 88, "A streamed request in time, and a client that hangs up",
          "serve/app.py on uvicorn's event loop, online.py's engine loop in its own thread; the RequestStream's "
          "queue is the only thing the two threads share")
    lanes = {"client\n(openai)": 10, "route on the event loop\n(build_app, respond)": 33,
             "RequestStream\n(a thread-safe queue)": 59, "engine loop thread\n(OnlineLLM.serve_forever)": 84,
             "Scheduler,\nBlockManager": 109}
    for name, x in lanes.items():
        box(ax, x - 9.5, 76.5, 19, 5.5, name, fc=GREY, size=7.5, rounded=True)
        ax.vlines(x, 1, 76.5, color="#bbbbbb", lw=1, linestyles=(0, (4, 3)))
    c, r, q, e, b = lanes.values()

    def msg(y, x0, x1, label, color=INK, dashed=False, above=1.3):
        ax.add_patch(FancyArrowPatch((x0, y), (x1, y), arrowstyle="-|>", mutation_scale=9, color=color, lw=1.1,
                                     linestyle="--" if dashed else "-", shrinkA=0, shrinkB=0))
        ax.text((x0 + x1) / 2, y + above, label, ha="center", va="center", fontsize=7, color=color)

    def note(x, y, label, color=INK):
        ax.text(x + 1.2, y, label, ha="left", va="center", fontsize=7, color=color, linespacing=1.1,
                bbox=dict(boxstyle="square,pad=0.25", fc="white", ec="#cccccc", lw=0.6))

    msg(73, c, r, "POST /v1/completions\n\"stream\": true", above=2)
    note(r, 69, "post's route: json.loads(body), parse_completion_request")
    msg(65.5, r, e, "respond -> submit: make_sequence, then OnlineLLM.submit_sequence: a RequestStream, "
                  "inbox.put((\"add\", request)), wakeup.set()")
    msg(62, r, c, "200: StreamingResponse(stream_events(...))", dashed=True)
    box(ax, e - 0.8, 35, 1.6, 27, fc=ORANGE, ec="#a04000")  # the loop at work on this request
    msg(57, e, b, "admit(): scheduler.queue(seq);\nsteps(): schedule, launch, complete", above=2.2)
    msg(52.5, e, q, "publish() -> publish_request:\nstream.put(RequestOutput)", color="#a04000", above=2)
    msg(47.5, q, r, "outputs_of: async for, woken\nby call_soon_threadsafe;\nadd_text holds back held_chars",
        color="#a04000", above=2.7)
    msg(44.5, r, c, "sse(chunk): data: {...}", color="#2171b5")
    ax.add_patch(Rectangle((2, 43), 116, 18, fill=False, ec="#999999", lw=0.8, ls=":"))
    ax.text(3, 59.8, "once per step", fontsize=7, ha="left", color=NOTE, style="italic")
    msg(40, e, q, "the last output carries the result", color="#a04000")
    msg(36.5, r, c, "usage chunk (include_usage), then data: [DONE]", color="#2171b5")
    # the abort path
    ax.hlines(33, 1, 119, color=RED, lw=0.8, linestyles=(0, (6, 3)))
    ax.text(60, 31.5, "abort path: a client hangs up mid-stream while another request, B, is decoding beside it",
            ha="center", fontsize=7.5, color=RED, fontweight="bold")
    ax.text(c, 27.5, "X", ha="center", va="center", fontsize=11, color=RED, fontweight="bold")
    msg(27.5, c + 1.5, r, "closes the\nconnection", color=RED, above=2)
    note(r, 23, "Starlette sees http.disconnect and cancels stream_events: its finally calls stream.abort(),\n"
                  "then log_request (\"dropped\"); no stream: wait_for_result's watcher task abort_on_disconnect reads it", color=RED)
    msg(18.5, r, e, "stream.abort() -> OnlineLLM.abort: inbox.put((\"abort\", stream)), wakeup.set()", color=RED)
    box(ax, e - 0.8, 1.5, 1.6, 15, fc=ORANGE, ec="#a04000")
    note(e, 14, "admit(): to_abort; no step\nlaunched ahead till num_inflight == 0", color=RED)
    msg(8.5, e, b, "apply_aborts -> abort_sequences:\nblocks freed", color=RED, above=2.2)
    msg(4, e, q, "publish_request: the last\noutput, finish_reason \"abort\"", color=RED, above=2)
    ax.text(b, 4, "B's steps go on", ha="center", va="center", fontsize=7, color=INK,
            bbox=dict(boxstyle="square,pad=0.25", fc=GREEN, ec="#555555", lw=0.6))
    return fig


# --- 09: one row of logits through the processors, in the package's order --------------------------------

LOGITS_ROW_VOCAB = ["the", " cat", " sat", " on", " a", " mat", " dog", "."]


def logits_row_stages() -> dict[str, list[float]]:
    """The eight-token row of notebook 09's diagram after each processor, computed with the package's own
    functions in the order `sample_with_features` and `Sampler.forward` apply them (-inf: masked)."""
    import torch  # the package's functions, on the CPU: eight logits, no float bits in what is drawn (2 decimals)

    from nanovllm_edu.layers.sampler import Sampler
    from nanovllm_edu.layers.sampling_features import apply_min_p, apply_penalties

    one = lambda v, dtype=torch.float32: torch.tensor([v], dtype=dtype)
    raw = torch.tensor([[3.2, 2.8, 2.0, 1.4, 1.0, 0.4, -0.5, -1.5]])
    counts = torch.tensor([[2, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)  # the output holds "the" twice, " cat" once
    prompt_seen = torch.tensor([[False] * 5 + [True] + [False] * 2])  # the prompt held " mat"
    T = one(0.8)
    penalised = apply_penalties(raw, counts, prompt_seen, one(0.2), one(0.3), one(1.2))
    min_p = apply_min_p(penalised, T, one(0.1))
    scaled = min_p / T
    top_k = Sampler.apply_top_k_top_p(scaled, one(5, torch.int64), None)
    top_p = Sampler.apply_top_k_top_p(scaled, one(5, torch.int64), one(0.8))
    rows = {"raw logits": raw, "apply_penalties\nrep 1.2, freq 0.3, pres 0.2": penalised,
            "apply_min_p\nmin_p 0.1 at T 0.8": min_p, "divide by T = 0.8": scaled, "top_k 5": top_k,
            "top_p 0.8\n(of what top-k keeps)": top_p, "softmax: the race's\nprobabilities": torch.softmax(top_p, -1)}
    return {name: [round(v, 2) if v != float("-inf") else v for v in row[0].tolist()] for name, row in rows.items()}


def logits_row() -> Figure:
    """One row of eight logits through the processors in the package's order: penalties, min_p (both before the
    sampler), then the sampler's temperature, top-k and top-p, and the probabilities the race draws from."""
    stages = logits_row_stages()
    n, width = len(LOGITS_ROW_VOCAB), 1.45
    fig, ax = canvas(11, 7.6, 16.5, len(stages) * 3.4 + 3.2, ymin=-1.2)
    title(ax, 8.25, len(stages) * 3.4 + 2.4, "One row of logits through the processors, in the package's order",
          "sample_with_features: penalties, min_p; then Sampler.forward: / T, top-k, top-p, the race (grey: masked, "
          "-inf)")
    x0 = 4.4
    for c, token in enumerate(LOGITS_ROW_VOCAB):
        ax.text(x0 + c * width + width / 2, -0.6, repr(token), ha="center", va="center", fontsize=8, family="monospace")
    masked_before = [False] * n
    for r, (name, values) in enumerate(stages.items()):
        base = (len(stages) - 1 - r) * 3.4 + 0.6  # the zero line of this stage's bars
        is_prob = r == len(stages) - 1
        scale = 6.0 if is_prob else 0.55  # height per unit: probabilities fill the row, logits go from -1.5 to 3.2
        zero = base + (0.1 if is_prob else 0.95)
        ax.text(4.0, base + 1.3, name, ha="right", va="center", fontsize=7.8, color=INK, linespacing=1.2)
        ax.plot([x0, x0 + n * width], [zero, zero], color=NOTE, lw=0.6)
        for c, v in enumerate(values):
            x = x0 + c * width + 0.12
            if v == float("-inf") or (is_prob and masked_before[c]):
                new = not masked_before[c]
                ax.add_patch(Rectangle((x, base + 0.2), width - 0.24, 2.3, fc=GREY, ec=RED if new else "#bbbbbb",
                                       lw=1.4 if new else 0.6, zorder=3))
                ax.text(x + (width - 0.24) / 2, base + 1.35, ("masked\nhere" if new else "0") if is_prob or new
                        else "-inf", ha="center", va="center", fontsize=7, color=RED if new else NOTE, zorder=4,
                        fontweight="bold" if new else "normal", linespacing=1.2)
                masked_before[c] = True
                continue
            h = v * scale
            ax.add_patch(Rectangle((x, zero if h >= 0 else zero + h), width - 0.24, abs(h),
                                   fc=GREEN if is_prob else BLUE, ec="#555555", lw=0.6))
            label = f"{v:.2f}"
            ax.text(x + (width - 0.24) / 2, zero + max(h, 0) + 0.12, label, ha="center", va="bottom", fontsize=6.8,
                    color=INK)
    return fig


# --- 20: one decode step's kernels, from the committed H200 profile -----------------------------------------

PROFILE_RECORD = Path(__file__).resolve().parents[1] / "figures" / "profile_decode_h200_after.json"
KERNEL_COLOURS = {"attention": BLUE, "gemm": ORANGE, "elementwise/norm": GREEN, "sampler": PURPLE,
                  "memcpy/memset": GREY}


def short_kernel_name(name: str) -> str:
    """A kernel's name short enough for a label: cuBLAS's nvjet tiles, compiled norms, the rest cut at '('."""
    if name.startswith("nvjet_sm90_tst_"):
        return "cuBLAS " + name.removeprefix("nvjet_sm90_tst_").split("_")[0]
    if name.startswith("triton_per_fused"):
        return "add + RMSNorm" if "_add_" in name else "RMSNorm"
    return name.split("(")[0].removeprefix("void at::native::").split("<")[0]


def decode_step_kernels() -> Figure:
    """The H200 decode step of figures/profile_decode_h200_after.json as one lane of kernel time per part
    (forward, logits, sample), coloured by category, then everything but decode attention magnified."""
    import json

    record = json.loads(PROFILE_RECORD.read_text())
    step_us, kernels = record["ms_per_step"]["total"] * 1e3, record["kernels"]
    gap_us = step_us - record["kernel_us_per_step"]["total"]
    order = {part: i for i, part in enumerate(("forward", "logits", "sample"))}
    cats = list(KERNEL_COLOURS)
    rows = sorted(kernels, key=lambda k: (order[k["part"]], cats.index(k["category"]), -k["us_per_step"]))
    fig, ax = canvas(12, 5.6, 120, 56)
    title(ax, 60, 53.5, f"One decode step on the H200: {record['ms_per_step']['total']:.2f} ms, "
                        f"{record['kernels_per_step']['total']:.0f} kernels",
          f"Qwen3-0.6B, batch {record['batch']}, about {record['context_lens']['mean']:,.0f} cached tokens each, "
          f"forward replayed as a CUDA graph, {record['attention_backend']} attention ({PROFILE_RECORD.name})")

    def lane(y, h, items, total, wide, narrow):
        """Segments (label, us, colour, hatch) side by side from x 10 to 116, `total` us wide; a segment of at
        least `wide` us gets its label across, of at least `narrow` us along it (rotated)."""
        x = 10.0
        for label, us, colour, hatch in items:
            w = 106 * us / total
            ax.add_patch(Rectangle((x, y), w, h, fc=colour, ec="#555555", lw=0.5, hatch=hatch))
            if us >= narrow:
                across = us >= wide  # a narrow one drops `_kernel`, so that its label fits along it
                text = label if across else label.strip("_").replace("_kernel", "")
                ax.text(x + w / 2, y + h / 2, f"{text}\n{us:,.0f} us", ha="center", va="center", fontsize=6.5,
                        rotation=0 if across else 90, color=INK, linespacing=1.15,
                        bbox=dict(boxstyle="square,pad=0.15", fc="white", ec="none") if hatch else None)
            x += w

    items = [(f"{short_kernel_name(k['name'])} x{k['calls_per_step']:.0f}", k["us_per_step"],
              KERNEL_COLOURS[k["category"]], None) for k in rows]
    gaps = ("gaps", gap_us, "white", "////")
    rest = [item for item, k in zip(items, rows) if k["name"] != "_decode_kernel"] + [gaps]
    rest_us = sum(us for _, us, _, _ in rest)
    ax.text(9, 40, "the whole\nstep", ha="right", va="center", fontsize=8, fontweight="bold")
    lane(37, 6, items + [gaps], step_us, 1000, 1000)
    x_split = 10 + 106 * (step_us - rest_us) / step_us
    ax.plot([x_split, x_split, 116, 116], [36.3, 35.3, 35.3, 36.3], color=INK, lw=0.8)
    ax.text(116, 33.6, f"magnified below: the {rest_us:,.0f} us of the step that are not decode attention",
            ha="right", va="center", fontsize=7, color=NOTE, style="italic")
    ax.text(9, 24, "all but\ndecode\nattention,\nmagnified", ha="right", va="center", fontsize=8,
            fontweight="bold")
    lane(18, 12, rest, rest_us, 150, 40)
    x, spans = 10.0, {}  # where each part's kernels sit in the magnified lane
    for (_, us, _, _), k in zip(rest, [k for k in rows if k["name"] != "_decode_kernel"] + [None]):
        part = k["part"] if k else "gaps"
        spans.setdefault(part, [x, x])[1] = x + 106 * us / rest_us
        x += 106 * us / rest_us
    for part, (a, b) in spans.items():
        ax.plot([a + 0.2, a + 0.2, b - 0.2, b - 0.2], [16.6, 16, 16, 16.6], color=INK, lw=0.8)
        ax.text((a + b) / 2, 14.8, part, ha="center", va="top", fontsize=7.5)
    by_cat = record["by_category_us_per_step"]
    for i, cat in enumerate(cats):
        x = 10 + i * 21.5
        ax.add_patch(Rectangle((x, 6.5), 2.2, 2.2, fc=KERNEL_COLOURS[cat], ec="#555555", lw=0.5))
        ax.text(x + 3, 7.6, f"{cat}: {by_cat[cat]:,.0f} us ({by_cat[cat] / step_us:.1%})", va="center", fontsize=7.5)
    ax.add_patch(Rectangle((10, 2.5), 2.2, 2.2, fc="white", ec="#555555", lw=0.5, hatch="////"))
    ax.text(13, 3.6, f"gaps between kernels: {gap_us:,.0f} us ({gap_us / step_us:.1%}). Shares are of the whole "
                     f"step's {step_us:,.0f} us. The record sums each kernel's launches over a step,\nso within a "
                     "part the order is by category, not launch order; the record holds no floor.", va="center",
            fontsize=7.2, linespacing=1.3)
    return fig


# --- 10: the blocks of an n = 3 fork ---------------------------------------------------------------------

def fork_blocks() -> Figure:
    """n = 3 completions of one 10-token prompt (block_size 4): the parent's two full blocks shared by all three
    (ref_count 3), its partial last block copied once for each fork, each completion's first token in its own block."""
    block_size, prompt = 4, 10
    seqs = [("parent", [0, 1, 2]), ("fork 1", [0, 1, 3]), ("fork 2", [0, 1, 4])]  # name, block_table
    fig, ax = canvas(12, 5.4, 120, 54)
    title(ax, 60, 52, "n = 3: three completions of one prompt share its full blocks",
          f"a 10-token prompt, block_size = {block_size}: BlockManager.fork(parent, child, num_tokens=10) for each "
          "other completion")
    own = [BLUE, ORANGE, PURPLE]
    for row, (name, table) in enumerate(seqs):
        y = 38 - row * 10
        ax.text(1, y + 1.6, name, fontsize=9, fontweight="bold", va="center")
        for t in range(len(table) * block_size):
            x = 9 + t * 3 + (t // block_size) * 0.8
            if t < prompt:
                box(ax, x, y, 3, 3.2, str(t), fc=GREEN if t < 8 else own[row], size=7)
            elif t == prompt:
                box(ax, x, y, 3, 3.2, "10", fc=own[row], size=7, weight="bold")
            else:
                box(ax, x, y, 3, 3.2, "", fc="white", size=7, ls=":")
        ax.text(54, y + 4.6, "block_table", fontsize=7.5, family="monospace", va="center")
        for j, block_id in enumerate(table):
            box(ax, 54 + j * 4, y, 4, 3.2, str(block_id), fc=GREEN if j < 2 else own[row], size=8, weight="bold")
    ax.text(9, 14, "prompt tokens 0-7: two full blocks, computed once (green); 8-9: the partial block, one copy\n"
                   "each; token 10: each completion's own draw (seed + i) from the parent's last logits row",
            fontsize=7, color=NOTE, va="center", linespacing=1.3)
    ax.text(98.5, 44.5, "the block pool", ha="center", fontsize=9, fontweight="bold")
    pool = {0: ("block 0\nref_count 3", GREEN), 1: ("block 1\nref_count 3", GREEN), 2: ("block 2\nparent's\nref 1", BLUE),
            3: ("block 3\nfork 1's\nref 1", ORANGE), 4: ("block 4\nfork 2's\nref 1", PURPLE)}
    xy = {b: (82 + (b % 4) * 8.6, 35 - (b // 4) * 9.5) for b in range(8)}
    for b, (x, y) in xy.items():
        text, fc = pool.get(b, (f"block {b}\nfree", GREY))
        box(ax, x, y, 7.8, 7, text, fc=fc, size=6.6)
    for b in (3, 4):  # the (source, destination) pairs fork returns: the runner copies their keys and values
        (x0, y0), (x1, y1) = xy[2], xy[b]
        arrow(ax, (x0 + 3.9, y0), (x1 + 3.9, y1 + 7), color=RED, lw=1.3, rad=0.3 if b == 3 else -0.3)
    ax.text(99, 23, "fork returns (2, 3) and (2, 4): the runner\ncopies block 2's keys and values into each",
            ha="center", va="top", fontsize=7, color=RED, style="italic", linespacing=1.3)
    ax.text(1, 7.5, "Each fork: full = 10 // 4 = 2 blocks shared (one more reference each, so ref_count 3), the "
                    "partly filled block copied into a free block of its own,\nwhich it goes on filling with its own "
                    "tokens. 5 blocks hold the three completions, against 9 for three separate requests; a block "
                    "goes back\nto the pool only when its ref_count reaches 0, after all three have finished.",
            fontsize=7.8, va="top", color=NOTE, linespacing=1.4)
    return fig


def request_intervals_timeline() -> Figure:
    """One request's RequestMetrics marks on a line, and the interval each of vLLM's latency histograms takes of
    it (serve/metrics.py `request_intervals`, and the observer's TTFT and inter-token gaps)."""
    fig, ax = canvas(12, 5.0, 120, 50, ymin=-2)
    title(ax, 60, 48, "Where each latency histogram lies on one request's life",
          "the marks are seq.metrics (RequestMetrics); vllm:... names without the _seconds suffix; times illustrative")
    marks = [(12, "arrival_time"), (30, "first_scheduled_time"), (52, "first_token_time"),
             (96, "last_token_time"), (108, "finished_time")]
    y0 = 36
    ax.hlines([y0], 8, 114, color=INK, lw=1.2)
    for x, name in marks:
        ax.vlines([x], y0 - 1.2, y0 + 1.2, color=INK, lw=1.5)
        ax.text(x, y0 + 2.2, name, ha="center", va="bottom", fontsize=7.5, family="monospace")
    for x in (52, 63, 74, 85, 96):  # token arrivals: ids known once a step completes
        ax.plot([x], [y0], marker="o", ms=4, color=RED)
    ax.text(74, y0 - 2.6, "tokens arrive (one per decode step)", ha="center", fontsize=7, color=RED, va="top")
    bars = [("request_queue_time", 12, 30, GREY, "WAITING"), ("request_prefill_time", 30, 52, BLUE, "PREFILL"),
            ("request_decode_time", 52, 96, ORANGE,
             "DECODE; over (tokens - 1):\nrequest_time_per_output_token"), ("request_inference_time", 30, 96, GREEN, "RUNNING"),
            ("time_to_first_token", 12, 52, PURPLE, "observed at the first token"),
            ("e2e_request_latency", 12, 108, GREY, "arrival to finish")]
    for row, (name, x0, x1, colour, note) in enumerate(bars):
        y = 27 - row * 4.2
        box(ax, x0, y, x1 - x0, 3.0, name, fc=colour, size=7)
        ax.text(x1 + 1, y + 1.5, note, fontsize=6.5, va="center", color=NOTE, style="italic")
    y = 27 - len(bars) * 4.2
    for x0, x1 in ((52, 63), (63, 74), (74, 85), (85, 96)):
        box(ax, x0 + 0.3, y, x1 - x0 - 0.6, 3.0, "", fc=RED, ec=RED, alpha=0.35)
    ax.text(97, y + 1.5, "inter_token_latency: one observation per gap", fontsize=6.5, va="center", color=NOTE,
            style="italic")
    return fig


DIAGRAMS: dict[str, tuple[Callable[[], Figure], str]] = {  # file name -> (drawing, the lesson that shows it)
    "course_map": (course_map, "00_setup"),
    "bpe_merge_tree": (bpe_merge_tree, "01_tokenizer"),
    "decoder_layer": (decoder_layer, "02_qwen3_model"),
    "architecture": (architecture, "08_engine_core"),
    "generate_timeline": (generate_timeline, "08_engine_core"),
    "block_tables": (block_tables, "03_paged_blocks"),
    "kv_cache_slots": (kv_cache_slots, "04_kv_cache"),
    "prefix_hash_chain": (prefix_hash_chain, "05_prefix_hashing"),
    "scheduler_step": (scheduler_step, "06_scheduler"),
    "mixed_step": (mixed_step, "06_scheduler"),
    "chunked_batch": (chunked_batch, "07_model_runner"),
    "online_softmax": (online_softmax, "12_triton_attention"),
    "decode_grid": (decode_grid, "12_triton_attention"),
    "async_timeline": (async_timeline, "13_async_scheduling"),
    "cuda_graph_buffers": (cuda_graph_buffers, "14_cuda_graphs"),
    "race_tiles": (race_tiles, "15_triton_sampler"),
    "decode_gemm": (decode_gemm, "16_decode_gemms"),
    "pdl_chain": (pdl_chain, "16_decode_gemms"),
    "tp_split": (tp_split, "17_tensor_parallel"),
    "tp_processes": (tp_processes, "17_tensor_parallel"),
    "request_path": (request_path, "23_openai_server"),
    "detokenizer_offsets": (detokenizer_offsets, "10_request_features"),
    "server_sequence": (server_sequence, "23_openai_server"),
    "logits_row": (logits_row, "09_logit_processors"),
    "decode_step_kernels": (decode_step_kernels, "20_profiling_a_decode_step"),
    "fork_blocks": (fork_blocks, "10_request_features"),
    "request_intervals_timeline": (request_intervals_timeline, "24_deployment"),
}


def draw(name: str, folder: Path) -> Path:
    """Draw diagram `name` into `folder` as `name`.png; returns its path."""
    fig = DIAGRAMS[name][0]()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return path
