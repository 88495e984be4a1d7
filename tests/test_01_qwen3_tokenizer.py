"""The shipped Qwen3 tokenizer (notebook 00's asset, taught in notebook 01) and the EOS ids a checkpoint names."""
import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from nanovllm_edu.assets import QWEN3_TOKENIZER_ARCHIVE, qwen3_0_6b_config_path, qwen3_tokenizer_path
from nanovllm_edu.config import Config, checkpoint_eos_ids, eos_token_ids
from nanovllm_edu.assets import tiny_model_path

# Qwen3's 26 added tokens, in id order from 151643 (as in every Qwen3 checkpoint's tokenizer.json)
ADDED_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                "<tool_response>", "</tool_response>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_path(), local_files_only=True)


def test_vocabulary_and_special_token_ids(tokenizer):
    assert tokenizer.vocab_size == 151643  # the byte-level BPE's own tokens
    assert len(tokenizer) == 151643 + len(ADDED_TOKENS)
    assert {i: t.content for i, t in tokenizer.added_tokens_decoder.items()} == dict(enumerate(ADDED_TOKENS, 151643))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 151645
    assert tokenizer.pad_token_id == 151643 and tokenizer.bos_token is None


def test_encode_decode_round_trip(tokenizer):
    assert tokenizer.encode("Hello, world!") == [9707, 11, 1879, 0]
    for text in ["def f(x):\n    return x ** 2\n", "naïve café ☕ 日本語", "  two  spaces\tand a tab", "<|im_end|>"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<|im_end|>") == [151645]  # a special token is one id, never split into bytes


def test_chat_template_with_and_without_thinking(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False) == prompt + "<think>\n\n</think>\n\n"
    reply = messages + [{"role": "assistant", "content": "<think>\nshort\n</think>\n\nHello."}]
    assert tokenizer.apply_chat_template(reply, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\nshort\n</think>\n\nHello.<|im_end|>\n")


def test_unpacked_once_into_a_cache_keyed_by_the_archive(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_EDU_CACHE", str(tmp_path))
    folder = qwen3_tokenizer_path()
    assert folder.startswith(str(tmp_path)) and sorted(p.name for p in tmp_path.iterdir()) == [folder.split("/")[-1]]
    stamp = (tmp_path / folder / "tokenizer.json").stat().st_mtime_ns
    assert qwen3_tokenizer_path() == folder and (tmp_path / folder / "tokenizer.json").stat().st_mtime_ns == stamp
    shipped = QWEN3_TOKENIZER_ARCHIVE.parent
    assert {"LICENSE", "NOTICE"} <= {p.name for p in shipped.iterdir()}
    assert "Apache License" in (shipped / "LICENSE").read_text() and "Qwen" in (shipped / "NOTICE").read_text()


def test_python_c_encodes_and_decodes(tmp_path):
    code = ("from transformers import AutoTokenizer; from nanovllm_edu.assets import qwen3_tokenizer_path; "
            "t = AutoTokenizer.from_pretrained(qwen3_tokenizer_path()); ids = t.encode('Qwen3 tokenizer'); "
            "print(ids, repr(t.decode(ids)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"NANOVLLM_EDU_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip().endswith("'Qwen3 tokenizer'")


def test_eos_ids_of_config_and_generation_config():
    qwen3 = json.loads(open(qwen3_0_6b_config_path()).read())
    assert checkpoint_eos_ids(qwen3_0_6b_config_path().rsplit("/", 1)[0], qwen3) == (151645, 151643)
    assert eos_token_ids(None) == () and eos_token_ids([7, 7, 3]) == (7, 3)
    for bad in ("2", -1, [1, -2], 2.0, True):
        with pytest.raises(ValueError, match="eos must be a token id >= 0 or a list of them"):
            eos_token_ids(bad)


def test_config_reads_both_files_and_a_user_eos_replaces_them(tmp_path):
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model_path(), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [4091, 17]}))
    assert Config(str(folder)).eos == (4091, 17)
    assert Config(str(folder), eos=5).eos == (5,) and Config(str(folder), eos=[5, 6]).eos == (5, 6)
    with pytest.raises(ValueError, match="beyond the vocabulary"):
        Config(str(folder), eos=[4096])
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json.*not valid JSON"):
        Config(str(folder))


def test_a_read_only_cache_falls_back_to_the_temporary_folder(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")  # a cache path below a file cannot be made
    monkeypatch.setenv("NANOVLLM_EDU_CACHE", str(blocked / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    folder = qwen3_tokenizer_path()
    assert folder.startswith(str(tmp_path / "tmp")) and AutoTokenizer.from_pretrained(folder).encode("Hi") == [13048]
