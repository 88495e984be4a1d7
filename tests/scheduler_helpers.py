"""Random workloads for the scheduler's property tests (notebook 06's separate and mixed steps)."""
import random

from nanovllm_edu.engine.sequence import Sequence
from nanovllm_edu.sampling_params import SamplingParams


def add_random_requests(sched, rng: random.Random, caching: bool, block_size: int) -> list[Sequence]:
    """Add 1-12 random requests that fit the cache (with caching on, many share a prefix); returns them."""
    shared = [rng.randrange(1, 500) for _ in range(40)]
    seqs = []
    for _ in range(rng.randint(1, 12)):
        prompt = (shared[:rng.randint(0, 40)] if caching else []) + [rng.randrange(1, 500) for _ in range(rng.randint(1, 90))]
        seq = Sequence(prompt, SamplingParams(max_tokens=rng.randint(1, 60)), block_size)
        try:
            sched.check_can_fit(seq)
        except ValueError:
            continue
        sched.add(seq)
        seqs.append(seq)
    return seqs
