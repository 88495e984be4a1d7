"""Run notebooks top to bottom without Jupyter, printing every cell's output; stop a notebook at its first error.

    python scripts/run_notebook.py notebooks/*.ipynb [--log-dir DIR]

What `scripts/gpu_suite.sh` uses on the GPU machine, which has no Jupyter server or kernel: each notebook runs in
a fresh process, in an IPython shell (magics, `display`, the value of a cell's last expression work as in a
notebook), with the notebook's folder as the working directory, as nbconvert runs it. Outputs are not compared
with the stored ones (they differ on a GPU); the exit code is 1 if any notebook failed, and the summary names
the failing cell (a cell tagged `raises-exception`, as nbval knows them, may fail). Plots go to matplotlib's Agg backend.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def run_one(path: Path) -> int:
    """Run one notebook in this process; return 0, or 1 after printing which cell failed."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance(colors="nocolor")
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    os.chdir(path.parent)
    sys.path.insert(0, str(path.parent.resolve()))  # as a kernel started there has it: notebooks/course_stage.py
    for number, cell in enumerate(cells, 1):
        source = "".join(cell["source"])
        print(f"\n----- {path.name} cell {number}/{len(cells)} (id {cell.get('id', '?')}) -----", flush=True)
        start = time.perf_counter()
        result = shell.run_cell(source, store_history=True)
        print(f"[{time.perf_counter() - start:.1f} s]", flush=True)
        if not result.success and "raises-exception" not in cell.get("metadata", {}).get("tags", []):
            error = result.error_in_exec or result.error_before_exec
            print(f"FAILED: {path.name} cell {number} (id {cell.get('id', '?')}): {type(error).__name__}: {error}")
            return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--log-dir", type=Path, help="write each notebook's output to DIR/NAME.log (default: stdout)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per notebook")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: run one in this process
    args = ap.parse_args()
    if args.one:
        return run_one(args.notebooks[0].resolve())
    failed = []
    for path in args.notebooks:
        log = open(args.log_dir / f"{path.stem}.log", "w") if args.log_dir else None
        start = time.perf_counter()
        try:
            code = subprocess.run([sys.executable, __file__, "--one", str(path)], stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        status = "ok" if code == 0 else f"FAILED ({code})"
        print(f"{path.name:36s} {status:12s} {time.perf_counter() - start:6.1f} s", flush=True)
        if code != 0:
            failed.append(path.name)
            if log:
                tail = [line for line in (args.log_dir / f"{path.stem}.log").read_text().splitlines() if line.strip()]
                print("    " + "\n    ".join(tail[-6:]), flush=True)
    print(f"{len(args.notebooks) - len(failed)} of {len(args.notebooks)} notebooks ran to the end"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
