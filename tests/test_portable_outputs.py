"""Stored notebook outputs are portable: a learner's fresh run prints the same text.

nbval (`pytest notebooks/`) compares every cell's stored output with a fresh run, after the sanitizers
in tests/nbval_sanitize.cfg (addresses, /tmp paths) and, in cells tagged `timing` only, tests/nbval_timing.cfg
(rates, durations); tests/nbval_cells.py says which cells are which. Learners run the course on other
CPUs, with 4-16 cores, on macOS, Windows or Linux, under another user name, with another torch or Python;
a stored output that depends on any of those passes here and fails there. This test scans every stored
output of every notebook in notebooks/ (stream text; text/plain, text/html and text/markdown of
execute_result and display_data; ename, evalue and traceback of error outputs) and fails, naming
notebook, cell index, cell id and the offending text, on:

1. float bits. A float literal (digits with a decimal point, or with an exponent: `0.6`, `1e-06`,
   `2.5e+03`; a plain integer such as a token id or a hash is not a float) printed with more than
   5 significant digits: the mantissa's digits without leading zeros and without trailing zeros,
   so `1000000.0` and `0.000100` have 1, `10768.4` has 6, `-2.016900062561035` has 16. Round to 4
   significant digits, or print a verdict against a tolerance. A number that is part of a word, a
   dotted name or a version (`cu130`, `2.11.0`, `127.0.0.1`, a hex hash such as `3e8d80f4`) is not
   a float; a decimal with a unit glued to it (`1.14x`, `4.2GB`) is one.
2. a tiny difference printed raw: a nonzero float with absolute value below 1e-4 (`3e-07`,
   `2.1e-06`, `0.00003`): such a difference is rounding noise and differs between machines. Two
   forms are a stated tolerance and pass: a mantissa of exactly 1 (`1e-06`, `1.0e-5`, `0.00001`),
   or a number that directly follows, on its line with only spaces (and an optional `=` or `:`)
   between, one of `<`, `<=`, `≤` or the words `tol`, `atol`, `rtol`, `tolerance`, `eps`,
   `epsilon`, `below`, `within`, `threshold` (`max |a-b| <= 2e-05`, `atol=5e-06`).
3. this environment's versions: a version number printed after the name of torch, Python,
   transformers, triton, numpy, CUDA, tokenizers, safetensors, nbval, ipykernel or jupyter
   (`torch 2.13.0`, `python=3.11.7`), or a torch build tag anywhere (`2.13.0+cpu`, `2.11.0+cu130`).
4. this machine's cores and threads: a count of threads, cores or CPUs (`2 thread(s)`, `16 cores`,
   `8 CPUs`) or a thread/core setting with its value (`get_num_threads() = 2`,
   `OMP_NUM_THREADS=4`, `cpu_count: 16`).
5. this machine's CPU and operating system: `platform.machine()`, `sys.platform` and
   `platform.system()` values (`x86_64`, `aarch64`, `arm64`, `AMD64`, `linux`, `darwin`, `win32`,
   `Linux`, `Darwin`, `Windows`), CPU vendors and models (`GenuineIntel`, `Intel(R)`, `Xeon`, `EPYC`,
   `Ryzen`, `Apple M2`) and torch's CPU capability names (`AVX2`, `AVX512`, `NEON`, `SVE256`).
6. this machine's file system, user and host, in every output, also where nbval does not compare it
   (a stored path shows the author's machine to every reader): an absolute path under a per-machine
   root (`/root`, `/home`, `/Users`, `/work`, `/usr`, `/opt`, `/var`, `/private`, `/mnt`, `/srv`,
   `/scratch`, `/nix`, `/Library`, `/Applications`, `/content`, `/kaggle`, `/workspace`), any
   `site-packages`/`dist-packages` path, a Windows path (`C:\\...`), a `.local`/`.lan`/`.internal`/
   `.localdomain` host name, and the running machine's own host name (when longer than 3 characters).
   `file:///home/...` and `C:/Users/...` count; `/tmp/...` paths are sanitized by nbval and pass;
   `/no/such/folder` and URL routes (`/v1/models`, `http://127.0.0.1:8000/health`) are not machine paths.

Rules 1-5 apply to the outputs nbval compares: a cell tagged `nbval-ignore-output` / `nbval-skip`, or
whose source has a `# NBVAL_IGNORE_OUTPUT` / `# NBVAL_SKIP` line, is exempt (its output is this run's,
by design), and so is an error's traceback (nbval compares its ename and evalue only); consecutive
stream outputs are joined first, as nbval joins them. The nbval sanitizers are applied first, exactly as nbval applies them (conftest.py), so a
value they replace in a timing cell (a duration such as `8.6 ms`, a rate such as `1005 tok/s`) does not count. Rules 3-5
also pass a line that says it shows a stored record rather than this machine: one containing `stored`,
`record`, `recorded`, `measured`, `corpus` or `H200` (`measured on an NVIDIA H200 (torch 2.11.0+cu130)`,
the tiny model's training corpus `docstrings of the Python 3.11.7 standard library`).
"""
from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from nbval_cells import SANITIZE_CFG, TIMING_CFG, is_ignored_cell, is_timing_cell, load_sanitizers

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SANITIZERS = load_sanitizers(SANITIZE_CFG)
TIMING_SANITIZERS = load_sanitizers(TIMING_CFG)


