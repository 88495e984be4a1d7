"""Every closing question of every lesson is labelled Q<NN>.<k> (lesson NN, as its file name spells it; question k, numbered from 1) and
answered once in appendix C1 (notebooks/C1_solutions.ipynb) under a heading `### Q<NN>.<k>`; every answer
heading belongs to a question, every lesson asks at least MIN_QUESTIONS, every lesson links to its answers, and every answer says more than a sentence."""
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SOLUTIONS = NOTEBOOKS / "C1_solutions.ipynb"
LESSONS = sorted(p for p in NOTEBOOKS.glob("*.ipynb") if p.name[0].isdigit())
MIN_QUESTIONS = 3  # every lesson closes with at least this many labelled questions
LABEL = re.compile(r"^\d+\. \*\*(Q\d\d[a-z]?\.\d+)\*\* ", re.M)


def questions(path: Path) -> list[str]:
    """The labels of a lesson's closing questions, in order."""
    text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    closing = text[text.index("## Questions and exercises"):]
    closing = closing.split("\n## ", 1)[0]  # up to the next section (an appendix of the lesson)
    items = re.findall(r"^\d+\. ", closing, flags=re.M)
    labels = LABEL.findall(closing)
    assert len(labels) == len(items), f"{path.name}: {len(items)} questions, {len(labels)} labelled"
    return labels


def answers() -> dict[str, str]:
    """Each answer heading of C1 and its text: the markdown and code up to the next heading."""
    out, current = {}, None
    for cell in json.loads(SOLUTIONS.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            for part in re.split(r"^(#{2,3} .*)$", source, flags=re.M):
                head = re.match(r"### (Q\d\d[a-z]?\.\d+)\s*$", part)
                if head:
                    assert head.group(1) not in out, f"two answers for {head.group(1)}"
                    current = head.group(1)
                    out[current] = ""
                elif part.startswith("## "):
                    current = None
                elif current:
                    out[current] += part
        elif current:
            out[current] += "\n" + source
    return out


ANSWERS = answers()


@pytest.mark.parametrize("path", LESSONS, ids=[p.name for p in LESSONS])
def test_questions_are_labelled_and_answered(path):
    nn = path.name.split("_")[0]
    labels = questions(path)
    assert labels == [f"Q{nn}.{k}" for k in range(1, len(labels) + 1)], f"{path.name}: labels {labels}"
    assert len(labels) >= MIN_QUESTIONS, f"{path.name}: {len(labels)} questions, at least {MIN_QUESTIONS}"
    missing = [label for label in labels if label not in ANSWERS]
    assert not missing, f"{path.name}: no answer for {missing}"
    assert f"`C1_solutions.ipynb`, Q{nn}" in path.read_text(), f"{path.name} does not link to its answers"


def test_every_answer_has_its_question_and_says_enough():
    labels = {label for path in LESSONS for label in questions(path)}
    assert set(ANSWERS) <= labels, f"answers without a question: {sorted(set(ANSWERS) - labels)}"
    for label, text in ANSWERS.items():
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", prose) if len(s.split()) >= 4]
        assert len(sentences) >= 2 or len(prose.split()) >= 40, f"{label}: an answer of one sentence"


def test_the_readers_read(tmp_path):
    assert len(ANSWERS) >= 100 and all(re.fullmatch(r"Q\d\d[a-z]?\.\d+", label) for label in ANSWERS)
    nb = {"cells": [{"cell_type": "markdown", "source": "## Questions and exercises\n\n1. **Q99.1** Why?\n2. Then?"}]}
    path = tmp_path / "99_x.ipynb"
    path.write_text(json.dumps(nb))
    with pytest.raises(AssertionError, match="2 questions, 1 labelled"):
        questions(path)
