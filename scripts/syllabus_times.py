"""Estimate each notebook's study time from what it holds (the README syllabus's "time" column).

    python scripts/syllabus_times.py [notebooks/*.ipynb]

A read-through is reading the prose, reading the code closely enough to predict what each cell prints,
running the cells, and answering the closing questions. Rates (a careful technical reader, not a skimmer):
prose 120 words/min, code 10 lines/min (a line of a kernel or a scheduler is read more than once), 6 min per
closing question, plus the notebook's CPU run time. The estimate is rounded up to 5 minutes.
"""
import json
import math
import re
import sys
from datetime import datetime
from pathlib import Path

WORDS_PER_MIN, CODE_LINES_PER_MIN, MIN_PER_QUESTION = 120, 10, 6


def notebook_minutes(path: Path) -> dict:
    """Words of prose, lines of code, closing questions and run seconds of one notebook, and the estimate."""
    cells = json.loads(path.read_text())["cells"]
    words = code_lines = questions = 0
    run_seconds = 0.0
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            words += len(re.findall(r"\w+", source))
            closing = re.search(r"^## Questions", source, flags=re.M)
            if closing:
                questions += len(re.findall(r"^\d+\.", source[closing.start():], flags=re.M))
        elif cell["cell_type"] == "code":
            code_lines += sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#|"))
            timing = cell.get("metadata", {}).get("execution", {})
            if "iopub.execute_input" in timing and "iopub.status.idle" in timing:
                start, end = (datetime.fromisoformat(timing[k].rstrip("Z")) for k in ("iopub.execute_input", "iopub.status.idle"))
                run_seconds += (end - start).total_seconds()
    minutes = words / WORDS_PER_MIN + code_lines / CODE_LINES_PER_MIN + questions * MIN_PER_QUESTION + run_seconds / 60
    return {"words": words, "code_lines": code_lines, "questions": questions, "run_s": run_seconds,
            "minutes": 5 * math.ceil(minutes / 5)}


def main(paths: list[str]) -> None:
    paths = [Path(p) for p in paths] or sorted(Path("notebooks").glob("*.ipynb"))
    print(f"{'notebook':32s} {'words':>6s} {'code':>5s} {'qs':>3s} {'run s':>6s} {'minutes':>8s}")
    for path in paths:
        m = notebook_minutes(path)
        print(f"{path.name:32s} {m['words']:6d} {m['code_lines']:5d} {m['questions']:3d} {m['run_s']:6.0f} {m['minutes']:8d}")


if __name__ == "__main__":
    main(sys.argv[1:])
