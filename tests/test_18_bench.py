"""The benchmark (notebook 18): workload, hardware limit, random-weight checkpoints, the CLI end to end."""
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from nanovllm_edu import SamplingParams

from nanovllm_edu.bench import (ANCHORS, ModelShape, build_random_checkpoint, checkpoint_shapes, decode_batch_sizes, fit_to_vocab,
                                hardware_limit, main, make_workload, random_weights_config, workload_cost)


def test_workload_reproduces_nano_vllm_draws():
    workload = make_workload()
    # nano-vllm's bench.py: seed(0), all prompts first, then all max_tokens
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    assert workload.prompts == prompts and workload.max_tokens == max_tokens
    assert workload.total_tokens == sum(workload.max_tokens) == 133_966 == ANCHORS["total_tokens"]
    assert workload.num_seqs == 256 and workload.temperature == 0.6


def test_workload_is_private_and_scales():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    make_workload(4)
    assert random.random() == expected  # the global stream is untouched
    small = make_workload(8, max_input_len=64, max_output_len=16)
    assert small.input_len_range == (64, 64) and small.output_len_range == (16, 16)
    assert all(len(p) == 64 for p in small.prompts) and small.total_tokens == 8 * 16
    assert make_workload(3, 500, 200).prompts == make_workload(3, 500, 200).prompts
    with pytest.raises(ValueError, match="positive"):
        make_workload(0)


def test_fit_to_vocab_keeps_lengths():
    workload = make_workload(4, 300, 120)
    folded = fit_to_vocab(workload, 4096)
    assert folded.prompt_lens == workload.prompt_lens and folded.max_tokens == workload.max_tokens
    assert max(max(p) for p in folded.prompts) < 4096
    assert fit_to_vocab(workload, 151_936) is workload


def test_hardware_limit_matches_the_design_notes():
    workload = make_workload()
    shape = ModelShape.from_config(random_weights_config("qwen3-0.6b"))
    assert shape.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2
    cost = workload_cost(shape, workload.prompt_lens, workload.max_tokens)
    assert cost["kv_bytes"] == pytest.approx(13.9e12, rel=0.01)
    assert cost["decode_steps"] == max(workload.max_tokens) - 1
    assert cost["prefill_steps"] == -(-sum(workload.prompt_lens) // 16384)
    assert cost["weight_bytes_per_step"] == pytest.approx(596e6 * 2, rel=0.01)  # every weight once per step
    limit = hardware_limit(cost, workload.total_tokens, copy_bandwidth=4.28e12, peak_flops=790e12)  # an H200, measured
    assert limit["limit_seconds"] == pytest.approx(ANCHORS["hardware_limit_seconds"], rel=0.03)
    assert limit["limit_tok_s"] == pytest.approx(ANCHORS["hardware_limit_tok_s"], rel=0.03)
    two = hardware_limit(cost, workload.total_tokens, 4.28e12, 790e12, num_gpus=2)
    assert two["limit_seconds"] == pytest.approx(limit["limit_seconds"] / 2)


def test_kv_bytes_count_each_decode_step():
    shape = ModelShape(num_layers=1, hidden=8, intermediate=16, num_heads=1, num_kv_heads=1, head_dim=1,
                       vocab=10, tied=True, dtype_bytes=1)
    # prompt 3, 4 tokens: the first comes from prefill; decode steps see contexts of 4, 5, 6 tokens
    cost = workload_cost(shape, [3], [4])
    assert cost["kv_bytes"] == (4 + 5 + 6) * 2


def test_random_checkpoint_is_loadable(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = random_weights_config("qwen3-0.6b") | {"num_hidden_layers": 2, "vocab_size": 512,
                                                     "hidden_size": 64, "intermediate_size": 128,
                                                     "num_attention_heads": 4, "num_key_value_heads": 2,
                                                     "head_dim": 16}
    folder = build_random_checkpoint(config, tmp_path / "ckpt")
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        names = set(f.keys())
        assert names == set(checkpoint_shapes(config))
        assert "lm_head.weight" not in names  # tied embeddings
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        assert q.dtype == torch.bfloat16 and q.shape == (64, 64)
        assert 0.015 < q.float().std().item() < 0.025
        assert f.get_tensor("model.layers.1.self_attn.k_norm.weight").eq(1).all()
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert hf.model.embed_tokens.weight.shape == (512, 64)
    assert torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)

    from nanovllm_edu.models.qwen3 import Qwen3ForCausalLM
    ours = Qwen3ForCausalLM.from_pretrained(folder)
    ids = torch.tensor([1, 5, 9, 200])
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours.logits(ids).float(), expected, atol=0.02, rtol=0.02)


