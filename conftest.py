"""pytest set-up for the whole project: nbval runs every notebook, but only where nbval is installed.

pyproject's `addopts` carries `--notebooks` (defined here) instead of nbval's own flags, which pytest refuses
where nbval is missing (a GPU machine with only torch, triton, transformers and the package's dependencies).
Where nbval is installed, `--notebooks` turns on `--nbval --nbval-current-env --nbval-sanitize-with
tests/nbval_sanitize.cfg`, so a plain `pytest` still checks every notebook cell; where it is not, the
notebooks are not collected and the header says so. `-o addopts=""` (scripts/gpu_suite.sh,
scripts/browser_test.sh) or `-p no:nbval` leaves the notebooks out, as before; nbval flags given on the
command line still win.

nbval applies one sanitizer file to every cell. Here that file (tests/nbval_sanitize.cfg) masks only memory
addresses and temporary paths, so every stored number is compared; tests/nbval_timing.cfg (rates, durations) is
applied only to the cells marked as machine-dependent timings: the cell tag `timing`, or a first line that is a
comment naming it (`# timing: ...`).
"""
import importlib.util

from tests.nbval_cells import TIMING_CFG, is_timing_cell, load_sanitizers

SANITIZE = "tests/nbval_sanitize.cfg"


def _sanitize_timing_cells(config) -> None:
    """Wrap nbval's per-cell sanitizer: the timing patterns apply to timing cells only."""
    from nbval import plugin
    patterns = load_sanitizers(TIMING_CFG)
    base = plugin.IPyNbCell.sanitize
    if getattr(base, "timing_aware", False):
        return

    def sanitize(self, s):
        s = base(self, s)
        if isinstance(s, str) and is_timing_cell(self.cell):
            for regex, replace in patterns:
                s = regex.sub(replace, s)
        return s

    sanitize.timing_aware = True
    plugin.IPyNbCell.sanitize = sanitize


def pytest_addoption(parser):
    parser.addoption("--notebooks", action="store_true", default=False,
                     help=f"run every notebook with nbval (current env, {SANITIZE}) when nbval is installed; "
                          "pyproject's addopts sets it")


def nbval_active(config) -> bool:
    return config.pluginmanager.hasplugin("nbval")


def pytest_configure(config):
    if not nbval_active(config):
        return
    _sanitize_timing_cells(config)  # however nbval was asked for (--notebooks, --nbval, --nbval-lax)
    if not config.getoption("notebooks"):
        return
    opt = config.option
    if not (opt.nbval or opt.nbval_lax):  # --nbval-lax given on the command line stays lax
        opt.nbval = True
    if not opt.nbval_kernel_name:  # the two are exclusive; an explicit kernel name wins
        opt.nbval_current_env = True
    if opt.nbval_sanitize_with is None:
        opt.nbval_sanitize_with = str(config.rootpath / SANITIZE)  # from any working directory


def pytest_report_header(config):
    if not config.getoption("notebooks"):
        return None
    if nbval_active(config):
        return f"notebooks: nbval, current env, {SANITIZE}"
    if importlib.util.find_spec("nbval"):
        return "notebooks: not collected, nbval disabled (-p no:nbval)"
    return 'notebooks: not collected, nbval not installed (pip install -e ".[dev]")'
