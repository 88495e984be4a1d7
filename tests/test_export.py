"""The package is exported from the notebooks: exporting again must change nothing."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_exported_modules_match_the_notebooks():
    pytest.importorskip("nbdev")  # the dev extra: scripts/export_notebooks.py uses nbdev's exporter
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_notebooks.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