def sanitize(text: str, timing: bool = False) -> str:
    """`text` as nbval compares it: every cell's sanitizers, then a timing cell's."""
    for rx, rep in SANITIZERS + (TIMING_SANITIZERS if timing else []):
        text = rx.sub(rep, text)
    return text


# ---------------------------------------------------------------- rule 1 and 2: floats

FLOAT = re.compile(r"""
    (?<![\w.])                                   # not inside a word, a dotted name or a version
    (?P<num>[-+]?
      (?: (?P<mant>\d+\.\d*|\.\d+) (?:[eE](?P<exp1>[-+]?\d+))?   # 1.5, .5, 1.5e-3
        | (?P<intm>\d+) [eE](?P<exp2>[-+]?\d+) ) )                # 3e-07
    (?![\d_]|\.\d)                               # not followed by more digits or a version part
""", re.VERBOSE)
TOLERANCE_BEFORE = re.compile(
    r"(?:<=?|≤|\b(?:a|r)?tol(?:erance)?|\beps(?:ilon)?|\bbelow|\bwithin|\bthreshold)\s*[=:]?\s*$",
    re.IGNORECASE)
MAX_SIG_DIGITS = 5
TINY = 1e-4


def significant_digits(mantissa: str) -> str:
    """The significant digits of a decimal mantissa: no sign, no point, no leading or trailing zeros."""
    return mantissa.lstrip("+-").replace(".", "").lstrip("0").rstrip("0")


def float_problems(line: str) -> list[str]:
    out = []
    for m in FLOAT.finditer(line):
        exp = m.group("exp1") or m.group("exp2")
        if exp is not None and re.match(r"[A-Za-z]", line[m.end():m.end() + 1]):
            continue                        # a hex hash such as 3e8d80f4, not a float
        mant = m.group("mant") or m.group("intm")
        digits = significant_digits(mant)
        num = m.group("num")
        if len(digits) > MAX_SIG_DIGITS:
            out.append(f"float with {len(digits)} significant digits: {num!r}")
            continue
        value = float(num)
        if value != 0 and abs(value) < TINY and digits != "1" \
                and not TOLERANCE_BEFORE.search(line[:m.start()]):
            out.append(f"tiny difference printed raw (|x| < 1e-4, not a stated tolerance): {num!r}")
    return out


# ---------------------------------------------------------------- rules 3-5: this environment

