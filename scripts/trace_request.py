"""Trace one 4-token request through nanovllm_edu: the modules it runs, and its engine/model switches.

Default path (async scheduling, TP=1, CPU, shipped tiny model): build the engine and warm it up untraced, then
run one `llm.generate(["Return the"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
use_tqdm=False)` under `sys.setprofile` (and `threading.setprofile`: other threads' calls are counted apart),
recording each Python 'call' event (generator resumes included) whose code object's file lies in the package.
Module = path relative to the package; model side = under layers/, kernels/, models/, utils/; engine side =
every other package module. Switches = in the caller thread's package call events c_1 .. c_n, the number of i
with side(c_i) != side(c_{i+1}) (calls outside the package between them do not break adjacency).

Decode step: the step function is by default the outermost call of a method whose co_qualname ends with
`.launch`, defined in engine/llm_engine.py or llm.py, with the engine itself as `self` (the model runner's launch
never counts): the async loop runs launch(n+1), complete(n), and launch is
the call every step makes once. `--step-function QUALNAME` overrides it (exact co_qualname, e.g.
`LLMEngine.step` when stepping one at a time). A window runs from one outermost entry to the next; the last
one bounded by two entries is reported (4 tokens: launch decode 2 + complete decode 1, never the prefill),
its modules in order of first visit, model-side ones collapsed into "model".

Tables for docs/architecture.md (no trace runs): `--sizes` prints each module's lines, by layer, in markdown;
`--writers` prints each module's notebooks, read from its header (`File(s) to edit`). `--draw PNG` also draws
the traced decode step's modules in order, engine side above the model side, with their calls in that step.

Run: python scripts/trace_request.py [--json out.json] [--step-function QUALNAME] [--draw PNG] [--sizes] [--writers]
"""
import argparse
import json
import subprocess
import sys
import threading
from collections import Counter
from functools import cache
from itertools import pairwise, zip_longest
from pathlib import Path
from types import FrameType

import nanovllm_edu
from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path

