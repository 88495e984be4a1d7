"""Tensor parallelism on CPU: every way an engine ends leaves no process behind and never hangs: exit(),
a second engine after it, an exception on rank 0 mid-step, a worker killed mid-generate, Ctrl-C in a terminal,
a killed driver. (One TP engine per process at a time, so each test builds its own.)"""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import python_ctrl_c  # noqa: F401  (a fixture, used by every test here)

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.engine.tp_worker import WorkerDiedError

PROMPTS = ["Return the", "This module provides a class that", "Create a new"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
SETTINGS = dict(max_num_seqs=16, num_kvcache_blocks=64, kvcache_block_size=16, device="cpu")

pytestmark = pytest.mark.usefixtures("python_ctrl_c")


def alive(pid: int) -> bool:
    "True while `pid` runs (a zombie waiting to be reaped counts as gone)."
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(map(alive, pids)):
            return True
        time.sleep(0.1)
    return False


def test_exit_then_a_new_engine_and_a_driver_exception():
    # automatic cache size: the ranks agree on one block count (all-reduce MIN)
    llm = LLM(tiny_model_path(), tensor_parallel_size=2, max_num_seqs=4, max_model_len=256,
              kvcache_block_size=16, device="cpu")
    assert llm.model_runner.num_kvcache_blocks == 4 * 256 // 16
    pids = llm.model_runner.ranks.workers.pids
    llm.exit()
    llm.close()  # twice is fine
    assert wait_gone(pids, 5)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)

    # the process group was destroyed, so another TP engine can start; an exception on rank 0 in the
    # middle of a step (the worker is already inside its forward pass) must not hang, nor leave the worker
    llm = LLM(tiny_model_path(), tensor_parallel_size=2, **SETTINGS)
    pids = llm.model_runner.ranks.workers.pids

    def broken(step):
        raise ValueError("driver bug")

    llm.model_runner.forward = broken  # rank 0's forward pass, after the workers got the step
    start = time.monotonic()
    with pytest.raises(ValueError, match="driver bug"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert wait_gone(pids, 5)
    assert llm.scheduler.is_finished()  # generate() aborted the requests


def test_worker_death_mid_generate_raises_within_seconds():
    llm = LLM(tiny_model_path(), tensor_parallel_size=2, **(SETTINGS | dict(num_kvcache_blocks=600)))
    pid = llm.model_runner.ranks.workers.pids[0]
    killed_at = []

    def kill_soon():
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    many = [[(7 * i + j) % 4000 for j in range(40)] for i in range(8)]  # seconds of decoding: killed mid-way
    with pytest.raises(WorkerDiedError, match="rank 1 .*exit code -9"):
        llm.generate(many, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 5
    assert llm.model_runner.ranks.workers.procs == []


DRIVER = textwrap.dedent("""
    import sys
    from nanovllm_edu import LLM, SamplingParams
    from nanovllm_edu.assets import tiny_model_path
    if __name__ == "__main__":
        llm = LLM(tiny_model_path(), tensor_parallel_size=2, num_kvcache_blocks=64, kvcache_block_size=16,
                  device="cpu")
        print("pids", *llm.model_runner.ranks.workers.pids, flush=True)
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        if sys.argv[1:] == ["raise"]:  # a bug in the user's script: Python exits through atexit
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
            raise SystemError("user bug")
        while True:
            llm.generate([[1, 2, 3]] * 8, params, use_tqdm=False)
""")


def launch_driver(tmp_path, *args: str) -> subprocess.Popen:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)  # own process group, like a terminal job


def worker_pids(proc: subprocess.Popen) -> list[int]:
    "Wait for the driver to report its workers (it then generates in a loop)."
    line = proc.stdout.readline()
    assert line.startswith("pids"), proc.stderr.read()
    time.sleep(0.5)  # let it get into a generate
    return [int(p) for p in line.split()[1:]]


def test_ctrl_c_in_a_terminal_stops_driver_and_workers(tmp_path):
    proc = launch_driver(tmp_path)
    pids = worker_pids(proc)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal sends Ctrl-C to the whole process group
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert wait_gone(pids, 10)


def test_two_engines_side_by_side_then_killed_drivers_leave_no_worker(tmp_path):
    drivers = [launch_driver(tmp_path) for _ in range(2)]  # started together: each finds its own port
    pids = [worker_pids(proc) for proc in drivers]
    for proc in drivers:
        assert proc.poll() is None, proc.stderr.read()  # both generating
        proc.kill()  # SIGKILL: no cleanup code runs in the driver
        proc.communicate(timeout=30)
    assert wait_gone(pids[0] + pids[1], 15), "a worker outlived its driver"


def test_uncaught_exception_in_the_driver_script_exits_cleanly(tmp_path):
    proc = launch_driver(tmp_path, "raise")
    pids = worker_pids(proc)
    _, err = proc.communicate(timeout=60)  # no hang at interpreter exit: weakref.finalize stops the workers
    assert proc.returncode == 1 and "SystemError: user bug" in err
    assert wait_gone(pids, 5)
