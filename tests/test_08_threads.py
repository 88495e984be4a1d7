"""Engines side by side (issue 12, item 1): two engines in two threads, and one engine from two threads,
give exactly their single-thread results."""
import threading

import pytest
import torch

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path

from helpers import make_random_qwen3_checkpoint

SMALL = dict(device="cpu", max_num_seqs=8, num_kvcache_blocks=64, kvcache_block_size=16, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run_in_threads(jobs: dict) -> dict:
    """Run each job (a list of zero-argument calls) in its own thread, all released at once; results per job."""
    barrier, results, errors = threading.Barrier(len(jobs)), {name: [] for name in jobs}, []

    def work(name):
        try:
            barrier.wait()
            for call in jobs[name]:
                results[name].append(call())
        except BaseException as err:  # noqa: BLE001 - reported in the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def calls(llm, batches):
    return [lambda b=b: [o["token_ids"] for o in llm.generate(b, GREEDY, use_tqdm=False)] for b in batches]


def test_two_engines_on_different_checkpoints_in_two_threads(tmp_path):
    engines = {
        name: LLM(str(make_random_qwen3_checkpoint(tmp_path / name, dtype=dtype, seed=seed)), **SMALL)
        for name, dtype, seed in [("f32", torch.float32, 0), ("bf16", torch.bfloat16, 1)]}
    assert engines["f32"].model_runner.dtype == torch.float32
    assert engines["bf16"].model_runner.dtype == torch.bfloat16
    batches = [[[3, 14, 15, 92, 6], [5, 35]], [[8, 9, 7, 9, 3, 2, 3]], [[84, 6], [26, 43, 38], [32, 7]], [[95, 0, 28]]]
    alone = {name: [call() for call in calls(llm, batches)] for name, llm in engines.items()}
    together = run_in_threads({name: calls(llm, batches) for name, llm in engines.items()})
    assert together == alone


def test_one_engine_from_two_threads():
    llm = LLM(tiny_model_path(), **SMALL)
    batches = {"a": [["Return the", "Create a new"], ["Raise ValueError if the"]],
               "b": [["This module provides"], ["If the file does not exist", "Return the"]]}
    alone = {name: [call() for call in calls(llm, b)] for name, b in batches.items()}
    together = run_in_threads({name: calls(llm, b) for name, b in batches.items()})
    assert together == alone
    assert llm.is_finished() and llm.block_manager.num_free_blocks == llm.model_runner.num_kvcache_blocks


def test_cpu_kv_budget_follows_the_model_size():
    """A tiny model gets a small cache by default (64 MiB), a big one at most the 1 GiB cap (and RAM / 8)."""
    from nanovllm_edu.engine.model_runner import CPU_KV_BUDGET_BYTES, _cpu_kv_budget
    assert _cpu_kv_budget(13_600_000) == 64 << 20
    assert _cpu_kv_budget(100 << 20) == min(400 << 20, _cpu_kv_budget(1 << 40))
    assert _cpu_kv_budget(1 << 40) <= CPU_KV_BUDGET_BYTES
