"""Reproducible per-member seeds: member i's randomness depends only on (seed, i)."""

import contextlib
import numbers
from collections.abc import Iterator

import numpy as np
import torch


def check_seed(where: str, seed: object) -> int:
    """``seed`` as an int if it is a valid ensemble seed (an int >= 0), else a clear error."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            f"{where}: seed must be an int >= 0 (expected an int, got "
            f"{type(seed).__name__} {seed!r}). Pass a non-negative whole number, e.g. seed=0."
        )
    if seed < 0:
        raise ValueError(
            f"{where}: seed must be an int >= 0 (expected 0 or more, got {seed}). "
            "Pass a non-negative whole number, e.g. seed=0."
        )
    return int(seed)


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
