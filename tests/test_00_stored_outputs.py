"""Stored outputs that mean something: nbval compares every stored number, except in a few timing cells.

tests/nbval_cells.py says how nbval reads a cell (conftest.py applies it). Here:
- every way a cell escapes exact comparison (a `timing` tag or first-line comment, `NBVAL_IGNORE_OUTPUT`,
  `NBVAL_SKIP`, their tags) is counted over the whole course: at most MAX_ESCAPES cells;
- a timing cell's stored output holds a timing (a rate or a duration the timing sanitizers mask), so the tag
  cannot hide a record's number or a computed one;
- the sanitizers every cell gets mask no number;
- a mutation: a notebook whose stored number is changed in an untagged cell fails nbval, and the same change
  in a timing cell's duration passes (nbval run in a subprocess on a short copy of notebook 10).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from nbval_cells import ROOT, SANITIZE_CFG, TIMING_CFG, escapes, is_timing_cell, load_sanitizers

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_ESCAPES = 25


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _output_text(cell: dict) -> str:
    text = ""
    for output in cell.get("outputs", []):
        value = output.get("text") or output.get("data", {}).get("text/plain", "")
        text += "".join(value) if isinstance(value, list) else value
    return text


def escaping_cells() -> list[str]:
    """'notebook cell N (id): how' for every cell whose stored output is not compared exactly."""
    return [f"{p.name} cell {i} ({c.get('id')}): {', '.join(escapes(c))}"
            for p in NOTEBOOKS for i, c in enumerate(_cells(p)) if escapes(c)]


def test_few_cells_escape_comparison():
    found = escaping_cells()
    print(f"{len(found)} cells escape exact comparison:", *found, sep="\n  ")
    assert len(found) <= MAX_ESCAPES, f"{len(found)} cells escape comparison (at most {MAX_ESCAPES}):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_timing_cell_prints_a_timing(nb_path):
    timing = load_sanitizers(TIMING_CFG)
    wrong = [f"cell {i} ({c.get('id')})" for i, c in enumerate(_cells(nb_path))
             if c["cell_type"] == "code" and is_timing_cell(c)
             and not any(rx.search(_output_text(c)) for rx, _ in timing)]
    assert not wrong, f"{nb_path.name}: tagged `timing` but its stored output holds no rate or duration: {wrong}"


def test_every_cells_sanitizers_mask_no_number():
    always = load_sanitizers(SANITIZE_CFG)
    for text in ("8.6 ms", "1,005 tok/s", "3 s", "24,554 tok/s of completion tokens", "0.35 s", "42", "7.5%"):
        assert all(not rx.search(text) for rx, _ in always), text
    assert all(rx.search("took 8.6 ms") or rx.search("1,005 tok/s") for rx, _ in load_sanitizers(TIMING_CFG))


# ---------------------------------------------------------------- the mutation test

MUTANT_SOURCE = ROOT / "notebooks" / "10_request_features.ipynb"
MUTANT_CELL = "metrics-demo"      # RequestMetrics from stated times: its "0.2 s" is a computed number


def _short_copy(mutate) -> Path:
    """Notebook 10 up to MUTANT_CELL, one more cell that prints a timing (tagged `timing`), then `mutate`."""
    nb = json.loads(MUTANT_SOURCE.read_text(encoding="utf-8"))
    ids = [c.get("id") for c in nb["cells"]]
    nb["cells"] = nb["cells"][: ids.index(MUTANT_CELL) + 1]
    nb["cells"].append({"cell_type": "code", "id": "mutant-timing", "execution_count": 999,
                        "metadata": {"tags": ["timing"]}, "source": "import time\nt0 = time.perf_counter()\n"
                        "print(f'slept {1000 * (time.perf_counter() - t0) + 5:.1f} ms')",
                        "outputs": [{"output_type": "stream", "name": "stdout", "text": "slept 5.0 ms\n"}]})
    mutate({c["id"]: c for c in nb["cells"]})
    path = MUTANT_SOURCE.with_name(f".mutant_{uuid.uuid4().hex[:8]}.ipynb")   # beside it: the same relative paths
    path.write_text(json.dumps(nb, indent=1), encoding="utf-8")
    return path


def _nbval(path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                               "addopts=--notebooks", str(path)], check=False, cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
    finally:
        path.unlink()


def _replace_in_output(cell: dict, old: str, new: str) -> None:
    for output in cell["outputs"]:
        text = "".join(output["text"]) if isinstance(output.get("text"), list) else output.get("text", "")
        if old in text:
            output["text"] = text.replace(old, new, 1)
            return
    raise AssertionError(f"{old!r} not in the stored output of {cell['id']}")


@pytest.mark.slow
def test_a_changed_stored_number_fails_nbval():
    def change_a_number(cells):              # an untagged cell: "0.2 s" becomes "0.3 s"
        _replace_in_output(cells[MUTANT_CELL], "0.2 s", "0.3 s")

    def change_a_timing(cells):              # the timing cell's duration, which differs on every run anyway
        _replace_in_output(cells["mutant-timing"], "5.0 ms", "9.9 ms")

    assert not is_timing_cell(next(c for c in _cells(MUTANT_SOURCE) if c.get("id") == MUTANT_CELL))
    passed = _nbval(_short_copy(change_a_timing))
    assert passed.returncode == 0, passed.stdout[-3000:]
    failed = _nbval(_short_copy(change_a_number))
    assert failed.returncode == 1 and "1 failed" in failed.stdout, failed.stdout[-3000:]
    assert "0.3 s" in failed.stdout and "0.2 s" in failed.stdout   # nbval names the stored and the new value
