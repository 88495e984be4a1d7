"""Appendix A1: the lab checkers pass our implementations and name the right check for broken ones; the
student edition stubs tagged solution cells (a class may span several) and executes up to its first exercise."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

nbformat = pytest.importorskip("nbformat")  # the notebooks extra (a GPU machine may lack it)

from lab_helpers import failed_names

from nanovllm_edu.engine.block_manager import BlockManager
from nanovllm_edu.engine.scheduler import Scheduler
from nanovllm_edu.kernels.store_kvcache import store_kvcache_torch
from nanovllm_edu.labs import (
    CHECKERS,
    check_block_manager,
    check_prefix_cache,
    check_sampler,
    check_scheduler,
    check_store_kvcache,
)
from nanovllm_edu.labs.student import (
    find_notebooks,
    make_student,
    make_student_notebook,
    solution_groups,
    stub_source,
)
from nanovllm_edu.layers.sampler import Sampler

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("checker,impl", [
    (check_store_kvcache, store_kvcache_torch), (check_block_manager, BlockManager),
    (check_prefix_cache, BlockManager), (check_scheduler, Scheduler),
    (check_sampler, Sampler), (check_sampler, Sampler()),
])
def test_our_implementations_pass(checker, impl):
    report = checker(impl)
    assert report.passed is True, str(report)
    assert len(report.checks) >= 5
    assert "✗" not in str(report) and str(report).count("✓") == len(report.checks)


def test_checkers_leave_the_global_rng_alone():
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    check_sampler(Sampler)
    assert torch.equal(torch.rand(3), want)


# --- deliberately broken implementations -------------------------------------------------------------

class LeakyBlockManager(BlockManager):
    """Forgets to return the last block of every sequence."""

    def deallocate(self, seq):
        seq.block_table = seq.block_table[:-1]
        super().deallocate(seq)


def test_leaky_block_manager_fails_deallocate():
    report = check_block_manager(LeakyBlockManager)
    assert report.passed is False
    assert "deallocate returns every block" in failed_names(report)
    assert "a new pool has every block free" not in failed_names(report)
    text = str(report)
    assert "✗ deallocate returns every block" in text and "hint: every block of seq.block_table" in text
    assert "deallocate returns every block" in report._repr_html_()


class GreedyAppendBlockManager(BlockManager):
    """can_append ignores whether a block is free."""

    def can_append(self, seq):
        return True


def test_block_manager_that_overpromises_appends():
    assert "can_append says no when a needed block is missing" in failed_names(check_block_manager(GreedyAppendBlockManager))


class BudgetBlindScheduler(Scheduler):
    """Prefills every admitted prompt whole, ignoring max_num_batched_tokens."""

    def _schedule_chunk(self, seq, budget):
        seq.num_scheduled_tokens = seq.num_tokens - seq.num_computed_tokens
        self.prefilling = None
        return seq.num_scheduled_tokens


def test_scheduler_ignoring_token_budget_fails_budget_check():
    failed = failed_names(check_scheduler(BudgetBlindScheduler))
    assert "prefill chunks stay within the token budget" in failed
    assert "a long prompt is prefilled in chunks" in failed
    assert "requests finish at max_tokens or EOS and free their blocks" not in failed


class BackOfQueueScheduler(Scheduler):
    """Preempted sequences queue at the back."""

    def preempt(self, seq):
        super().preempt(seq)
        self.waiting.append(self.waiting.popleft())


def test_scheduler_preempting_to_the_back_fails():
    assert failed_names(check_scheduler(BackOfQueueScheduler)) == {"a preempted request goes back to the front of the queue"}


class TopKBlindSampler(Sampler):
    """Applies top-p but ignores top-k."""

    @staticmethod
    def apply_top_k_top_p(logits, top_ks, top_ps):
        return Sampler.apply_top_k_top_p(logits, None, top_ps)


def test_sampler_ignoring_top_k_fails_top_k():
    failed = failed_names(check_sampler(TopKBlindSampler))
    assert "top-k keeps only the k most likely tokens" in failed
    assert "temperature 0 is greedy (argmax)" not in failed and "top-p keeps only the nucleus" not in failed


def test_sampler_function_that_always_takes_argmax_fails_sampling():
    failed = failed_names(check_sampler(lambda logits, temperatures, *rest: logits.argmax(-1)))
    assert "temperature 0 is greedy (argmax)" not in failed
    assert "draws follow softmax(logits / temperature)" in failed


def store_without_skipping(key, value, k_cache, v_cache, slot_mapping):
    """Writes slot -1 too: as an index, -1 is the cache's last slot."""
    k_cache.view(-1, *k_cache.shape[-2:])[slot_mapping.long()] = key
    v_cache.view(-1, *v_cache.shape[-2:])[slot_mapping.long()] = value