REQUIRED_KEYS = {"device", "versions", "workload", "num_seqs", "total_tokens", "seconds", "throughput_tok_s",
                 "backend", "enforce_eager", "engine_config", "kv_bytes", "weight_bytes", "prefill_flops",
                 "copy_bandwidth", "limit_seconds", "limit_tok_s", "fraction_of_limit", "ratio_to_nano_vllm",
                 "ratio_to_nano_vllm_range", "hf_seconds", "hf_tok_s", "ratio"}


def test_cli_end_to_end_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = main(["--device", "cpu", "--num-seqs", "4", "--max-input-len", "32", "--max-output-len", "8",
                   "--max-num-seqs", "4", "--breakdown", "--compare-hf", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "Throughput:" in printed and "tok/s" in printed
    # the result is printed once, by the summary, and says what it counts
    assert printed.count("Throughput:") == 1 and "timed run" not in printed
    assert "32 completion" in printed and "128 prompt" in printed and "tok/s of completion tokens" in printed
    assert "prompts exactly 32 tokens" in printed  # the minimum followed --max-input-len, and the line says so
    record = json.loads(out.read_text())
    assert REQUIRED_KEYS <= set(record)
    assert record["completion_tokens"] == record["total_tokens"] and record["prompt_tokens"] == 4 * 32
    assert record["prompt_and_completion_tok_s"] == pytest.approx((32 + 128) / record["seconds"])
    assert record["device"] == "cpu" and record["num_seqs"] == 4
    assert record["total_tokens"] == record["generated_tokens"] == 4 * 8
    assert record["seconds"] > 0 and record["throughput_tok_s"] == pytest.approx(32 / record["seconds"])
    assert record["limit_seconds"] is None  # the limit needs a GPU
    assert record["engine_config"]["max_num_seqs"] == 4
    assert set(record["versions"]) >= {"torch", "triton", "transformers", "python"}
    assert record["workload"]["seed"] == 0 and record["workload"]["temperature"] == 0.6
    decode = record["breakdown"]["decode"]
    assert decode["steps"] == 8 - 1 and decode["forward"] > 0
    assert record["hf_seconds"] > 0 and record["ratio"] == pytest.approx(record["hf_seconds"] / record["seconds"])


def test_decode_batch_sizes_follow_the_output_lengths():
    # a request with max_tokens m gets its first token from prefill, then decodes in steps 0 .. m - 2
    assert decode_batch_sizes([1, 3, 2]) == [2, 1]
    assert decode_batch_sizes([4, 4]) == [2, 2, 2]


def test_tensor_parallel_run_records_its_collectives(tmp_path):
    result = main(["--device", "cpu", "--num-seqs", "4", "--max-input-len", "32", "--max-output-len", "8",
                   "--max-num-seqs", "4", "--tensor-parallel-size", "2", "--json", str(tmp_path / "tp.json")])
    timings = result["collectives_by_batch_size"]
    assert set(timings) == {"1", "4"}  # up to the largest decode batch of the run
    assert timings["1"]["num_all_reduces"] == 2 * 4 + 1  # the tiny model has 4 layers
    assert timings["1"]["all_reduce_seconds"] > 0 and timings["1"]["gather_seconds"] > 0
    assert result["collectives_decode_seconds_estimate"] > 0


def test_warmup_is_shaped_like_the_workload_but_not_cached():
    from nanovllm_edu.bench import warmup_workload
    workload = make_workload()
    warmup = warmup_workload(workload, 151_936)
    assert warmup.num_seqs == 32 and set(warmup.max_tokens) == {16}
    assert max(warmup.prompt_lens) <= 1024 and sum(warmup.prompt_lens) > 16384  # full-size prefill steps
    assert not {tuple(p[:16]) for p in warmup.prompts} & {tuple(p[:16]) for p in workload.prompts}


def test_min_length_follows_max_unless_given_above_it(capsys):
    from nanovllm_edu.bench import parse_args
    args = parse_args(["--max-input-len", "64", "--max-output-len", "500"])
    assert (args.min_input_len, args.max_input_len) == (64, 64)  # follows the max (the help says so)
    assert (args.min_output_len, args.max_output_len) == (100, 500)
    assert parse_args([]).min_input_len == parse_args([]).min_output_len == 100
    for kind in ("input", "output"):
        with pytest.raises(SystemExit) as exit_:
            parse_args([f"--max-{kind}-len", "64", f"--min-{kind}-len", "100"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
        assert f"--min-{kind}-len 100" in err and f"--max-{kind}-len 64" in err and "64 or less" in err
        with pytest.raises(ValueError, match=f"min_{kind}_len=100 is above max_{kind}_len=64"):
            make_workload(4, **{f"max_{kind}_len": 64, f"min_{kind}_len": 100})
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "follows the maximum" in " ".join(capsys.readouterr().out.split())
    assert make_workload(4, 500, 200).input_len_range == (100, 500)  # the seed's minimum where it fits


@pytest.mark.parametrize("argv, words", [
    (["--num-seqs", "0"], ["--num-seqs", "0"]),
    (["--max-output-len", "x"], ["--max-output-len", "'x'"]),
    (["--hf-batch-size", "-3"], ["--hf-batch-size", "-3"]),
    (["--kvcache-block-size", "7"], ["kvcache_block_size", "7"]),
    (["--gpu-memory-utilization", "1.5"], ["gpu_memory_utilization", "1.5"]),
    (["--temperature", "-1"], ["temperature", "-1"]),
    (["--max-model-len", "36", "--max-input-len", "32", "--max-output-len", "8"], ["max_model_len is 36", "40"]),
    (["--model", "/no/such/folder"], ["/no/such/folder"]),
])
def test_cli_value_errors_are_one_line_before_the_model_loads(monkeypatch, capsys, argv, words):
    import nanovllm_edu.bench.cli as cli

    def must_not_run(*args, **kwargs):
        raise AssertionError("the benchmark started despite a bad value")
    monkeypatch.setattr(cli, "run_benchmark", must_not_run)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--device", "cpu"] + argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "error:" in err and "Traceback" not in err
    assert all(word in err for word in words), err


def test_cli_engine_error_after_loading_is_one_line(capsys):
    # a cache too small for any request: only the loaded engine knows its block count; still one line, exit 2
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cpu", "--num-seqs", "2", "--max-input-len", "32", "--max-output-len", "8",
              "--kvcache-block-size", "16", "--num-kvcache-blocks", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: ") and "num_kvcache_blocks" in err


def test_named_random_checkpoint_carries_generation_config_and_qwen3_tokenizer(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from nanovllm_edu.bench import RANDOM_WEIGHTS_CONFIGS, random_weights_checkpoint
    from nanovllm_edu.engine.llm_engine import LLMEngine

    small = tmp_path / "small"
    small.mkdir()
    config = random_weights_config("qwen3-0.6b") | {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
                                                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    (small / "config.json").write_text(json.dumps(config))
    shutil.copy(Path(RANDOM_WEIGHTS_CONFIGS["qwen3-0.6b"]()).with_name("generation_config.json"), small)
    monkeypatch.setitem(RANDOM_WEIGHTS_CONFIGS, "small", lambda: str(small / "config.json"))
    folder = random_weights_checkpoint("small", tmp_path / "ckpt", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(tokenizer) == 151669 and tokenizer.eos_token_id == 151645
    engine = LLMEngine(folder, num_kvcache_blocks=8, kvcache_block_size=16, max_num_seqs=4)
    assert engine.config.eos == (151645, 151643)
    out = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 4 and out["text"] == tokenizer.decode(out["token_ids"], skip_special_tokens=True)


FIGURES = Path(__file__).resolve().parents[1] / "figures"


def test_cuda_graphs_says_whether_the_timed_run_replayed_graphs():
    """`cuda_graphs` comes from the timed run's own step counts (before, a check of a moved attribute made every
    H200 record say false), and the CLI's summary line says the same."""
    from nanovllm_edu.bench import report
    from nanovllm_edu.bench.record import replayed_graphs
    assert not replayed_graphs({})  # a CPU run, or enforce_eager: no graphs at all
    assert not replayed_graphs({"replayed_steps": 0, "full_graph_steps": 0, "piecewise_steps": 0, "eager_steps": 40})
    assert replayed_graphs({"replayed_steps": 1023, "full_graph_steps": 0, "piecewise_steps": 0, "eager_steps": 9})
    assert replayed_graphs({"replayed_steps": 0, "full_graph_steps": 0, "piecewise_steps": 3, "eager_steps": 0})
    # every committed record with step counts agrees with them
    records = [json.loads(p.read_text()) for p in sorted(FIGURES.rglob("bench*.json"))]
    counted = [r for r in records if isinstance(r, dict) and isinstance(r.get("steps"), dict)]
    assert len(counted) >= 20 and all(r["cuda_graphs"] == replayed_graphs(r["steps"]) for r in counted)
    record = json.loads((FIGURES / "bench_h200_triton_graphs_pdl_chain.json").read_text())
    assert record["cuda_graphs"] and "CUDA graphs" in report(record).splitlines()[0]
    assert "eager" in report(record | {"cuda_graphs": False}).splitlines()[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_a_gpu_record_says_cuda_graphs_when_it_replayed_them(enforce_eager):
    from nanovllm_edu.assets import tiny_model_path
    from nanovllm_edu.bench import run_benchmark
    record = run_benchmark(tiny_model_path(), make_workload(8, 32, 16),
                           {"device": "cuda", "attention_backend": "triton", "enforce_eager": enforce_eager})
    assert record["cuda_graphs"] is (not enforce_eager)
    assert (record["steps"].get("replayed_steps", 0) > 0) is (not enforce_eager), record["steps"]