RECORD_LINE = re.compile(r"\b(?:stored|records?|recorded|measured|corpus)\b|H200", re.IGNORECASE)
VERSION = re.compile(
    r"(?<![\w./-])(?:py)?(?:torch|python|cpython|transformers|triton|numpy|cuda|cudnn|tokenizers|safetensors|"
    r"nbval|ipykernel|jupyter)(?:[ \t]?(?:version|==|=|:|v|\())*[ \t]?(\d+\.\d+(?:\.\d+)?[\w.+-]*)",
    re.IGNORECASE)
BUILD_TAG = re.compile(r"(?<![\w.])\d+\.\d+(?:\.\d+)?\+(?:cpu|cu\d+|rocm[\d.]+|xpu)\b")
THREADS = re.compile(
    r"(?<![\w.])\d+\s*(?:thread\(s\)|core\(s\)|CPU\(s\)|(?:threads?|cores?|CPUs?|logical processors?)\b)"
    r"|\b(?:num_threads|get_num_threads\(\)|num_interop_threads|cpu_count\(\)|cpu_count|"
    r"OMP_NUM_THREADS|MKL_NUM_THREADS|nproc|threads|cores|CPUs)\s*[:=]\s*\d+",
    re.IGNORECASE)
PLATFORM = re.compile(
    r"\b(?:x86_64|x86-64|aarch64|arm64|AMD64|i686|linux|darwin|win32|cygwin|Linux|Darwin|Windows|macOS|"
    r"GenuineIntel|AuthenticAMD|Xeon|EPYC|Ryzen|Threadripper|Apple M\d\w*|AVX2|AVX512\w*|NEON|SVE\d*|"
    r"AMX\w*)\b|Intel\(R\)|Core\(TM\)")


def environment_problems(line: str) -> list[str]:
    if RECORD_LINE.search(line):
        return []
    out = [f"version of this environment: {m.group(0)!r}" for m in VERSION.finditer(line)]
    out += [f"torch build tag: {m.group(0)!r}" for m in BUILD_TAG.finditer(line)
            if not any(m.group(0) in o for o in out)]
    out += [f"thread/core count of this machine: {m.group(0)!r}" for m in THREADS.finditer(line)]
    out += [f"CPU or operating system of this machine: {m.group(0)!r}" for m in PLATFORM.finditer(line)]
    return out


# ---------------------------------------------------------------- rule 6: paths, users, hosts

MACHINE_ROOTS = ("root|home|Users|work|usr|opt|var|private|mnt|srv|scratch|nix|Library|Applications|"
                 "content|kaggle|workspace")
PATH = re.compile(
    rf"(?<![\w.~-])/(?:{MACHINE_ROOTS})(?=/|\b)[^\s'\"<>,;)\]]*"
    r"|[^\s'\"<>]*\b(?:site|dist)-packages\b[^\s'\"<>]*"
    r"|(?<![\w])[A-Za-z]:\\{1,2}[\w.$ -]+"
    r"|\b[\w-]+\.(?:local|lan|internal|localdomain)\b")


def _this_host() -> str | None:
    name = socket.gethostname().split(".")[0]
    return name if len(name) > 3 and name.lower() != "localhost" else None


THIS_HOST = _this_host()


def path_problems(line: str) -> list[str]:
    out = [f"machine path or host: {m.group(0)!r}" for m in PATH.finditer(line)]
    if THIS_HOST and re.search(rf"(?<![\w-]){re.escape(THIS_HOST)}(?![\w-])", line):
        out.append(f"this machine's host name: {THIS_HOST!r}")
    return out


# ---------------------------------------------------------------- the scanner

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
TEXT_MIMES = ("text/plain", "text/html", "text/markdown")
def _join(v) -> str:
    return "".join(v) if isinstance(v, list) else str(v)


def output_texts(output: dict) -> list[tuple[str, str, bool]]:
    """(where, text, compared_by_nbval) for each text of one stored output."""
    kind = output.get("output_type")
    if kind == "stream":
        return [(output.get("name", "stream"), _join(output.get("text", "")), True)]
    if kind in ("execute_result", "display_data"):
        data = output.get("data", {})
        return [(mime, _join(data[mime]), True) for mime in TEXT_MIMES if mime in data]
    if kind == "error":
        return [("ename", output.get("ename", ""), True), ("evalue", output.get("evalue", ""), True),
                ("traceback", ANSI.sub("", "\n".join(output.get("traceback", []))), False)]
    return []


