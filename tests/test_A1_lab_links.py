"""Every lesson (01-24) names the appendix-A1 lab that goes with it, as a markdown link to a lab section of
A1_labs.ipynb (`A1_labs.ipynb#lab-...`), and every link lands on an anchor A1 defines."""
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LINK = re.compile(r"\]\(A1_labs\.ipynb#([\w-]+)\)")
ANCHOR = re.compile(r'<a id="([\w-]+)"></a>')
LESSONS = sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if p.name[:2] != "00")


def markdown(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def a1_anchors() -> list[str]:
    return ANCHOR.findall(markdown(NOTEBOOKS / "A1_labs.ipynb"))


def test_a1_anchors_are_unique_and_each_heads_a_lab():
    anchors = a1_anchors()
    assert len(anchors) == len(set(anchors)), anchors
    assert len(anchors) >= 17 and all(a.startswith("lab-") for a in anchors), anchors
    assert {"lab-prepare-prefill", "lab-reading-a-profile"} <= set(anchors)


def test_the_lessons_are_01_to_24():
    assert [p.name[:2] for p in LESSONS] == [f"{n:02d}" for n in range(1, 25)]


@pytest.mark.parametrize("path", LESSONS, ids=[p.name[:2] for p in LESSONS])
def test_each_lesson_links_a_lab_that_exists(path):
    links = LINK.findall(markdown(path))
    assert links, f"{path.name} names no lab: add a link [name](A1_labs.ipynb#lab-...) to its questions"
    missing = set(links) - set(a1_anchors())
    assert not missing, f"{path.name} links {sorted(missing)}, which A1_labs.ipynb does not define"
