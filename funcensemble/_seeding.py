"""Reproducible per-member seeds: member i's randomness depends only on (seed, i)."""

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def member_seed(seed: int, index: int) -> int:
    """A 63-bit seed for member ``index``, independent of every other member's.

    Uses NumPy's ``SeedSequence`` spawn keys, so seeds for different indices are
    statistically independent and adding members never changes existing ones.
    """
    state = np.random.SeedSequence(entropy=seed, spawn_key=(index,)).generate_state(2)
    return int(state[0]) << 31 ^ int(state[1])


@contextlib.contextmanager
def seeded_cpu_rng(seed: int) -> Iterator[None]:
    """Run a block with the global CPU generator seeded, then restore its state."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        yield