def store_contiguous_copy(key, value, k_cache, v_cache, slot_mapping):
    """Writes into a copy of the cache: nothing lands."""
    store_kvcache_torch(key, value, k_cache.clone(), v_cache.clone(), slot_mapping)


def test_store_writing_padding_slots_fails_skip_check():
    failed = failed_names(check_store_kvcache(store_without_skipping))
    assert "slot -1 is skipped" in failed
    assert "each token lands in its slot" not in failed


def test_store_into_a_copy_fails_lands_check():
    report = check_store_kvcache(store_contiguous_copy)
    assert "each token lands in its slot" in failed_names(report)
    lands = next(c for c in report.checks if c.name == "each token lands in its slot")
    assert lands.detail == "K cache of layer 1, slot 0 (a slot of the batch) is wrong"  # names the first wrong slot


class UnverifiedPrefixCache(BlockManager):
    """Trusts the hash alone: a collision serves another prompt's KV."""

    def _match_prefix(self, seq):
        from nanovllm_edu.engine import block_manager
        hits, h = [], -1
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = block_manager.compute_block_hash(seq.block(i), h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1:
                break
            hits.append(block_id)
        return hits


class NoRevivePrefixCache(BlockManager):
    """Forgets every hash when a block is freed, so freed blocks never hit."""

    def _release_block(self, block):
        super()._release_block(block)
        if block.ref_count == 0 and block.hash != -1:
            self.hash_to_block_id.pop(block.hash, None)
            block.hash, block.token_ids = -1, []


def test_prefix_cache_without_token_verification_fails():
    failed = failed_names(check_prefix_cache(UnverifiedPrefixCache))
    assert "a hash hit is verified against the tokens" in failed
    assert "a shared prefix hits the cache" not in failed


def test_prefix_cache_that_drops_freed_blocks_fails_revive():
    failed = failed_names(check_prefix_cache(NoRevivePrefixCache))
    assert failed == {"a freed block still hits until it is reused"}


def test_plain_block_manager_is_not_a_prefix_cache():
    class NoPrefixCache(BlockManager):  # notebook 03's manager: it ignores the flag
        def __init__(self, num_blocks, block_size=256, enable_prefix_caching=False):
            super().__init__(num_blocks, block_size)

    assert "a shared prefix hits the cache" in failed_names(check_prefix_cache(NoPrefixCache))


def test_a_stub_fails_every_check_without_raising():
    class Stub:
        def __init__(self, num_blocks, block_size=256):
            raise NotImplementedError("Exercise: implement Stub.__init__")

    report = check_block_manager(Stub)
    assert not any(c.passed for c in report.checks)
    assert all(c.detail.startswith("NotImplementedError: Exercise") for c in report.checks)


# --- the student edition -----------------------------------------------------------------------------

def test_stub_source_keeps_signatures_docstrings_and_imports():
    src = ('import torch\n\nX = 3  # a constant\n\n\nclass A:\n    """Doc."""\n    y = 1\n\n'
           '    @property\n    def n(self) -> int:\n        """How many."""\n        return self.y\n\n'
           '    def f(self, k):\n        def inner():\n            return k\n        return inner()\n\n\n'
           'def g(a: int) -> int:\n    return a + 1\n')
    out = stub_source(src)
    compile(out, "<stub>", "exec")
    assert "import torch" in out and "X = 3  # a constant" in out and "y = 1" in out
    assert '"""How many."""' in out and "@property" in out and "def g(a: int) -> int:" in out
    assert "return" not in out and "inner" not in out
    assert out.count("raise NotImplementedError") == 3
    assert 'implement A.n (' in out and 'implement g (' in out


def test_stub_source_keeps_named_definitions():
    src = "class A:\n    def f(self):\n        return 1\n\n    def g(self):\n        return 2\n\n\ndef h():\n    return 3\n"
    out = stub_source(src, keep=frozenset({"A.g", "h"}))
    assert "return 1" not in out and "return 2" in out and "return 3" in out


def test_the_course_tags_a_solution_cell_per_checked_stage():
    tags = {}
    for path in sorted(find_notebooks().glob("[0-9]*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            for tag in cell.get("metadata", {}).get("tags", []):
                if tag.startswith("check:"):
                    tags[tag[len("check:"):].split("=")[0]] = path.name
    assert {"store_kvcache", "block_manager", "prefix_cache", "scheduler"} <= set(tags), tags
    assert set(tags) <= set(CHECKERS)


def test_stub_source_treats_patch_functions_as_methods():
    src = ('@patch\ndef f(self: A, k: int) -> int:\n    """Doc."""\n    return k\n\n\n'
           '@patch(as_prop=True)\ndef n(self: "A") -> int:\n    return 1\n\n\n'
           '@patch\ndef g(self: A):\n    return 2\n')
    out = stub_source(src, keep=frozenset({"A.g"}))
    compile(out, "<stub>", "exec")
    assert "implement A.f (" in out and "implement A.n (" in out and '"""Doc."""' in out
    assert "@patch(as_prop=True)" in out and "return k" not in out and "return 1" not in out and "return 2" in out


def _toy_notebook():
    code = nbformat.v4.new_code_cell
    return nbformat.v4.new_notebook(cells=[
        code("x = 1"),
        code("class Counter:\n    def __init__(self):\n        self.n = 0\n\n    def peek(self):\n        return self.n",
             metadata={"tags": ["solution", "keep:Counter.peek"]}),
        nbformat.v4.new_markdown_cell("a demo of the half-built class"),
        code("Counter().n"),
        code("@patch\ndef add(self: Counter, k):\n    self.n += k",
             metadata={"tags": ["solution", "check:block_manager=Counter"]}),
        code("Counter().add(1)"),
        code("def lonely():\n    return 3", metadata={"tags": ["solution"]}),  # no check: stubbed, no exercise
    ])


def test_a_class_over_several_solution_cells_is_one_exercise():
    nb = _toy_notebook()
    assert solution_groups(nb.cells) == [[1, 4], [6]]
    student, n = make_student_notebook(nb)
    assert n == 1
    tags = [c.metadata.get("tags", []) for c in student.cells]
    assert tags[1] == ["stub"] and tags[4] == ["stub"] and tags[8] == ["stub"]
    assert "return self.n" in student.cells[1].source, "keep:Counter.peek on the first cell is kept"
    assert "implement Counter.__init__ (" in student.cells[1].source
    assert "implement Counter.add (" in student.cells[4].source and "self.n += k" not in student.cells[4].source
    assert tags[3] == ["raises-exception"], "a demo between the stubs runs the half-built class"
    assert tags[0] == [] and tags[7] == [], "cells outside the exercise are left alone"
    assert tags[6] == ["exercise"] and student.cells[6].source.endswith("check_block_manager(_yours_Counter)")
    assert student.cells[1].source.splitlines()[-1].startswith("_yours_Counter = Counter  #"), "kept where defined"
    assert "The 2 cells above" in student.cells[5].source
    assert nb.cells[3].metadata == {} and nb.cells[4].metadata["tags"][0] == "solution", "original untouched"
    nbformat.validate(student)


def test_make_student_notebook_stubs_tagged_cells_and_adds_exercises():
    nb = nbformat.read(ROOT / "notebooks" / "03_paged_blocks.ipynb", as_version=4)
    student, n = make_student_notebook(nb)
    assert n == 1
    stub_ids = [i for i, c in enumerate(student.cells) if "stub" in c.metadata.get("tags", [])]
    stubs = [student.cells[i] for i in stub_ids]
    assert stubs and all("raise NotImplementedError" in c.source for c in stubs)
    assert "class BlockManager" in stubs[0].source
    assert not any("self.free_block_ids.popleft()" in c.source for c in stubs)
    block = next(c for c in student.cells if "class Block:" in c.source)  # a cell of its own, not a solution
    assert "self.ref_count = 0" in block.source and "stub" not in block.metadata.get("tags", [])
    exercise = student.cells[stub_ids[-1] + 2]
    assert exercise.metadata["tags"] == ["exercise"]
    assert exercise.source.endswith("check_block_manager(_yours_BlockManager)")
    assert "\n_yours_BlockManager = BlockManager  #" in stubs[0].source, "kept where the class is defined"
    assert all(not c.get("outputs") for c in student.cells if c.cell_type == "code")
    nbformat.validate(student)
    # the exercise is the first insertion, so the stubs keep their indices: the course notebook is untouched
    assert all("solution" in nb.cells[i].metadata["tags"] for i in stub_ids)
    assert "check:block_manager" in nb.cells[stub_ids[-1]].metadata["tags"]


def test_the_student_edition_of_16_asks_for_the_gemm_and_the_norm():
    """Lesson 16's GEMM (its kernel and wrapper, two cells) and its RMSNorm kernel are exercises; `_pdl_start`,
    the PDL helper taught later in the lesson, stays whole."""
    nb = nbformat.read(ROOT / "notebooks" / "16_decode_gemms.ipynb", as_version=4)
    student, n = make_student_notebook(nb)
    assert n == 2
    exercises = [c.source for c in student.cells if "exercise" in c.metadata.get("tags", [])]
    assert exercises[0].endswith("check_skinny_gemm(_yours_skinny_gemm)")
    assert exercises[1].endswith("check_rms_norm(_yours_rms_norm_triton)")
    stubs = "\n".join(c.source for c in student.cells if "stub" in c.metadata.get("tags", []))
    for name in ("_gemm_kernel", "_split_sum_kernel", "skinny_gemm", "_rms_norm_kernel", "rms_norm_triton"):
        assert f"implement {name} (" in stubs, name
    assert "acc_up +=" not in stubs and "inv_rms =" not in stubs and "tl.extra.cuda.gdc_wait()" in stubs
    nbformat.validate(student)


def test_make_student_cli_and_missing_notebooks(tmp_path, capsys):
    from nanovllm_edu.labs.__main__ import main

    result = subprocess.run([sys.executable, "-m", "nanovllm_edu.labs", "make-student", str(tmp_path / "out")],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "06_scheduler.ipynb: 1 exercise" in result.stdout
    assert "07_model_runner.ipynb: 1 exercise" in result.stdout  # the sampler
    assert "09_logit_processors.ipynb: 1 exercise" in result.stdout  # the penalties
    assert "16_decode_gemms.ipynb: 2 exercises" in result.stdout  # the decode GEMM and the RMSNorm kernel
    for path in sorted((tmp_path / "out").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if "stub" in cell.metadata.get("tags", []):
                compile(cell.source.replace("#|", "# |"), path.name, "exec")  # stubs are valid Python
    assert main(["make-student", str(tmp_path / "x"), "--notebooks", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "no course notebooks" in err and "--notebooks" in err


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    make_student(out)
    figures = out.parent / "figures"  # the lessons read ../figures, as an edition written inside the course does
    if not figures.exists():
        figures.symlink_to(ROOT / "figures")
    return out


@pytest.mark.parametrize("name,stage,stub", [
    ("03_paged_blocks", "block manager (03): 0/8", "BlockManager.__init__"),
    ("04_kv_cache", "KV store (04): 0/6", "store_kvcache_torch"),
    ("05_prefix_hashing", "prefix cache (05): 0/8", "BlockManager.__init__"),
    ("06_scheduler", "scheduler (06): 0/6", "Scheduler.__init__"),
    ("07_model_runner", "sampler (07): 0/6", "Sampler.forward"),
    ("09_logit_processors", "penalties (09): 0/6", "apply_penalties"),
    ("16_decode_gemms", "decode GEMM (16): 0/5", "skinny_gemm"),
], ids=["03", "04", "05", "06", "07", "09", "16"])
def test_student_notebook_executes_up_to_its_first_exercise_and_its_checks_fail_after_run_all(
        student_dir, name, stage, stub):
    """Run the student edition top to bottom (Run All, going on past errors), then its checks again: they
    must grade the stubs still (a later cell importing the course's class must not shadow the student's)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(student_dir / f"{name}.ipynb", as_version=4)
    exercises = [i for i, c in enumerate(nb.cells) if "exercise" in c.metadata.get("tags", [])]
    first = exercises[0]
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(student_dir)}})
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells[:first + 1]):
            # raises CellExecutionError on any error before the exercise, except in the cells tagged
            # raises-exception: demos between the stubbed cells of a class, which run the unwritten code
            client.execute_cell(cell, i)
        errors = [o for c in nb.cells[:first] for o in c.get("outputs", []) if o.output_type == "error"]
        # the first error is a stub's (Triton's interpreter wraps a stubbed kernel's in an InterpreterError)
        assert not errors or errors[0].ename == "NotImplementedError" or (
            errors[0].ename == "InterpreterError" and errors[0].evalue.startswith("NotImplementedError('Exercise")), \
            errors[0]
        text = cell_text(nb.cells[first])
        assert f"{stage} checks passed" in text, text
        assert f"NotImplementedError: Exercise: implement {stub} (" in text
        for i in range(first + 1, len(nb.cells)):  # the rest of Run All, going on past the stubs' errors
            try:
                client.execute_cell(nb.cells[i], i)
            except CellExecutionError:
                pass
        for i in exercises:  # the checks again, after every later cell ran: still the student's stubs
            client.execute_cell(nb.cells[i], i)
            assert re.search(r"\(\d\d[a-z]?\): 0/\d+ checks passed", cell_text(nb.cells[i])), cell_text(nb.cells[i])
        assert f"{stage} checks passed" in cell_text(nb.cells[first])


def cell_text(cell) -> str:
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.outputs)


def test_make_student_refuses_to_overwrite_without_force(tmp_path, capsys):
    from nanovllm_edu.labs.__main__ import main

    out = tmp_path / "student"
    assert main(["make-student", str(out)]) == 0
    edited = out / "03_paged_blocks.ipynb"
    edited.write_text(edited.read_text().replace("raise NotImplementedError", "pass  # my work", 1))
    capsys.readouterr()
    assert main(["make-student", str(out)]) == 1
    err = capsys.readouterr().err
    assert "--force" in err and "already holds" in err and len(err.strip().splitlines()) == 1
    assert "my work" in edited.read_text()  # nothing was overwritten
    with pytest.raises(FileExistsError, match="--force"):
        make_student(out)
    assert main(["make-student", str(out), "--force"]) == 0
    assert "my work" not in edited.read_text()


def test_labs_cli_without_nbformat_names_the_extra(tmp_path, monkeypatch, capsys):
    """Without nbformat (installed without the notebooks extra) the CLI says what to install, in one line."""
    from nanovllm_edu.labs.__main__ import main

    monkeypatch.setitem(sys.modules, "nbformat", None)  # `import nbformat` now raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "nanovllm_edu.labs.student")
    assert main(["make-student", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and 'pip install -e ".[notebooks]"' in err and "nbformat" in err
