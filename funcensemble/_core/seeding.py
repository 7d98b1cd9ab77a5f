"""Reproducible per-member seeds: member i's randomness depends only on (seed, i)."""

import contextlib
import numbers
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

T = TypeVar("T")


def check_seed(where: str, seed: object, *, none_ok: bool = False) -> int:
    """``seed`` as an int if it is a valid ensemble seed (an int >= 0), else a clear error.

    With ``none_ok``, the type error says that None (the caller's other choice) is allowed.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        also = " or None" if none_ok else ""
        raise TypeError(
            f"{where}: seed must be an int >= 0{also} (expected an int{also}, got "
            f"{type(seed).__name__} {seed!r}). Pass a non-negative whole number, e.g. seed=0"
            + (", or None to draw from the global torch generator." if none_ok else ".")
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
def seeded_rng(seed: int) -> Iterator[None]:
    """Run a block with the global CPU generator seeded, and every CUDA device's where
    CUDA is initialized, then restore their states."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed_all(seed)
        yield


def build_seeded(factory: Callable[[], T], seed: int) -> T:
    """``factory()`` with the generators it draws from seeded from ``seed`` (see
    [`seeded_rng`][]). A factory that starts CUDA itself drew there from torch's default
    seed, the same in every process and for every member: it is called once more, now
    with CUDA's generators seeded too."""
    cuda_before = torch.cuda.is_initialized()
    with seeded_rng(seed):
        built = factory()
    if not cuda_before and torch.cuda.is_initialized():
        with seeded_rng(seed):
            built = factory()
    return built


@contextlib.contextmanager
def global_rng_restored_on_error() -> Iterator[None]:
    """Run a block; if it raises, put the global CPU (and initialized CUDA) generators
    back as they were, so a refused call leaves the user's random stream untouched."""
    cpu = torch.random.default_generator.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    except BaseException:
        torch.random.default_generator.set_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        raise


def rng_state(device: torch.device) -> list[Tensor]:
    """The CPU generator's state, and ``device``'s if it is a CUDA device: what one
    random draw there reads, to replay it (chunks, shards with randomness="same")."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def set_rng_state(device: torch.device, states: list[Tensor]) -> None:
    """Put back what [`rng_state`][] read."""
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
