"""The course's diagrams (scripts/diagrams.py, issue 27): each file in figures/diagrams/ is drawn by code, shown by
the lesson that teaches its idea, asked about in that lesson's questions, and redrawn the same by
`python scripts/make_figures.py diagrams`."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
import matplotlib.image as mpimg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from diagrams import DIAGRAMS, draw

FOLDER = ROOT / "figures" / "diagrams"


def markdown(lesson: str) -> str:
    cells = json.loads((ROOT / "notebooks" / f"{lesson}.ipynb").read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_every_diagram_file_is_drawn_by_code():
    files = {p.stem for p in FOLDER.glob("*.png")}
    assert files == set(DIAGRAMS), f"in figures/diagrams/ but not drawn: {sorted(files - set(DIAGRAMS))}; " \
                                   f"drawn but not committed: {sorted(set(DIAGRAMS) - files)}"
    assert len(DIAGRAMS) >= 11


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_the_lesson_shows_the_diagram_and_asks_about_it(name):
    lesson = DIAGRAMS[name][1]
    text = markdown(lesson)
    assert f"../figures/diagrams/{name}.png" in text, f"{lesson} does not show figures/diagrams/{name}.png"
    questions = text[text.index("## Questions and exercises"):]
    assert "diagram" in questions, f"{lesson}'s questions ask nothing about its diagram(s)"


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_make_figures_redraws_the_committed_diagram(name, tmp_path):
    redrawn, committed = mpimg.imread(draw(name, tmp_path)), mpimg.imread(FOLDER / f"{name}.png")
    assert redrawn.shape == committed.shape, f"{name}: {redrawn.shape} redrawn against {committed.shape} committed " \
                                             "(run python scripts/make_figures.py diagrams)"
    differing = (abs(redrawn - committed).max(axis=-1) > 0.1).mean()
    assert differing < 0.001, f"{name}: {differing:.2%} of the pixels differ from the committed PNG " \
                              "(run python scripts/make_figures.py diagrams)"
