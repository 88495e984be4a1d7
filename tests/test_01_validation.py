"""Issue 12, item 2: every bad setting is refused in the constructor, by name, before any work (notebook 01).

One table: (what is built, its arguments, a regex the message must match). Each message names the argument
and the value; the regex also pins the part that says what to pass instead."""
import json

import pytest

from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.config import Config, check_bool, is_int, is_real
from nanovllm_edu.sampling_params import MAX_SEED, SamplingParams

TINY = str(tiny_model_path())

CASES = [
    # SamplingParams: a bool is not a number, a string is not a bool, seeds fit the sampler's int64
    (SamplingParams, dict(max_tokens=True), r"max_tokens must be an integer >= 1, got True"),
    (SamplingParams, dict(temperature=True), r"temperature must be a finite number >= 0.*got True"),
    (SamplingParams, dict(temperature="0.5"), r"temperature must be a finite number.*got '0.5'"),
    (SamplingParams, dict(top_p=True), r"top_p must be in \(0, 1\].*got True"),
    (SamplingParams, dict(top_k=True), r"top_k must be -1 \(disabled\) or an integer >= 1, got True"),
    (SamplingParams, dict(ignore_eos="no"), r"ignore_eos must be True or False, got 'no'"),
    (SamplingParams, dict(ignore_eos=0), r"ignore_eos must be True or False, got 0"),
    (SamplingParams, dict(seed=2**63), r"seed must be None or an integer in 0\.\.2\*\*63-1.*got 9223372036854775808"),
    (SamplingParams, dict(seed=True), r"seed must be None or an integer in 0\.\.2\*\*63-1.*got True"),
    (SamplingParams, dict(seed=-1), r"seed must be .*0\.\.2\*\*63-1.*got -1"),
    # Config: the same strictness, checked before the checkpoint's config is read
    (Config, dict(max_num_seqs=True), r"max_num_seqs must be a positive integer, got True"),
    (Config, dict(max_num_batched_tokens="512"), r"max_num_batched_tokens must be a positive integer, got '512'"),
    (Config, dict(max_model_len=2048.0), r"max_model_len must be a positive integer, got 2048.0"),
    (Config, dict(tensor_parallel_size=True), r"tensor_parallel_size must be a positive integer, got True"),
    (Config, dict(kvcache_block_size="16"), r"kvcache_block_size must be a power of two >= 16.*got '16'"),
    (Config, dict(kvcache_block_size=True), r"kvcache_block_size must be a power of two >= 16.*got True"),
    (Config, dict(num_kvcache_blocks=2.5), r"num_kvcache_blocks must be -1 \(automatic\) or an integer >= 1, got 2.5"),
    (Config, dict(num_kvcache_blocks=True), r"num_kvcache_blocks must be .*got True"),
    (Config, dict(gpu_memory_utilization="x"), r"gpu_memory_utilization must be a number in \(0, 1\], got 'x'"),
    (Config, dict(gpu_memory_utilization=True), r"gpu_memory_utilization must be a number in \(0, 1\], got True"),
    (Config, dict(gpu_memory_utilization=float("nan")), r"gpu_memory_utilization must be a number in \(0, 1\], got nan"),
    (Config, dict(enforce_eager="yes"), r"enforce_eager must be True or False, got 'yes'.*pass enforce_eager=True or"),
    (Config, dict(async_scheduling="false"), r"async_scheduling must be True or False, got 'false'"),
    (Config, dict(enable_prefix_caching=1), r"enable_prefix_caching must be True or False, got 1"),
    (Config, dict(eos="2"), r"eos must be a token id.*got '2'"),
    (Config, dict(model=None), r"model must be a checkpoint folder path \(str or Path\), got None"),
]


@pytest.mark.parametrize("cls, kwargs, match", CASES, ids=[f"{c.__name__}-{next(iter(k))}={next(iter(k.values()))!r}"
                                                          for c, k, _ in CASES])
def test_bad_setting_is_refused_by_name(cls, kwargs, match):
    if cls is Config and "model" not in kwargs:
        kwargs = dict(model=TINY, **kwargs)
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_config_checks_types_before_reading_the_checkpoint(monkeypatch):
    import nanovllm_edu.config as config_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the settings were checked")
    monkeypatch.setattr(config_module.AutoConfig, "from_pretrained", must_not_run)
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        Config(TINY, num_kvcache_blocks=2.5)


def test_the_edges_still_pass():
    SamplingParams(seed=MAX_SEED, temperature=0, top_p=1, max_tokens=1, ignore_eos=True)
    SamplingParams(seed=0, temperature=0.7, top_p=0.5)
    Config(TINY, gpu_memory_utilization=1, num_kvcache_blocks=1, enforce_eager=True, async_scheduling=False)
    assert (is_int(3), is_int(True), is_real(0.5), is_real("0.5"), check_bool("x", False)) == (True, False, True, False, False)


def test_a_model_path_that_is_a_file_says_so(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"is a file, not a folder.*perhaps"):
        Config(str(file))


@pytest.mark.parametrize("text, match", [('{"model_type": "qwen3",', r"config\.json' is not valid JSON"),
                                         ("[1, 2]", r"config\.json' holds a list, not a JSON object")])
def test_an_invalid_config_json_names_the_file(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        Config(str(tmp_path))
    assert str(tmp_path / "config.json") in str(err.value)


def test_a_valid_config_json_still_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="supports model_type 'qwen3'"):  # parsed, then judged
        Config(str(tmp_path))
