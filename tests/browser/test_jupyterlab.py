"""A course notebook in a real browser: JupyterLab on localhost, headless Chromium, Run All, no errors, widgets.

What it checks, per notebook:
  1. JupyterLab opens the notebook and starts a kernel (no dialog, no network: news, update checks and the
     extension manager are switched off);
  2. `notebook:run-all-cells` runs every code cell; each ends with an execution count and no `error` output
     (checked in the notebook model and in the DOM);
  3. an ipywidgets view rendered (the notebook's own CSS class, e.g. `nve-stepper` in notebook 11);
  4. JupyterLab saved nothing (autosave is off, checkpoints go to a temporary folder; the server log has
     no "Saving file at").

A student edition (`test_student_edition_shows_the_checkers_report`): notebook 04 with its solutions stubbed
(appendix A1), run up to its first exercise; the checker cell must show the lab's report, not a traceback.

The smoke notebook is written at test time into a temporary server root (nbval never sees it); course
notebooks run from the repository itself. A screenshot lands in the test's tmp dir (always, and named
`FAILED-*.png` on failure).

Run: `bash scripts/browser_test.sh` (installs Debian's chromium and playwright, then
`pytest -m browser tests/browser`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("NVE_CHROMIUM", "/usr/bin/chromium")
REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"

# Course notebooks with widgets, and the CSS class their widget carries.
COURSE_NOTEBOOKS = {"11_watching_the_engine.ipynb": ".nve-stepper"}

SERVER_START_S = 60
KERNEL_START_S = 90
RUN_ALL_S = float(os.environ.get("NVE_BROWSER_RUN_ALL_S", "300"))

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]

# User settings for a fresh JupyterLab: nothing fetched from the network, no autosave of course notebooks,
# the default kernel starts without a "select kernel" dialog.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    # windowingMode "none": every cell stays laid out in the DOM, so a widget far down the page is findable.
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "autoStartDefaultKernel": True,
        "windowingMode": "none",
    },
    "@jupyterlab/extensionmanager-extension/plugin.jupyterlab-settings": {"enabled": False},
}


def _cell(cell_type: str, source: str) -> dict:
    cell = {"cell_type": cell_type, "metadata": {}, "source": source}
    if cell_type == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


# A small notebook that proves the harness: a print, a Button (class nve-smoke-button) whose callback
# updates a Label through the kernel, so a click tests the widget comm both ways.
SMOKE_NOTEBOOK = {
    "nbformat": 4,
    "nbformat_minor": 5,
    "metadata": {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    },
    "cells": [
        _cell("markdown", "# Widget smoke test\nWritten by tests/browser/test_jupyterlab.py."),
        _cell("code", "print('hello from the kernel', 6 * 7)"),
        _cell(
            "code",
            "import ipywidgets as widgets\n"
            "clicks = widgets.Label('clicked 0', _dom_classes=['nve-smoke-label'])\n"
            "button = widgets.Button(description='step')\n"
            "button.add_class('nve-smoke-button')\n"
            "def on_click(_):\n"
            "    clicks.value = f'clicked {int(clicks.value.split()[-1]) + 1}'\n"
            "button.on_click(on_click)\n"
            "widgets.HBox([button, clicks])",
        ),
    ],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_settings(settings_dir: Path) -> None:
    for rel, value in LAB_SETTINGS.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


@contextlib.contextmanager
def jupyter_lab(root_dir: Path, work: Path):
    """Start JupyterLab on 127.0.0.1 serving root_dir; yield (base_url, token); stop it (no orphans)."""
    port, token = _free_port(), secrets.token_hex(16)
    for sub in ("settings", "workspaces", "runtime", "config", "checkpoints"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    _write_settings(work / "settings")
    env = dict(
        os.environ,
        JUPYTERLAB_SETTINGS_DIR=str(work / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(work / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(work / "runtime"),
        JUPYTER_CONFIG_DIR=str(work / "config"),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        PYDEVD_DISABLE_FILE_VALIDATION="1",
    )
    cmd = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root_dir}",
        "--ServerApp.open_browser=False",
        "--ServerApp.port_retries=0",
        "--ServerApp.terminals_enabled=False",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        "--LabApp.expose_app_in_browser=True",
        f"--FileCheckpoints.checkpoint_dir={work / 'checkpoints'}",
        "--NotebookNotary.db_file=:memory:",
    ]  # fmt: skip
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI containers run as root
        cmd.append("--allow-root")
    with open(work / "jupyterlab.log", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=root_dir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            _wait_until_up(proc, f"http://127.0.0.1:{port}", token, work / "jupyterlab.log")
            yield f"http://127.0.0.1:{port}", token
        finally:
            _stop(proc)


def _wait_until_up(proc: subprocess.Popen, base: str, token: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"jupyter lab did not answer in {SERVER_START_S} s:\n{_tail(log)}")
        time.sleep(0.25)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (server + kernels), wait, SIGKILL what is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    # Kernels live in the same session/process group; make sure none outlives the server.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- what to open ---------------------------------------------------------------------------------------

CASES = [pytest.param("smoke", id="widget_smoke")]
# every listed notebook must exist: a renamed notebook fails here instead of silently dropping its case
CASES += [pytest.param(name, id=name.removesuffix(".ipynb")) for name in COURSE_NOTEBOOKS]
# Any other notebook: NVE_BROWSER_NOTEBOOK=07_model_runner.ipynb [NVE_BROWSER_WIDGET=.some-class]; without
# NVE_BROWSER_WIDGET only "every cell ran without error" is checked for it.
WIDGET = os.environ.get("NVE_BROWSER_WIDGET")
if extra := os.environ.get("NVE_BROWSER_NOTEBOOK"):
    CASES.append(pytest.param(extra, id=extra.removesuffix(".ipynb")))


# JavaScript run in the page (window.jupyterapp exists because of --LabApp.expose_app_in_browser).
JS_KERNEL_STATUS = """async () => {
  const app = window.jupyterapp;
  const w = app && app.shell.currentWidget;
  if (!w || !w.sessionContext || !w.content || !w.content.model) return 'no-notebook';
  const s = w.sessionContext;
  if (!s.isReady) return 'starting';
  const k = s.session && s.session.kernel;
  return k ? k.status : 'no-kernel';
}"""

# Starts Run All without waiting; the command's promise resolves once every cell ran (or one failed).
JS_START_RUN_ALL = """() => {
  window.__nveRunAll = null;
  window.jupyterapp.commands.execute('notebook:run-all-cells').then(
    ok => { window.__nveRunAll = {ok: ok === undefined ? null : ok}; },
    err => { window.__nveRunAll = {error: String(err)}; });
}"""

# Per code cell: execution count, output types, and the error name/value if any.
JS_CELLS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const out = [];
  const cells = w.content.model.cells;
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code') continue;
    const outputs = c.outputs.toJSON();
    out.push({
      index: i,
      count: c.executionCount,
      types: outputs.map(o => o.output_type),
      errors: outputs.filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue),
      source: c.sharedModel.getSource().slice(0, 80),
    });
  }
  return {status: w.sessionContext.session.kernel.status, cells: out};
}"""


