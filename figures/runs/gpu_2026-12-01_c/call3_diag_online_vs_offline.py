"""Where the online engine's burst loses time against offline generate (diagnostic, H200)."""
import json, sys, time, os
import torch
from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.bench.checkpoint import random_weights_checkpoint
from nanovllm_edu.bench.workload import make_workload
from nanovllm_edu.engine.online import OnlineLLM
import tempfile

out = {}
path = random_weights_checkpoint("qwen3-0.6b", tempfile.mkdtemp())
w = make_workload()
prompts = w.prompts
from nanovllm_edu.bench.workload import sampling_params_for
params = sampling_params_for(w)
llm = OnlineLLM(path, attention_backend="triton", max_model_len=4096)
llm.generate(prompts[:32], params[:32], use_tqdm=False)  # warm
def shift(k): return [[(t + 1 + k) % 10000 for t in p] for p in prompts]
# 1. offline generate on the same engine class (the base LLMEngine path: run steps in this thread)
t = time.perf_counter(); LLM.generate(llm, shift(1), params, use_tqdm=False); out["offline_s"] = time.perf_counter() - t
# 2. online, all submitted from this thread, results awaited
pub = {"n": 0, "s": 0.0}; orig = llm.publish
def timed():
    t0 = time.perf_counter(); orig(); pub["s"] += time.perf_counter() - t0; pub["n"] += 1
llm.publish = timed
for rep in (2, 3):
    pub.update(n=0, s=0.0)
    t = time.perf_counter(); res = llm.generate(shift(rep), params, use_tqdm=False); out[f"online_{rep}_s"] = time.perf_counter() - t
    q = sorted(r["metrics"]["first_scheduled_time"] - r["metrics"]["arrival_time"] for r in res)
    out[f"online_{rep}_queue_p50_max"] = [q[128], q[-1]]
    out[f"online_{rep}_publish"] = [pub["n"], pub["s"]]
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"), indent=1)
llm.exit()
