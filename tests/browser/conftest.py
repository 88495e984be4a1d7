"""Browser tests: JupyterLab driven by headless Chromium (Debian's `chromium` + the `playwright` package).

They need `/usr/bin/chromium` (or $NVE_CHROMIUM) and `playwright`, and they only run when asked for with
`-m browser` (or NVE_BROWSER_TESTS=1), so the default `pytest` run never starts a browser.
One command installs what they need and runs them: `bash scripts/browser_test.sh` (there a missing
dependency is an error, not a skip: NVE_BROWSER_REQUIRED=1).
"""

import importlib.util
import os
import shutil

import pytest

CHROMIUM = os.environ.get("NVE_CHROMIUM", "/usr/bin/chromium")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "browser: JupyterLab in headless Chromium (run with -m browser; bash scripts/browser_test.sh)",
    )


def browser_skip_reason(config) -> str | None:
    """Why the browser tests cannot or should not run here, or None when they should."""
    asked = "browser" in (config.getoption("-m") or "") or os.environ.get("NVE_BROWSER_TESTS") == "1"
    if not asked:
        return "browser tests run only with -m browser (bash scripts/browser_test.sh)"
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set NVE_CHROMIUM)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install playwright; never `playwright install`)"
    if shutil.which("jupyter-lab") is None and importlib.util.find_spec("jupyterlab") is None:
        return "jupyterlab is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = browser_skip_reason(config)
    if reason is None:
        return
    selected = [item for item in items if "browser" in item.keywords]
    if selected and os.environ.get("NVE_BROWSER_REQUIRED") == "1":  # scripts/browser_test.sh: never skip
        raise pytest.UsageError(f"browser tests required (NVE_BROWSER_REQUIRED=1) but cannot run: {reason}")
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
