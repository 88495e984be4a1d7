"""Every lesson ends with a short recap before its closing questions: what was built, which of the package's
modules now hold it, and what comes next (issue 26's course convention)."""
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LESSONS = sorted(p for p in NOTEBOOKS.glob("*.ipynb") if p.name[0].isdigit())


def sections(path: Path) -> list[tuple[str, str]]:
    """(heading, text up to the next `## ` heading) of every level-2 section of the notebook's markdown."""
    text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    parts = re.split(r"^(## .*)$", text, flags=re.M)
    return [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts), 2)]


def exported_modules(path: Path) -> set[str]:
    """The package paths the notebook's cells export to (`layers/sampler.py`, `llm.py`, ...)."""
    cells = json.loads(path.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    default = next((m.group(1) for s in sources if (m := re.match(r"#\| default_exp (\S+)", s))), None)
    names = set()
    for s in sources:
        m = re.match(r"#\| export(?: (\S+))?", s)
        if m:
            names.add(m.group(1) or default)
    return {name.replace(".", "/") + ".py" for name in names if name}


def test_there_are_lessons():
    assert len(LESSONS) >= 20


@pytest.mark.parametrize("path", LESSONS, ids=[p.name for p in LESSONS])
def test_lesson_ends_with_a_recap_then_its_questions(path):
    heads = [h for h, _ in sections(path) if not h.startswith("## Appendix")]  # code a lesson shows after its end
    assert heads[-2:] == ["## What we have", "## Questions and exercises"], f"{path.name} ends with {heads[-2:]}"
    recap = dict(sections(path))["## What we have"]
    assert 25 <= len(recap.split()) <= 120, f"{path.name}: a recap of {len(recap.split())} words"
    assert re.search(r"\b[Nn]ext\b|[Nn]otebooks? \d\d|last lesson", recap), f"{path.name}: the recap says nothing of what comes next"
    modules = exported_modules(path)
    named = [m for m in modules if m in recap or m.split("/")[0] + "/" in recap or m.rsplit("/", 1)[-1] in recap]
    assert named, f"{path.name}: the recap names none of its modules {sorted(modules)}"


def test_the_section_reader_finds_recaps(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": "# 99 · x\n\n## A\ntext\n## What we have\nrecap\n"},
                    {"cell_type": "code", "source": "#| export engine.thing\nx = 1"},
                    {"cell_type": "markdown", "source": ["## Questions and exercises\n", "1. why?"]}]}
    path = tmp_path / "99_x.ipynb"
    path.write_text(json.dumps(nb))
    assert [h for h, _ in sections(path)] == ["## A", "## What we have", "## Questions and exercises"]
    assert exported_modules(path) == {"engine/thing.py"}