def _wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last is True:
            return
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


@pytest.mark.parametrize("notebook", CASES)
def test_notebook_runs_in_jupyterlab(notebook: str, tmp_path: Path):
    check_notebook_in_lab(notebook, tmp_path)


def test_harness_reports_a_failing_cell(tmp_path: Path):
    """The check is not vacuous: a cell that raises (after one that writes to stderr) fails it, by name."""
    broken = json.loads(json.dumps(SMOKE_NOTEBOOK))
    broken["cells"][2:2] = [
        _cell("code", "import sys\nprint('a warning', file=sys.stderr)"),
        _cell("code", "raise ValueError('deliberate failure')"),
    ]
    with pytest.raises(AssertionError, match="ValueError: deliberate failure"):
        check_notebook_in_lab("smoke", tmp_path, smoke=broken)


@contextlib.contextmanager
def lab_page(root: Path, rel: str, tmp_path: Path):
    """JupyterLab serving `root` with notebook `rel` open in headless Chromium and an idle kernel: yields the
    page. On a failure inside the block: a full-page screenshot, the console errors and the server log."""
    from playwright.sync_api import sync_playwright

    with jupyter_lab(root, tmp_path / "lab") as (base, token), sync_playwright() as pw:
        # A fresh profile per test (playwright passes it as --user-data-dir).
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        page = browser.pages[0] if browser.pages else browser.new_page()
        console_errors: list[str] = []
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: console_errors.append(f"pageerror: {e}"))
        try:
            page.goto(f"{base}/lab/tree/{rel}?token={token}", wait_until="domcontentloaded", timeout=60_000)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=60_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            _wait_for(
                lambda: (st := page.evaluate(JS_KERNEL_STATUS)) == "idle" or st,
                KERNEL_START_S,
                "an idle kernel",
            )
            yield page
        except BaseException:
            with contextlib.suppress(Exception):
                page.screenshot(path=str(tmp_path / f"FAILED-{Path(rel).stem}.png"), full_page=True)
            print("browser console errors:", *console_errors[-20:], sep="\n  ")
            print("jupyterlab log:\n" + _tail(tmp_path / "lab" / "jupyterlab.log"))
            raise
        finally:
            with contextlib.suppress(Exception):
                browser.close()


