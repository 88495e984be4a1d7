"""A lesson run on a GPU writes its fresh records under RUN_RECORDS (NANOVLLM_EDU_RECORDS, by default out/records;
scripts/gpu_suite.sh points it at its results folder), never over the committed records in figures/ that the
lessons' prose quotes: a GPU run must not change what a reader checks a number against."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WRITES = re.compile(r"\.write_text\(|\.write_bytes\(|json\.dump\(|\.savefig\(|open\([^)]*['\"][wa]b?['\"]")


def writes_into_figures(source: str) -> list[str]:
    """Lines of a cell that write to a path built from FIGURES (directly, or through a name assigned from it)."""
    from_figures = set(re.findall(r"^\s*(\w+)\s*=\s*\(?FIGURES\b", source, re.M))
    bad = []
    for line in source.splitlines():
        if WRITES.search(line) and ("FIGURES" in line or "figures/" in line
                                    or any(re.search(rf"\b{name}\b\.", line) for name in from_figures)):
            bad.append(line.strip())
    return bad


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_no_cell_writes_over_the_committed_records(path):
    cells = json.loads(path.read_text())["cells"]
    bad = [(i, line) for i, c in enumerate(cells) if c["cell_type"] == "code"
           for line in writes_into_figures("".join(c["source"]))]
    assert not bad, f"{path.name} writes into figures/: {bad} (write to RUN_RECORDS instead)"


def test_the_rule_sees_a_write_into_figures():
    assert writes_into_figures('(FIGURES / "x.json").write_text("{}")')
    assert writes_into_figures('record = FIGURES / "x.json"\nrecord.write_text("{}")')
    assert not writes_into_figures('(RUN_RECORDS / "x.json").write_text("{}")\nFIGURES.joinpath("y").read_text()')
