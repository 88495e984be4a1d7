"""Greedy completions from transformers and from our engine, for parity tests on CPU and GPU."""
import torch
from transformers import AutoModelForCausalLM

from nanovllm_edu import LLM, SamplingParams


def hf_greedy(model_path: str, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu",
              dtype: torch.dtype | None = None) -> list[list[int]]:
    """transformers' batched greedy `generate` (left padding), each row cut after its first EOS."""
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=dtype).to(device).eval()
    eos = model.config.eos_token_id
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=eos)
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def engine_greedy(model_path: str, prompts: list[list[int]], max_new_tokens: int, **engine_args) -> list[list[int]]:
    """Our engine's greedy completions (token ids) of the same prompts."""
    llm = LLM(model_path, **engine_args)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new_tokens), use_tqdm=False)
    return [o["token_ids"] for o in outs]
