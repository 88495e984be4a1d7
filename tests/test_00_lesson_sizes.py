"""Every lesson (a notebook whose name starts with a digit) holds at most 1,000 lines of code and 4,500 words of
prose; appendices (a letter first) are exempt. Counted as ../shared/tools/lesson_sizes.py counts them."""
import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
MAX_CODE_LINES, MAX_WORDS = 1000, 4500


def lesson_size(path: Path) -> tuple[int, int]:
    """Lines of code (every line of every code cell) and words of prose (markdown cells) of a notebook."""
    cells = json.loads(path.read_text())["cells"]
    text = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]
    code = sum(len(t.splitlines()) for c, t in zip(cells, text) if c["cell_type"] == "code")
    words = sum(len(t.split()) for c, t in zip(cells, text) if c["cell_type"] == "markdown")
    return code, words


LESSONS = sorted(p for p in NOTEBOOKS.glob("*.ipynb") if p.name[0].isdigit())


def test_there_are_lessons_to_check():
    assert len(LESSONS) >= 15


@pytest.mark.parametrize("path", LESSONS, ids=[p.name for p in LESSONS])
def test_lesson_fits(path):
    code, words = lesson_size(path)
    assert code <= MAX_CODE_LINES, f"{path.name}: {code} lines of code (at most {MAX_CODE_LINES}): split it"
    assert words <= MAX_WORDS, f"{path.name}: {words} words of prose (at most {MAX_WORDS}): split or trim it"


def test_the_counter_counts(tmp_path):
    notebook = {"cells": [{"cell_type": "code", "source": ["a = 1\n", "b = 2"]},
                          {"cell_type": "markdown", "source": "two words"}, {"cell_type": "raw", "source": "x y z"}]}
    path = tmp_path / "99_x.ipynb"
    path.write_text(json.dumps(notebook))
    assert lesson_size(path) == (2, 2)
