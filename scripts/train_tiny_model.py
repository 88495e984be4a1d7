"""Train the tiny Qwen3 checkpoint that nanovllm-edu ships in `nanovllm_edu/assets/tiny-qwen3`.

The corpus is the docstrings of the Python standard library of the interpreter running this script
(Python Software Foundation License 2.0): every machine with Python has it, offline. The tokenizer is a
byte-level BPE trained with the `tokenizers` library behind Qwen2's pre-tokenizer regex; the model is
transformers' own `Qwen3ForCausalLM` with a small config, trained from scratch on the CPU.

    python scripts/train_tiny_model.py --minutes 10 --out nanovllm_edu/assets/tiny-qwen3

It writes `config.json`, `model.safetensors` (float32), the tokenizer files with a Qwen-style chat
template, and `training.json` (parameters, size, time, loss, corpus) next to them.
"""
import argparse
import ast
import json
import math
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

# Qwen2's pre-tokenizer: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]
# ChatML as Qwen3 uses it, written for this project: system/user/assistant turns; with
# add_generation_prompt it opens an assistant turn, and enable_thinking=False pre-fills an empty
# <think></think> block so the model answers directly.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def stdlib_docstrings(min_chars: int = 40) -> list[str]:
    """Docstrings of modules, classes and functions in the running interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "/test", "idlelib", "lib2to3")
    docs = []
    for path in sorted(root.rglob("*.py")):
        if any(s in str(path) for s in skip):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    docs.append(doc)
    return docs


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Qwen2's pre-tokenizer; special tokens get the last ids, as in Qwen."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_added, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(THINK_TOKENS)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                     additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                     model_max_length=2048, clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def make_batches(ids: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator):
    """Endless random windows of seq_len tokens from the concatenated corpus."""
    while True:
        starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=gen)
        yield torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="nanovllm_edu/assets/tiny-qwen3")
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock training budget")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(0)
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    docs = stdlib_docstrings()
    tokenizer = train_tokenizer(docs, args.vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc))
        ids.append(eos)
    ids = torch.tensor(ids, dtype=torch.long)
    print(f"corpus: {len(docs)} docstrings, {sum(map(len, docs)) / 1e6:.2f} MB, {len(ids)} tokens; "
          f"tokenizer {time.time() - t0:.0f}s", flush=True)

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )
    config.dtype = torch.float32
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    batches = make_batches(ids, args.seq_len, args.batch_size, gen)
    budget = args.minutes * 60
    warmup = 50
    t_train = time.time()
    step, ema = 0, None
    model.train()
    while time.time() - t_train < budget:
        frac = (time.time() - t_train) / budget  # cosine schedule over wall-clock time
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        step += 1
        if step % 50 == 0:
            print(f"step {step} loss {ema:.3f} lr {lr:.2e} {time.time() - t_train:.0f}s", flush=True)
    train_seconds = time.time() - t_train
    tokens_seen = step * args.batch_size * args.seq_len

    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    report = {
        "corpus": f"docstrings of the Python {platform.python_version()} standard library "
                  "(Python Software Foundation License 2.0)",
        "corpus_docstrings": len(docs), "corpus_tokens": len(ids), "parameters": n_params,
        "vocab_size": len(tokenizer), "steps": step, "tokens_seen": tokens_seen,
        "train_seconds": round(train_seconds, 1), "final_loss_ema": round(ema, 3),
        "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "folder_bytes": size, "command": " ".join(sys.argv),
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    for prompt in ["Return the", "This module provides", "Raise ValueError if"]:
        enc = tokenizer(prompt, return_tensors="pt")
        gen_ids = model.generate(**enc, max_new_tokens=24, do_sample=False)
        print(repr(tokenizer.decode(gen_ids[0])))


if __name__ == "__main__":
    main()