def coalesce_streams(outputs: list[dict]) -> list[dict]:
    """Consecutive stream outputs of one name joined into one, as nbval compares them."""
    merged = []
    for output in outputs:
        if output.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream" \
                and merged[-1].get("name") == output.get("name"):
            merged[-1] = {**merged[-1], "text": _join(merged[-1]["text"]) + _join(output.get("text", ""))}
        else:
            merged.append(output)
    return merged


def scan_text(text: str, compared: bool, timing: bool = False) -> list[tuple[str, str]]:
    """(problem, line) pairs in one output text; `compared`: nbval compares it (rules 1-5 apply); `timing`: a
    timing cell's, whose rates and durations nbval masks."""
    problems = [(p, line) for line in text.splitlines() for p in path_problems(line)]
    if compared:                    # sanitized as a whole, as nbval does, then line by line
        problems += [(p, line) for line in sanitize(text, timing).splitlines()
                     for p in float_problems(line) + environment_problems(line)]
    return problems


def scan_notebook(nb: dict, name: str = "<notebook>") -> list[str]:
    """One message per problem: notebook, cell index and id, output, the problem, the line it is on."""
    messages = []
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        compared, timing = not is_ignored_cell(cell), is_timing_cell(cell)
        for output in coalesce_streams(cell.get("outputs", [])):
            for where, text, nbval_compares in output_texts(output):
                for problem, line in scan_text(text, compared and nbval_compares, timing):
                    messages.append(f"{name} cell {index} (id {cell.get('id', '?')}), {where}: "
                                    f"{problem} in {line.strip()[:160]!r}")
    return messages


# ---------------------------------------------------------------- the tests


def test_the_sanitizers_are_read():
    assert len(SANITIZERS) >= 2 and len(TIMING_SANITIZERS) >= 2
    text = "0x7f606382dbd0 took 8.6 ms at 1,005 tok/s in /tmp/abc"
    assert sanitize(text) == "ADDRESS took 8.6 ms at 1,005 tok/s in TMPPATH"   # numbers compared
    assert sanitize(text, timing=True) == "ADDRESS took DURATION at RATE in TMPPATH"


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_outputs_are_portable(nb_path):
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    problems = scan_notebook(nb, nb_path.name)
    assert not problems, ("stored outputs that differ on a learner's machine (see this test's docstring; "
                          "round, or print a verdict):\n" + "\n".join(problems))


def _nb(*outputs, source="print(x)", tags=None) -> dict:
    cell = {"cell_type": "code", "id": "c0ffee", "source": source, "metadata": {"tags": tags or []},
            "outputs": list(outputs)}
    return {"cells": [{"cell_type": "markdown", "source": "x"}, cell]}


