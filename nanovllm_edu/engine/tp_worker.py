# header
__all__ = ['TP_TIMEOUT_S', 'STARTUP_TIMEOUT_S', 'WAIT_POLL_S', 'WorkerDiedError', 'check_tp_devices', 'rank_device',
           'init_process_group', 'worker_main', 'leave_process_group', 'shutdown_workers', 'WorkerGroup',
           'TensorParallelMixin']

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import Config
from ..utils.device import resolve_device

# A collective that waits longer than this fails instead of hanging forever (a backstop: gloo notices a
# dead peer at once, NCCL only through this timeout). Model loading and CUDA-graph capture run inside it.
TP_TIMEOUT_S = float(os.environ.get("NANOVLLM_EDU_TP_TIMEOUT", "300"))
STARTUP_TIMEOUT_S = 120.0  # spawning a worker imports torch and transformers afresh
WAIT_POLL_S = 50e-6  # how often rank 0 looks at the workers while it waits for the GPU


class WorkerDiedError(RuntimeError):
    "A tensor-parallel worker process ended while the engine needed it."


def check_tp_devices(tp_size: int, device: torch.device, num_gpus: int | None = None) -> None:
    "A clear error before any process starts: on CUDA every rank needs a GPU of its own."
    if device.type != "cuda":
        return
    num_gpus = torch.cuda.device_count() if num_gpus is None else num_gpus
    if tp_size > num_gpus:
        raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs but {num_gpus} "
                         f"{'is' if num_gpus == 1 else 'are'} visible; lower tensor_parallel_size or check "
                         "CUDA_VISIBLE_DEVICES")


def rank_device(device: torch.device, rank: int) -> torch.device:
    "The device of `rank`: GPU number `rank` on CUDA (made current, as NCCL expects), else the CPU."
    if device.type != "cuda":
        return device
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def init_process_group(rank: int, world_size: int, store: dist.Store, device: torch.device) -> None:
    "Join the default process group: NCCL between GPUs, gloo on a CPU."
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=TP_TIMEOUT_S))

# %%
def worker_main(config: Config, rank: int, port: int, conn: mp.connection.Connection, runner_class: type) -> None:
    """Entry point of ranks 1..N-1 (spawned by WorkerGroup): build this rank's `runner_class` runner, then
    run rank 0's commands until "exit": ("run", step inputs) runs a step, ("call", fn, args) runs
    fn(runner, *args) on every rank together (e.g. a benchmark of the collectives)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches every process: rank 0 decides
    world_size = config.tensor_parallel_size
    device = resolve_device(config.device)
    if device.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    store.set(f"alive{rank}", "1")  # rank 0 waits for this, watching that we did not die on the way
    init_process_group(rank, world_size, store, rank_device(device, rank))
    runner, told_to_exit = None, False
    try:
        runner = runner_class(config, rank)
        while True:
            try:
                command, *args = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0 is gone without saying goodbye (killed): nothing more will come
                break
            if command == "exit":
                told_to_exit = True
                break
            if command == "run":
                runner.execute(*args)
            else:  # "call"
                fn, fn_args = args
                fn(runner, *fn_args)
    finally:
        if runner is not None:
            runner.exit()  # its CUDA graphs hold NCCL kernels: they go before the process group does
        del runner
        leave_process_group(graceful=told_to_exit)

# %% ../../notebooks/09_tensor_parallel.ipynb #b2ca1e0a
def leave_process_group(graceful: bool = True) -> None:
    """Leave the default process group, if this process is in one. Gracefully, after this rank's device work
    is done, while the other ranks do the same (NCCL tears a communicator down with all its ranks); else,
    when a peer may be dead or stuck in a collective, NCCL's communicator is aborted instead of waited for."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    nccl = dist.get_backend() == "nccl"
    if nccl and not graceful:
        dist.distributed_c10d._abort_process_group()
        return
    if nccl:
        torch.cuda.synchronize()
    dist.destroy_process_group()


