"""docs/architecture.md pastes tables that scripts/trace_request.py prints (module sizes, each module's notebooks):
they must be today's, so the doc cannot drift from the package."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table(flag: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_request.py"), flag], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    return out.strip()


def test_the_doc_holds_todays_tables():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for flag in ("--sizes", "--writers"):
        printed = table(flag)
        assert "| `engine/llm_engine.py` |" in printed or "engine/llm_engine.py" in printed
        assert printed in doc, f"docs/architecture.md holds an old `trace_request.py {flag}` table; paste it again"
