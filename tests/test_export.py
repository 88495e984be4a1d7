"""The package is exported from the notebooks: exporting again must change nothing."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_exported_modules_match_the_notebooks():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_notebooks.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