def _wait_until_settled(page) -> None:
    def settled():
        status = page.evaluate(JS_CELLS)["status"]
        busy = page.locator(".jp-InputArea-prompt", has_text="[*]").count()
        return True if status == "idle" and busy == 0 else (status, f"{busy} cells [*]")

    _wait_for(settled, 60, "an idle kernel and no [*] prompts")


def check_notebook_in_lab(notebook: str, tmp_path: Path, smoke: dict = SMOKE_NOTEBOOK) -> None:
    """Open `notebook` (a name in notebooks/, or "smoke") in JupyterLab, Run All, check; raise on a problem."""
    if notebook == "smoke":
        root = tmp_path / "root"
        root.mkdir()
        nb_path = root / "widget_smoke.ipynb"
        nb_path.write_text(json.dumps(smoke, indent=1))
        rel, widget_selector = "widget_smoke.ipynb", ".nve-smoke-button"
    else:
        root, nb_path = REPO, NOTEBOOKS / notebook
        rel, widget_selector = f"notebooks/{notebook}", COURSE_NOTEBOOKS.get(notebook, WIDGET)
    before = _sha(nb_path)
    timings = {}
    t0 = time.monotonic()

    with lab_page(root, rel, tmp_path) as page:
        timings["kernel"] = time.monotonic() - t0
        page.evaluate(JS_START_RUN_ALL)
        page.wait_for_function("() => window.__nveRunAll !== null", timeout=RUN_ALL_S * 1000, polling=500)
        run_all = page.evaluate("() => window.__nveRunAll")
        assert "error" not in run_all, f"notebook:run-all-cells failed: {run_all}"
        _wait_until_settled(page)
        timings["run_all"] = time.monotonic() - t0

        state = page.evaluate(JS_CELLS)
        errors = [(c["index"], c["source"], c["errors"]) for c in state["cells"] if c["errors"]]
        assert not errors, f"cells with errors: {errors}"
        not_run = [(c["index"], c["source"]) for c in state["cells"] if not c["count"]]
        assert not not_run, f"cells without an execution count: {not_run} (run all: {run_all})"
        dom_errors = page.locator(
            '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"],'
            '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]:has-text("Traceback")'
        ).count()
        assert dom_errors == 0, f"{dom_errors} error outputs in the page"

        if widget_selector is not None:
            widget = page.locator(widget_selector).first
            try:
                widget.wait_for(state="attached", timeout=30_000)
            except Exception as e:
                classes = page.evaluate(
                    "() => [...new Set([...document.querySelectorAll('.jupyter-widgets')]"
                    ".flatMap(e => [...e.classList]).filter(c => c.startsWith('nve-')))]"
                )
                raise AssertionError(f"no widget {widget_selector!r} in the page (nve-* classes: {classes})") from e
            widget.scroll_into_view_if_needed(timeout=10_000)
            widget.wait_for(state="visible", timeout=10_000)
            assert page.locator(".jupyter-widgets").count() > 0

        if notebook == "smoke":
            # The widget talks to the kernel: a click runs the Python callback, which updates the Label.
            assert "hello from the kernel 42" in page.locator(".jp-OutputArea-output").first.inner_text()
            widget.click()
            page.locator(".nve-smoke-label", has_text="clicked 1").wait_for(timeout=30_000)
        timings["done"] = time.monotonic() - t0
        page.screenshot(path=str(tmp_path / f"{Path(rel).stem}.png"), full_page=False)

    print(
        f"{notebook}: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()),
        f"screenshots in {tmp_path}",
    )
    # JupyterLab wrote nothing through the contents API (the server logs every save); the sha check is
    # for the private smoke copy only, since course notebooks may be re-executed by others meanwhile.
    writes = [
        l for l in (tmp_path / "lab" / "jupyterlab.log").read_text().splitlines() if "Saving file at" in l
    ]
    assert not writes, f"JupyterLab saved files: {writes}"
    if notebook == "smoke":
        assert _sha(nb_path) == before, f"{nb_path} changed on disk while open in JupyterLab"


