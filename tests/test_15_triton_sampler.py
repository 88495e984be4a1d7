"""Notebook 15: the one-pass sampler (kernels/sampling.py, layers/triton_sampler.py) against notebook 07's Sampler: on a CPU through Triton's
interpreter at small sizes, on a GPU (`-m gpu`) at Qwen3's vocabulary and the benchmark's batch."""
import pytest
import torch

from nanovllm_edu.kernels.sampling import race_sample
import inspect
from dataclasses import fields

from nanovllm_edu.layers.sampler import SAMPLER_ARGS, SAMPLERS, Sampler, SamplingInputs, make_sampler, register_sampler
from nanovllm_edu.layers.sampling_features import apply_min_p, apply_penalties
from nanovllm_edu.layers.triton_sampler import TritonSampler, top_k_top_p_thresholds

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TEMPS = [0.0, 0.6, 1.0, 1.5, 0.6, 2.0, 0.8, 1.0]


def mixed_batch(batch: int, vocab: int, device: str = "cpu", dtype=torch.bfloat16, seed: int = 0):
    """Logits, temperatures (one greedy row in eight), seeds (all rows) and positions."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype).to(device)
    temps = torch.tensor([TEMPS[i % 8] for i in range(batch)], device=device)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen).to(device)
    positions = torch.randint(0, 40_000, (batch,), generator=gen).to(device)
    return logits, temps, seeds, positions


TOP = {"plain": lambda ks, ps: {},
       "top_k": lambda ks, ps: dict(top_ks=ks, top_k_max=int(ks.max())),
       "top_k_top_p": lambda ks, ps: dict(top_ks=ks, top_ps=ps, top_k_max=int(ks.max())),
       "top_p": lambda ks, ps: dict(top_ps=ps)}


def asks(name: str, batch: int, device: str) -> dict:
    ks = torch.tensor([[20, 5, 1, 3, 20, 40, 20, 2][i % 8] for i in range(batch)], device=device)
    ps = torch.tensor([[0.95, 0.9, 1.0, 0.5, 0.95, 0.8, 1.0, 0.95][i % 8] for i in range(batch)], device=device)
    return TOP[name](ks, ps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(TOP))
def test_seeded_rows_equal_the_reference(name, dtype):
    logits, temps, seeds, positions = mixed_batch(8, 3000, dtype=dtype)
    kw = asks(name, 8, "cpu")
    fast = TritonSampler()(logits, temps, seeds=seeds, positions=positions, **kw)
    reference = Sampler()(logits, temps, seeds=seeds, positions=positions, seeded_rows=torch.arange(8), **kw)
    assert torch.equal(fast, reference)


def test_a_seeded_row_does_not_depend_on_its_batch_or_the_step_seed():
    logits, temps, seeds, positions = mixed_batch(4, 3000)
    seeds[0] = -1  # an unseeded neighbour
    together = race_sample(logits, temps, 1, seeds, positions)
    for row in (1, 2, 3):
        alone = race_sample(logits[row:row + 1], temps[row:row + 1], 999, seeds[row:row + 1], positions[row:row + 1])
        assert alone.item() == together[row].item()


def test_greedy_rows_break_ties_like_argmax():
    logits = torch.zeros(3, 9000, dtype=torch.bfloat16)
    logits[0, [4500, 8100]] = 2.0  # the two maxima sit in different tiles
    logits[1, [7, 8]] = 1.0
    logits[2] = -1.0  # every token ties
    assert race_sample(logits, torch.zeros(3), 0).tolist() == logits.argmax(dim=-1).tolist() == [4500, 7, 0]


def test_unseeded_rows_follow_the_softmax_and_change_with_the_step_seed():
    row = torch.tensor([1.5, 1.0, 0.0, -1.0, 0.5])
    many = row.expand(500, 5).contiguous()
    first = race_sample(many, torch.ones(500), step_seed=1)
    freq = torch.bincount(first, minlength=5) / 500
    assert torch.allclose(freq, torch.softmax(row, -1), atol=0.07)  # ~3 standard deviations of 500 draws
    assert not torch.equal(first, race_sample(many, torch.ones(500), step_seed=2))


def test_penalised_and_min_p_logits_sample_like_the_reference():
    """The runner applies penalties and min_p before the sampler (float32 logits, -inf where min_p masks)."""
    logits, temps, seeds, positions = mixed_batch(4, 2000, dtype=torch.float32)
    counts = torch.randint(0, 3, (4, 2000), dtype=torch.int32)
    shaped = apply_penalties(logits, counts, counts > 1, torch.full((4,), 0.5), torch.full((4,), 0.2),
                             torch.full((4,), 1.3))
    shaped = apply_min_p(shaped, temps[:4], torch.tensor([0.1, 0.0, 0.3, 0.05]))
    fast = TritonSampler()(shaped, temps[:4], seeds=seeds[:4], positions=positions[:4])
    assert torch.equal(fast, Sampler()(shaped, temps[:4], seeds=seeds[:4], positions=positions[:4],
                                       seeded_rows=torch.arange(4)))


def test_thresholds_keep_what_the_reference_keeps():
    logits, temps, _, _ = mixed_batch(8, 3000, dtype=torch.float32)
    temps = temps.clamp(min=0.5)
    for name in ("top_k", "top_k_top_p", "top_p"):
        kw = asks(name, 8, "cpu")
        scaled = logits / temps.unsqueeze(1)
        kept = Sampler.apply_top_k_top_p(scaled, kw.get("top_ks"), kw.get("top_ps")) > float("-inf")
        thresholds = top_k_top_p_thresholds(logits, temps, kw.get("top_ks"), kw.get("top_ps"), kw.get("top_k_max"))
        assert torch.equal(kept, logits >= thresholds.unsqueeze(1)), name


@pytest.mark.parametrize("sampler", [Sampler, TritonSampler])
def test_both_samplers_take_the_sampling_inputs_fields_in_order(sampler):
    args = list(inspect.signature(sampler.forward).parameters)[2:]  # after self and logits
    assert args == [f.name for f in fields(SamplingInputs)[:SAMPLER_ARGS]]


def test_sampling_inputs_draw_the_same_tokens_as_keywords():
    logits, temps, seeds, positions = mixed_batch(8, 300)
    inputs = SamplingInputs(temps, top_ks=torch.full((8,), 40), seeds=seeds, positions=positions,
                            seeded_rows=torch.arange(8), top_k_max=40)
    by_keywords = Sampler()(logits, temps, top_ks=inputs.top_ks, seeds=seeds, positions=positions,
                            seeded_rows=inputs.seeded_rows, top_k_max=40)
    assert torch.equal(Sampler()(logits, *inputs.sampler_args()), by_keywords)


def test_make_sampler_picks_the_registered_sampler_for_the_device():
    assert type(make_sampler(torch.device("cpu"))) is Sampler  # nothing registered for a CPU
    assert type(make_sampler(torch.device("cuda"))) is TritonSampler  # registered on import (llm.py imports it)

    class Mine(Sampler):
        pass

    register_sampler("mine", Mine, lambda device: device.type == "cpu")
    try:
        assert type(make_sampler(torch.device("cpu"))) is Mine  # the latest registration that runs on it
        assert type(make_sampler(torch.device("cuda"))) is TritonSampler
    finally:
        del SAMPLERS["mine"]


def test_the_package_llm_registers_the_one_pass_sampler_in_a_fresh_process():
    import subprocess
    import sys
    code = ("import torch, nanovllm_edu.llm; from nanovllm_edu.layers.sampler import make_sampler; "
            "print(type(make_sampler(torch.device('cuda'))).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "TritonSampler"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(TOP))
def test_full_vocabulary_on_the_gpu_equals_the_reference(name):
    torch.manual_seed(0)
    logits, temps, seeds, positions = mixed_batch(256, 151_936, "cuda")
    kw = asks(name, 256, "cuda")
    fast = TritonSampler()(logits, temps, seeds=seeds, positions=positions, **kw)
    reference = Sampler()(logits, temps, seeds=seeds, positions=positions, seeded_rows=torch.arange(256, device="cuda"),
                          **kw)
    # near-ties of the race in float32 could split the two (log space vs probability space): none expected
    assert (fast != reference).sum().item() == 0


@pytest.mark.gpu
@needs_cuda
def test_unseeded_draws_on_the_gpu_follow_the_softmax():
    row = torch.tensor([1.5, 1.0, 0.0, -1.0, 0.5, 0.2, -0.3, 2.0], device="cuda")
    n = 200_000
    draws = race_sample(row.expand(n, 8).contiguous().to(torch.bfloat16), torch.full((n,), 0.8, device="cuda"), 123)
    freq = torch.bincount(draws, minlength=8).float() / n
    expected = torch.softmax(row.to(torch.bfloat16).float() / 0.8, -1)
    assert (freq - expected).abs().max().item() < 0.005  # ~5 standard deviations of 2 * 10^5 draws


def test_a_uniform_that_rounds_to_one_cannot_pick_a_masked_token():
    """Seed 23 at position 7 hashes token 63364 to x >= 2^32 - 128, where (x + 0.5) / 2^32 rounds to 1.0 in
    float32. Unclamped, E = -log(1) = -0.0 and a masked token races 0 / -0.0 = NaN, which argmax picks."""
    from nanovllm_edu.layers.sampler import hash_uniform
    seeds, positions = torch.tensor([23]), torch.tensor([7])
    assert hash_uniform(seeds, positions, 63_365)[0, 63_364].item() < 1.0
    logits = torch.randn(1, 64_000, generator=torch.Generator().manual_seed(1))
    logits[0, 63_364] = -5.0  # far outside the top 5
    top5 = set(logits[0].topk(5).indices.tolist())
    kw = dict(seeds=seeds, positions=positions, top_ks=torch.tensor([5]), top_k_max=5)
    reference = Sampler()(logits, torch.ones(1), seeded_rows=torch.tensor([0]), **kw)
    fast = TritonSampler()(logits, torch.ones(1), **kw)
    assert reference.item() in top5 and fast.item() == reference.item()


def test_both_samplers_keep_every_token_that_ties_with_the_last_kept():
    logits = torch.zeros(1, 5000, dtype=torch.bfloat16)
    logits[0, :3], logits[0, 10:14] = 2.0, 1.0  # three best, then a four-way tie across the top-5 boundary
    kw = dict(top_ks=torch.tensor([5]), top_k_max=5)
    kept = Sampler.apply_top_k_top_p(logits.float(), kw["top_ks"], None) > float("-inf")
    assert kept[0].nonzero().flatten().tolist() == [0, 1, 2, 10, 11, 12, 13]
    for position in range(40):
        seeds, positions = torch.tensor([3]), torch.tensor([position])
        reference = Sampler()(logits, torch.ones(1), seeds=seeds, positions=positions, seeded_rows=torch.tensor([0]), **kw)
        assert TritonSampler()(logits, torch.ones(1), seeds=seeds, positions=positions, **kw).item() == reference.item()
