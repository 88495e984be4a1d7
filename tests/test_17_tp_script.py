"""Tensor parallelism as a newcomer meets it: the README's snippet in a script without a main guard gets an
error that says what to add (and leaves no worker); Ctrl-C during a TP=2 generate leaves a usable engine."""
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from helpers import python_ctrl_c  # noqa: F401  (a fixture, used by every test here)

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.engine.tp_worker import DeferredInterrupt

PROMPTS = ["Return the", "This module provides a class that", "Create a new"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
SETTINGS = dict(max_num_seqs=16, num_kvcache_blocks=64, kvcache_block_size=16, device="cpu")

UNGUARDED = textwrap.dedent("""
    import os
    from nanovllm_edu import LLM
    from nanovllm_edu.assets import tiny_model_path
    print("script pid", os.getpid(), flush=True)
    llm = LLM(tiny_model_path(), tensor_parallel_size=2, device="cpu", num_kvcache_blocks=16,
              kvcache_block_size=16)
    print(llm.generate(["Hello"], use_tqdm=False))
""")

pytestmark = pytest.mark.usefixtures("python_ctrl_c")


def test_script_without_main_guard_is_told_what_to_add(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=90)
    assert proc.returncode == 1
    assert "MissingMainGuardError" in proc.stderr
    assert 'if __name__ == "__main__":\n        llm = LLM(path, tensor_parallel_size=2)' in proc.stderr
    assert "bootstrapping" not in proc.stderr  # multiprocessing's own message never comes
    pids = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("script pid")]
    assert len(pids) == 2  # the script and the worker that re-imported it; both are gone
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_ctrl_c_mid_step_under_tp_leaves_a_usable_engine():
    llm = LLM(tiny_model_path(), tensor_parallel_size=2, **SETTINGS)
    try:
        expected = [out["token_ids"] for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        forward, calls = llm.model_runner.forward, []

        def interrupted(step):  # rank 0's forward pass, while the worker runs the same step
            calls.append(step)
            if len(calls) == 3:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C, between two all-reduces of this step
            return forward(step)

        llm.model_runner.forward = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert len(calls) == 3  # that step ended, and no other started
        del llm.model_runner.forward
        assert llm.scheduler.is_finished()  # generate() aborted the requests
        assert not llm.model_runner.ranks.workers.closed
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [out["token_ids"] for out in again] == expected
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        llm.exit()


def test_deferred_interrupt_second_ctrl_c_and_other_threads():
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupt() as deferred:
            signal.raise_signal(signal.SIGINT)
            assert deferred.pending
            signal.raise_signal(signal.SIGINT)  # the second one does not wait
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    seen = []

    def in_a_thread():  # signal handlers belong to the main thread: the block leaves them alone
        with DeferredInterrupt() as other:
            seen.append(other.saved)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [None]