# Runs the cells above the active one, then the active one; resolves when they have run.
JS_RUN_THROUGH = """async (index) => {
  const app = window.jupyterapp, w = app.shell.currentWidget;
  w.content.activeCellIndex = index;
  await app.commands.execute('notebook:run-all-above');
  w.content.activeCellIndex = index;
  await app.commands.execute('notebook:run-cell');
}"""

STUDENT_NOTEBOOK = "04_kv_cache.ipynb"  # its first exercise: the torch KV store, one stub cell


def test_student_edition_shows_the_checkers_report(tmp_path: Path):
    """A student edition in JupyterLab: run the cells up to the first exercise (the stub included) and the
    checker cell. The checker answers with its report (every check failed, each with what happened and a
    hint), rendered as its HTML table: not a traceback."""
    import nbformat

    from nanovllm_edu.labs.student import EXERCISE_TAG, make_student_notebook

    student, num_exercises = make_student_notebook(nbformat.read(NOTEBOOKS / STUDENT_NOTEBOOK, as_version=4))
    assert num_exercises >= 2
    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    nbformat.write(student, root / "notebooks" / STUDENT_NOTEBOOK)
    shutil.copy(NOTEBOOKS / "course_stage.py", root / "notebooks")  # the lesson's first cell imports it, as make_student copies it
    exercise = next(i for i, c in enumerate(student.cells) if EXERCISE_TAG in c.metadata.get("tags", []))
    stub = exercise - 2  # the stub, then the exercise's markdown, then the checker cell
    assert "raise NotImplementedError" in student.cells[stub].source

    with lab_page(root, f"notebooks/{STUDENT_NOTEBOOK}", tmp_path) as page:
        page.evaluate(JS_RUN_THROUGH, exercise)
        _wait_until_settled(page)
        cells = {c["index"]: c for c in page.evaluate(JS_CELLS)["cells"]}
        assert cells[stub]["count"] and not cells[stub]["errors"], cells[stub]
        checker = cells[exercise]
        assert checker["count"] and checker["types"] == ["execute_result"], checker
        report = page.locator(".jp-Cell").nth(exercise).locator(".jp-OutputArea-output")
        text = report.inner_text()
        assert "KV store (04): 0/6 checks passed (6 failed)" in text, text
        assert "NotImplementedError" in text and "hint:" in text and "Traceback" not in text, text
        assert report.locator("table").count() == 1  # the report's HTML view, not its plain text
        page.screenshot(path=str(tmp_path / "student-edition.png"), full_page=False)