PKG = Path(nanovllm_edu.__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from import_rules import load_modules  # the tests' reader of module headers and cell markers

MODEL_DIRS = ("layers", "kernels", "models", "utils")
STEP_MODULES = ("engine/llm_engine.py", "llm.py")
NANO_VLLM = ("llm_engine", "scheduler", "block_manager", "sequence", "model_runner", "context",
             "sampling_params", "config")  # nano-vllm's engine-side modules, for comparison
TRACED = ('llm.generate(["Return the"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), '
          "use_tqdm=False)")


def is_model(module: str) -> bool:
    return module.split("/")[0] in MODEL_DIRS


@cache
def module_of(filename: str) -> str | None:
    """The package module a code object's file is (None: outside the package)."""
    path = Path(filename).resolve()
    return path.relative_to(PKG).as_posix() if path.is_relative_to(PKG) else None


class Tracer:
    """A profile hook: records (module, is_step_entry) for each package call event of the caller thread."""

    def __init__(self, engine: object, step_function: str | None) -> None:
        self.engine, self.step_function, self.thread = engine, step_function, threading.get_ident()
        self.events: list[tuple[str, bool]] = []
        self.other_threads: Counter[str] = Counter()
        self.step_frame: FrameType | None = None  # the outermost step call running now

    def is_step(self, frame: FrameType, module: str) -> bool:
        name = frame.f_code.co_qualname
        if self.step_function is not None:
            return name == self.step_function
        return (name.endswith(".launch") and module in STEP_MODULES
                and frame.f_locals.get("self") is self.engine)

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "return" and frame is self.step_frame:
            self.step_frame = None
        if event != "call" or (module := module_of(frame.f_code.co_filename)) is None:
            return
        if threading.get_ident() != self.thread:
            self.other_threads[threading.current_thread().name] += 1
            return
        entry = self.step_frame is None and self.is_step(frame, module)
        if entry:
            self.step_frame = frame
        self.events.append((module, entry))


LAYERS = ("kernels", "layers", "models", "utils", "engine", "(top)", "serve", "bench", "course", "labs", "assets")


def layer_of(module: str) -> str:
    top = module.split("/")[0]
    return top if top in LAYERS else "(top)"


def package_files() -> list[str]:
    """The package's modules, by layer (bottom first), then by path."""
    files = [p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(files, key=lambda m: (LAYERS.index(layer_of(m)), m))


def sizes_table() -> str:
    rows = ["| layer | module | lines |", "|---|---|---:|"]
    totals: Counter[str] = Counter()
    files = package_files()
    for m in files:
        n = len((PKG / m).read_text(encoding="utf-8").splitlines())
        totals[layer_of(m)] += n
        rows.append(f"| {layer_of(m)} | `{m}` | {n} |")
    rows.append(f"| all | {len(files)} modules | {sum(totals.values())} |")
    return "\n".join(rows) + "\n\nlines per layer: " + ", ".join(f"{k} {v}" for k, v in totals.items())


def writers_table() -> str:
    rows = ["| module | notebooks (header, in course order) |", "|---|---|"]
    writers = {module.path.relative_to(PKG).as_posix(): module.writers for module in load_modules(PKG).values()}
    for m in package_files():
        names = [name.removesuffix(".ipynb") for name in writers[m]]
        rows.append(f"| `{m}` | {', '.join(names) if names else '(hand-written package marker)'} |")
    return "\n".join(rows)


def draw(path: Path, window: list[str]) -> None:
    """The decode step's modules in order of first visit, engine side on top, model side below, with calls."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    calls = Counter(window)
    order = list(dict.fromkeys(window))
    fig, ax = plt.subplots(figsize=(8, 0.36 * len(order) + 1.2))
    ax.axis("off")
    ax.set_xlim(0, 10)
    ax.set_ylim(len(order) + 0.2, -1.4)
    x_of = lambda m: 7.0 if is_model(m) else 2.5
    for i, m in enumerate(order):
        color = "#e3f1df" if is_model(m) else "#fdf1e1"
        ax.text(x_of(m), i, f"{i + 1}. {m}  ({calls[m]} calls)", ha="center", va="center", fontsize=8,
                bbox={"boxstyle": "round,pad=0.25", "fc": color, "ec": "#555555"})
        if i:
            ax.annotate("", (x_of(m), i - 0.3), (x_of(order[i - 1]), i - 0.7),
                        arrowprops={"arrowstyle": "-|>", "color": "#c0392b", "lw": 1})
    ax.text(2.5, -0.9, "engine side", ha="center", fontsize=9, fontweight="bold", va="center")
    ax.text(7.0, -0.9, "model side (layers/, kernels/, models/, utils/)", ha="center", fontsize=9,
            fontweight="bold", va="center")
    ax.set_title(f"One decode step of the traced {TRACED.split('(')[0]} (4 tokens, tiny model, CPU):\n"
                 f"modules in order of first visit, {len(window)} calls, {switches(window)} engine<->model switches",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def switches(modules: list[str]) -> int:
    return sum(is_model(a) != is_model(b) for a, b in pairwise(modules))


def package_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=PKG, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the numbers to this JSON file")
    parser.add_argument("--step-function", help="co_qualname of the step function (default: engine launch)")
    parser.add_argument("--draw", type=Path, help="draw the decode step's modules into this PNG")
    parser.add_argument("--sizes", action="store_true", help="print the modules' sizes (markdown) and stop")
    parser.add_argument("--writers", action="store_true", help="print each module's notebooks (markdown) and stop")
    args = parser.parse_args()
    if args.sizes or args.writers:
        print("\n\n".join(table() for flag, table in ((args.sizes, sizes_table), (args.writers, writers_table))
                           if flag))
        return
    llm = LLM(tiny_model_path(), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(["Return the"], params, use_tqdm=False)  # warm-up, untraced
    threads = [t.name for t in threading.enumerate()]
    tracer = Tracer(llm, args.step_function)
    threading.setprofile(tracer)
    sys.setprofile(tracer)
    try:
        llm.generate(["Return the"], params, use_tqdm=False)  # the traced request
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    seq = [m for m, _ in tracer.events]
    entries = [i for i, (_, entry) in enumerate(tracer.events) if entry] + [len(seq)]
    calls, modules = Counter(seq), sorted(set(seq))
    engine_modules = [m for m in modules if not is_model(m)]
    window = seq[entries[-3]:entries[-2]] if len(entries) >= 4 else []  # the last bounded one, not the first
    decode = list(dict.fromkeys("model" if is_model(m) else m for m in window))  # in order of first visit
    out = {"modules": modules, "engine_modules": engine_modules, "switches": switches(seq),
           "calls_per_module": dict(calls.most_common()), "decode_step_modules": decode,
           "decode_step_switches": switches(window), "step_entries": len(entries) - 1,
           "other_thread_calls": dict(tracer.other_threads), "command": " ".join(["python", *sys.argv]),
           "traced_call": TRACED, "package_commit": package_commit()}

    print(f"traced: {TRACED}\npackage: {PKG} @ {out['package_commit']}\nthreads alive before the call: "
          f"{threads}; package calls from other threads: {sum(tracer.other_threads.values())}")
    print(f"\npackage calls: {len(seq)} in {len(modules)} modules, {len(engine_modules)} engine side "
          f"(outside {'/'.join(MODEL_DIRS)}); engine<->model switches: {out['switches']}\n\n"
          "calls per module (* = model side):")
    for m, n in calls.most_common():
        print(f"  {n:6d}  {'*' if is_model(m) else ' '} {m}")
    print(f"\nstep function entries: {out['step_entries']}; one decode step "
          f"({len(window)} calls, {out['decode_step_switches']} switches) reads, in order:"
          f"{'' if window else ' nothing (fewer than 3 step entries: check --step-function)'}")
    width = max(map(len, decode), default=12)
    print(f"  {'nanovllm_edu':{width}}   nano-vllm (its 8 engine-side modules, not traced)")
    for ours, theirs in zip_longest(decode, NANO_VLLM, fillvalue=""):
        print(f"  {ours:{width}}   {theirs}")
    print(f"\ntargets: engine-side modules {len(engine_modules)} (<= 10), switches {out['switches']} "
          "(<= 150)")
    if args.draw:
        draw(args.draw, window)
        print(f"drew {args.draw}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
