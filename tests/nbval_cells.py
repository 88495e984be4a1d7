"""Which stored outputs nbval compares, and how: one owner for conftest.py and the tests of stored outputs.

Every cell is compared after tests/nbval_sanitize.cfg (memory addresses, /tmp paths). A cell marked as a
machine-dependent timing (the cell tag `timing`, or a first line that is a comment naming it: `# timing: ...`)
is compared after tests/nbval_timing.cfg too, which masks rates and durations and nothing else. nbval's own
markers (`NBVAL_IGNORE_OUTPUT`, `NBVAL_SKIP` as a comment line, the tags `nbval-ignore-output` and `nbval-skip`)
take a cell out of the comparison altogether.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SANITIZE_CFG = ROOT / "tests" / "nbval_sanitize.cfg"
TIMING_CFG = ROOT / "tests" / "nbval_timing.cfg"
TIMING_COMMENT = re.compile(r"^\s*#\s*timing\b", re.IGNORECASE)   # `# timing: why`, not `#| export bench.timing`
IGNORE_TAGS = {"nbval-ignore-output", "nbval-skip"}
IGNORE_MARKERS = {"NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP", "PYTEST_VALIDATE_IGNORE_OUTPUT"}


def load_sanitizers(path: Path) -> list[tuple[re.Pattern, str]]:
    """(regex, replacement) pairs, parsed the way nbval's get_sanitize_patterns parses the file."""
    pairs = re.findall(r"^regex: (.*)$\n^replace: (.*)$", path.read_text(), flags=re.MULTILINE)
    return [(re.compile(rx), rep) for rx, rep in pairs]


def source_of(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def tags_of(cell: dict) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []) or [])


def is_timing_cell(cell: dict) -> bool:
    """A code cell marked as a machine-dependent timing: tag `timing`, or a first-line comment naming it."""
    return "timing" in tags_of(cell) or bool(TIMING_COMMENT.match(source_of(cell).split("\n", 1)[0]))


def comment_markers(cell: dict) -> set[str]:
    """nbval's comment markers in the cell, read as nbval reads them (a comment line that is only the marker)."""
    comments = {line.strip().lstrip("#").strip() for line in source_of(cell).splitlines()
                if line.strip().startswith("#")}
    return IGNORE_MARKERS & comments


def is_ignored_cell(cell: dict) -> bool:
    """nbval does not compare this cell's outputs at all (an ignore-output / skip tag or comment marker)."""
    return bool(IGNORE_TAGS & tags_of(cell)) or bool(comment_markers(cell))


def escapes(cell: dict) -> list[str]:
    """The ways a code cell escapes exact comparison of its stored output (empty: compared exactly)."""
    if cell.get("cell_type") != "code":
        return []
    found = [f"tag {t}" for t in sorted(IGNORE_TAGS & tags_of(cell))]
    found += [f"marker {m}" for m in sorted(comment_markers(cell))]
    if is_timing_cell(cell):
        found.append("timing")
    return found