def shutdown_workers(procs: list, conns: list, graceful: bool = True) -> None:
    """Stop the workers: ask politely ("exit") when they are idle and leave the process group with them,
    else (or if they do not stop within seconds) terminate them and abandon the group. Idempotent."""
    if graceful:
        for conn in conns:
            try:
                conn.send_bytes(pickle.dumps(("exit", ())))
            except (OSError, ValueError):  # that worker is already gone
                pass
    leave_process_group(graceful)
    if graceful:
        deadline = time.monotonic() + 10
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():  # stuck in a collective that rank 0 abandoned, or not listening
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1: start them, run each step on all ranks, notice a dead worker,
    shut down cleanly (on exit(), garbage collection, interpreter exit, or a failed step)."""

    def __init__(self, config: Config, device: torch.device, runner_class: type):
        world_size = config.tensor_parallel_size
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group (another "
                               "tensor-parallel LLM?); call exit() on that LLM first")
        # port 0: the OS picks a free port and the store holds it, so two engines never collide
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        ctx = mp.get_context("spawn")  # a fresh interpreter: forking a process holding CUDA or threads is unsafe
        self.procs, self.conns = [], []
        self.closed = False
        self._finalizer = weakref.finalize(self, shutdown_workers, self.procs, self.conns)
        try:
            for rank in range(1, world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(config, rank, self.store.port, child_end, runner_class),
                                   name=f"nanovllm-edu-tp{rank}", daemon=True)
                proc.start()
                child_end.close()  # only the worker holds it now: its death closes the pipe for us
                self.procs.append(proc)
                self.conns.append(parent_end)
            self._wait_started()
            init_process_group(0, world_size, self.store, device)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def _wait_started(self) -> None:
        "Wait until every worker has reached the store, failing fast if one dies on the way."
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        keys = [f"alive{rank}" for rank in range(1, len(self.procs) + 1)]
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def dead_workers(self) -> str:
        "The workers that have ended, as 'rank 1 (exit code -9)', or '' when all are alive."
        return ", ".join(f"rank {rank} (exit code {proc.exitcode})" for rank, proc in enumerate(self.procs, 1)
                         if not proc.is_alive())

    def check_alive(self) -> None:
        "Raise WorkerDiedError if a worker has ended."
        if dead := self.dead_workers():
            raise WorkerDiedError(f"tensor-parallel worker {dead} died; the engine is shut down, "
                                  "create a new LLM")

    def send(self, command: str, *args) -> None:
        "Send one command to every worker (pickled once)."
        message = pickle.dumps((command, *args), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(message)

    def run_step(self, run_local, step) -> object:
        """Send the step's inputs to the workers, then run `run_local()` here: the ranks meet in the forward
        pass's collectives."""
        def run():
            self.send("run", step)
            return run_local()
        return self._guarded(run)

    def wait(self, event: torch.cuda.Event) -> None:
        """Wait for rank 0's device work up to `event` while watching the workers: if one dies, NCCL would
        wait for it forever (until its timeout); this raises WorkerDiedError instead."""
        def poll():
            while not event.query():
                self.check_alive()
                time.sleep(WAIT_POLL_S)
        self._guarded(poll)

    def call(self, fn, runner, *args) -> object:
        """Run `fn(runner, *args)` on every rank together (`fn` must be importable by name: it is pickled);
        rank 0's result comes back."""
        self.send("call", fn, args)
        return self._guarded(lambda: fn(runner, *args))

    def _guarded(self, fn):
        """Run `fn()`. Any failure leaves the ranks out of step, so it shuts the group down before it
        propagates (a dead worker becomes WorkerDiedError)."""
        if self.closed:
            raise RuntimeError("this engine's tensor-parallel workers were shut down (exit(), or an earlier "
                               "failure); create a new LLM")
        try:
            self.check_alive()
            return fn()
        except BaseException as err:
            if not isinstance(err, WorkerDiedError):
                for proc in self.procs:  # a worker killed mid-step may not be reaped yet: give it a moment
                    proc.join(timeout=0.2)
            dead = self.dead_workers()
            self.shutdown(graceful=False)
            if dead and not isinstance(err, WorkerDiedError):
                raise WorkerDiedError(f"tensor-parallel worker {dead} died; the engine is shut down, "
                                      "create a new LLM") from err
            raise

    def shutdown(self, graceful: bool = True) -> None:
        "Stop every worker and leave the process group; safe to call twice."
        self.closed = True
        if graceful:
            self._finalizer()  # runs shutdown_workers once, and never again at exit
        else:
            self._finalizer.detach()
            shutdown_workers(self.procs, self.conns, graceful=False)

# %%
class TensorParallelMixin:
    """Runner side of tensor parallelism: every rank's runner holds its shard of the model and of the KV
    cache. Rank 0's starts ranks 1..N-1 (`WorkerGroup`) and sends them each step's inputs; all run the
    forward pass together and meet in its all-reduces. Under async scheduling rank 0 broadcasts each
    step's sampled tokens, so every rank can gather the next step's pending inputs itself."""
    workers: WorkerGroup | None = None

    def __init__(self, config: Config, rank: int = 0, device: torch.device | None = None):
        tp_size = config.tensor_parallel_size
        self.share_sampled = tp_size > 1 and config.async_scheduling
        if tp_size > 1:
            device = resolve_device(config.device)
            check_tp_devices(tp_size, device)  # before any process starts
            device = rank_device(device, rank)  # cuda:rank, made current before NCCL starts
            if rank == 0:
                self.workers = WorkerGroup(config, device, type(self))  # joined in one process group
        try:
            super().__init__(config, rank, device)
        except BaseException:
            if self.workers is not None:  # no worker outlives a runner that failed to start
                self.workers.shutdown(graceful=False)
            raise

    def kv_cache_blocks(self) -> int:
        num_blocks = super().kv_cache_blocks()
        if self.tp_size > 1:  # block ids mean the same slots on every rank: all take the smallest cache
            agreed = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            num_blocks = int(agreed.item())
        return num_blocks

    def execute(self, step, sampling: dict | None = None):
        run_local = super().execute
        if self.workers is None:  # one rank, or a worker: rank 0 sent us this step
            return run_local(step, sampling)
        return self.workers.run_step(lambda: run_local(step, sampling), step)

    def sample(self, logits, sampling: dict | None, num_rows: int):
        tokens = super().sample(logits, sampling, num_rows)
        if self.share_sampled:
            if tokens is None:  # a worker: the logits were gathered on rank 0
                tokens = torch.empty(num_rows, dtype=torch.int64, device=self.device)
            dist.broadcast(tokens, src=0)
        return tokens

    def wait_event(self, event) -> None:
        if self.workers is None:
            return super().wait_event(event)
        self.workers.wait(event)  # watching the workers: a dead one must not leave us waiting forever

    def exit(self) -> None:
        super().exit()
        if self.workers is not None:
            self.workers.shutdown()
