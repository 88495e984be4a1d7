"""Config and SamplingParams validation (notebook 01)."""
import json

import pytest

from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.config import Config
from nanovllm_edu.sampling_params import SamplingParams


def test_config_reads_the_checkpoint():
    config = Config(tiny_model_path())
    assert config.hf_config.model_type == "qwen3"
    assert config.eos == (config.hf_config.eos_token_id,)
    assert config.max_model_len <= config.hf_config.max_position_embeddings


def test_max_model_len_is_clipped_to_the_model():
    config = Config(tiny_model_path(), max_model_len=10**9)
    assert config.max_model_len == config.hf_config.max_position_embeddings


def test_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Config(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        Config(str(tmp_path))


def test_non_qwen3_checkpoint_names_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="'llama'.*supports model_type 'qwen3'"):
        Config(str(tmp_path))


@pytest.mark.parametrize("kwargs, match", [
    (dict(kvcache_block_size=100), "power of two"),
    (dict(kvcache_block_size=8), "power of two"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(num_kvcache_blocks=0), "num_kvcache_blocks"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(attention_backend="xformers"), "attention_backend"),
    (dict(device="tpu"), "device"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 must divide"),
])
def test_inconsistent_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Config(tiny_model_path(), **kwargs)


def test_sampling_params_defaults():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens, sp.ignore_eos, sp.seed) == (1.0, -1, 1.0, 64, False, None)
    assert not sp.greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=0), dict(top_k=-2), dict(top_k=1.5),
    dict(top_p=0.0), dict(top_p=1.01), dict(max_tokens=0), dict(max_tokens=2.0), dict(seed=-1), dict(seed="1"),
])
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_valid_edge_sampling_params():
    SamplingParams(temperature=0, top_k=1, top_p=1.0, max_tokens=1, seed=0)
    SamplingParams(temperature=2.0, top_k=50, top_p=0.01)