def _stream(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


BAD = [
    "a: [515] [{515: -2.016900062561035}]",                     # a float32 value at full precision
    "'softmax_scale': 0.1767766952966369",
    "p [0.6000000238418579, 0.30000001192092896]",
    "max |a - b| = 3e-07",                                       # a tiny difference, raw
    "error 2.1e-06 after the kernel",
    "difference 0.00003",
    "loaded from /home/user/nanovllm-edu/notebooks",             # a home directory
    "File /root/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py",
    r"saved to C:\Users\ada\course",
    "open file:///home/ada/notes.html or C:/Users/ada/x.json",
    "torch 2.13.0 | device: cpu",                                # versions of this environment
    "built with 2.13.0+cpu",
    "python: 3.11.7",
    "Python 3.12 (main) | numpy==2.1.0 | transformers version 5.17.0",
    "TP=1 vs TP=2 (ratio 0.3, 2 thread(s))",                     # thread and core counts
    "torch.get_num_threads() = 4 | os.cpu_count: 16",
    "running on x86_64 Linux with AVX2",                         # CPU and operating system
    "rows: 10768.4",
]
GOOD = [
    "0.6",
    "tolerance 1e-06",
    "max |a-b| <= 1e-4: True",
    "rope_theta: 10000.0 | older config: 1000000.0",
    "0.000100 and 1.0e-05 and 0.0e+00",
    "max |diff| <= 2e-05 x max |ref|; atol=5e-06, rtol: 3e-06",
    "max error below 4e-05",
    "gaps: mean 0.0497, standard deviation 0.0491",
    "hash 3e8d80f4 and 1e3e6f46, id 9963129416833264760, 151,669 tokens",
    "speed-up 16.9x; 1.14x",
    "written to /tmp/tmpab12cd/online.json",
    "stored record from NVIDIA H200, 2026-12-01, torch 2.11.0+cu130",
    "corpus docstrings of the Python 3.11.7 standard library",
    "ValueError: model folder '/no/such/folder' does not exist",
    "GET /v1/models -> 200 | serving on http://127.0.0.1:PORT | http://127.0.0.1:8000/health",
    "two threads, one engine",
    "model.safetensors         13.65 MB",
    "'Return the' -> ' value of the'",
]


@pytest.mark.parametrize("text", BAD)
def test_the_scanner_catches(text):
    problems = scan_notebook(_nb(_stream(text + "\n")))
    assert problems, text
    assert "cell 1 (id c0ffee), stdout" in problems[0] and repr(text.strip()) in problems[0]


@pytest.mark.parametrize("text", GOOD)
def test_the_scanner_accepts(text):
    assert scan_notebook(_nb(_stream(text + "\n"))) == []


def test_the_scanner_reads_every_output_kind():
    bad = "0.1767766952966369"
    outputs = [
        {"output_type": "execute_result", "execution_count": 1, "metadata": {}, "data": {"text/plain": [bad]}},
        {"output_type": "display_data", "metadata": {}, "data": {"text/html": f"<b>{bad}</b>",
                                                                  "text/markdown": bad, "image/png": "iVBOR"}},
        {"output_type": "error", "ename": "ValueError", "evalue": f"got {bad}",
         "traceback": ["\x1b[0;31mFile /home/ada/x.py:3\x1b[0m"]},
    ]
    problems = scan_notebook(_nb(*outputs))
    assert [p.split(", ")[1].split(":")[0] for p in problems] == \
        ["text/plain", "text/html", "text/markdown", "evalue", "traceback"]


def test_cells_nbval_ignores_are_exempt_except_for_paths():
    out = _stream("ratio 0.2567346, 2 thread(s), in /home/ada\n")
    for kwargs in ({"tags": ["nbval-ignore-output"]}, {"source": "# NBVAL_IGNORE_OUTPUT\nprint(x)"},
                   {"tags": ["nbval-skip"]}):
        problems = scan_notebook(_nb(out, **kwargs))
        assert len(problems) == 1 and "/home/ada" in problems[0], problems
    assert len(scan_notebook(_nb(out))) == 3


def test_a_timing_cell_masks_its_rates_and_durations():
    out = _stream("took 48.571ms at 13822.3 tok/s\n")
    assert scan_notebook(_nb(out))                                        # compared exactly: 13822.3 is 6 digits
    assert scan_notebook(_nb(out, tags=["timing"])) == []
    assert scan_notebook(_nb(out, source="# timing: one step's wall clock\nprint(x)")) == []


def test_stream_chunks_are_joined_as_nbval_joins_them():
    assert scan_notebook(_nb(_stream("p = 0.17677"), _stream("66952966369\n")))
    assert scan_notebook(_nb(_stream("0.6, "), _stream("0.3\n"))) == []


def test_significant_digits():
    assert [len(significant_digits(s)) for s in ("1000000.0", "0.000100", "10768.4", "-2.016900062561035",
                                                 "0.0", "12.50")] == [1, 1, 6, 16, 0, 3]
