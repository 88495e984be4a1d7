"""Compare two lm-eval runs, sample by sample (from their `--log_samples` files): multiple-choice tasks
(loglikelihood) and generate_until tasks.

    python scripts/lm_eval_task/compare_samples.py /tmp/lmeval-out/hf /tmp/lmeval-out/server [--tol 1e-3]

Each argument is an lm-eval `--output_path` folder (or a folder below it, or one samples_*.jsonl file).
For every task found in both it prints each run's sample count and metrics (acc and acc_norm, or
exact_match), then for a multiple-choice task the largest absolute difference between the per-choice
loglikelihoods of the same document, how many documents pick a different choice, and whether the is_greedy
flags agree; for a generate_until task how many generated strings are equal, and the first that differ.
Exit status: without --tol, 0 (a report); with it, 0 when every task matches (loglikelihoods within --tol,
same picks, same is_greedy flags; every generated string equal) and 1 when not; 2 when the runs cannot be
compared (no common task, other documents, choice counts or task types). Needs only the standard library;
lm-eval is not a dependency of nanovllm_edu.
"""
import argparse
import json
import math
import sys
from pathlib import Path


def samples_files(where: Path) -> dict[str, Path]:
    """task name -> its samples file (the newest where a folder holds several runs of one task)."""
    files = [where] if where.is_file() else sorted(where.rglob("samples_*.jsonl"))
    tasks: dict[str, Path] = {}
    for f in files:
        # samples_<task>_<ISO date>.jsonl; task names may hold underscores, the date never does
        task = f.stem.removeprefix("samples_").rsplit("_", 1)[0]
        if task not in tasks or f.name > tasks[task].name:
            tasks[task] = f
    return tasks


def as_bool(x) -> bool:
    return x if isinstance(x, bool) else str(x).strip().lower() == "true"


METRICS = ("acc", "acc_norm", "exact_match")


def load(path: Path) -> dict[tuple, dict]:
    """(filter, doc_id) -> {"ll": [per choice], "greedy": [per choice]} for a multiple-choice sample, or
    {"text": the generated string} for a generate_until one; each with the sample's metrics (None if absent)."""
    rows = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        s = json.loads(line)
        resps = s["filtered_resps"]  # one [loglikelihood, is_greedy] per choice, or [generated string]
        metrics = {m: s.get(m) for m in METRICS}
        if resps and all(isinstance(r, str) for r in resps):  # generate_until (after its filters)
            row = {"text": resps[0]}
        else:
            row = {"ll": [float(r[0]) for r in resps], "greedy": [as_bool(r[1]) for r in resps]}
        rows[(s.get("filter", "none"), s["doc_id"])] = row | metrics
    return rows


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def compare_texts(a: dict, b: dict, tol: float | None) -> int:
    """generate_until: every generated string equal (a tolerance has no meaning for strings)."""
    differ = [key for key in sorted(a, key=lambda k: (str(k[0]), k[1])) if a[key]["text"] != b[key]["text"]]
    print(f"  generated strings equal: {len(a) - len(differ)} of {len(a)}")
    for key in differ[:5]:
        print(f"    doc {key[1]}: {a[key]['text']!r} vs {b[key]['text']!r}")
    if tol is None:
        return 0
    print(f"  all equal: {'yes' if not differ else 'NO'}")
    return 1 if differ else 0


def compare(task: str, a: dict, b: dict, names: tuple[str, str], tol: float | None) -> int:
    print(f"task {task}")
    for name, rows in zip(names, (a, b)):
        logged = [m for m in METRICS if any(r[m] is not None for r in rows.values())]
        print(f"  {name}: {len(rows)} samples, "
              + ", ".join(f"{m} {fmt(mean(r[m] for r in rows.values()))}" for m in logged))
    if a.keys() != b.keys():
        print(f"  the runs hold different documents ({len(a.keys() - b.keys())} only in the first, "
              f"{len(b.keys() - a.keys())} only in the second): not compared")
        return 2
    kinds = {"text" in r for r in (*a.values(), *b.values())}
    if len(kinds) > 1:
        print("  one run holds generated strings, the other loglikelihoods: not compared")
        return 2
    if kinds == {True}:
        return compare_texts(a, b, tol)
    worst, worst_at, picks_differ, greedy_differ, n_choices = 0.0, None, [], [], 0
    for key in sorted(a, key=lambda k: (str(k[0]), k[1])):
        ra, rb = a[key], b[key]
        if len(ra["ll"]) != len(rb["ll"]):
            print(f"  doc {key[1]}: {len(ra['ll'])} choices against {len(rb['ll'])}: not compared")
            return 2
        for i, (x, y) in enumerate(zip(ra["ll"], rb["ll"])):
            n_choices += 1
            diff = math.inf if math.isnan(x) or math.isnan(y) else abs(x - y)
            if diff > worst or worst_at is None:
                worst, worst_at = diff, (key[1], i, x, y)
        if argmax(ra["ll"]) != argmax(rb["ll"]):
            picks_differ.append(key[1])
        greedy_differ += [(key[1], i) for i, (g, h) in enumerate(zip(ra["greedy"], rb["greedy"])) if g != h]
    doc, choice, x, y = worst_at
    print(f"  per-choice loglikelihoods: {n_choices} compared, max abs difference {worst:.3g} "
          f"(doc {doc}, choice {choice}: {x:.6f} vs {y:.6f})")
    print(f"  chosen answer (argmax loglikelihood) differs in {len(picks_differ)} docs"
          + (f": {picks_differ}" if picks_differ else ""))
    print(f"  is_greedy flags agree: {'yes' if not greedy_differ else 'no'}"
          + (f" ({len(greedy_differ)} differ, (doc, choice): {greedy_differ[:10]})" if greedy_differ else ""))
    if tol is None:
        return 0
    ok = worst <= tol and not greedy_differ and not picks_differ
    print(f"  within tolerance {tol:g}: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("first", type=Path, help="an lm-eval --output_path folder (or a samples_*.jsonl file)")
    p.add_argument("second", type=Path)
    p.add_argument("--tol", type=float, default=None,
                   help="fail (exit 1) where a loglikelihood differs by more than this, a pick or an "
                        "is_greedy flag differs, or a generated string differs")
    args = p.parse_args(argv)
    found = [samples_files(args.first), samples_files(args.second)]
    for where, tasks in zip((args.first, args.second), found):
        if not tasks:
            print(f"no samples_*.jsonl under {where} (run lm-eval with --log_samples)", file=sys.stderr)
            return 2
    common = sorted(found[0].keys() & found[1].keys())
    if not common:
        print(f"no task in both: {sorted(found[0])} vs {sorted(found[1])}", file=sys.stderr)
        return 2
    status = 0
    for task in common:
        names = (str(found[0][task]), str(found[1][task]))
        status = max(status, compare(task, load(found[0][task]), load(found[1][task]), names, args.tol))
    return status


if __name__ == "__main__":
    sys.exit(main())
