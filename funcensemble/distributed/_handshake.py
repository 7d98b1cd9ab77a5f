"""Agreeing on a store namespace that no earlier attempt of the job has written to.

Under ``torchrun`` (torch 2.5 and newer) the workers share the elastic agent's
``TCPStore`` (``TORCHELASTIC_USE_AGENT_STORE=True``). That server lives as long as
``torchrun`` itself: when ``--max-restarts`` restarts the worker group, the new workers
find every key the old ones wrote. ``torch.distributed``'s own rendezvous assumes a
fresh store per attempt and keeps the default group's keys under one fixed prefix, so a
restarted rank reads a dead rank's gloo address (or NCCL unique id) and fails to
connect, or hangs (pytorch/pytorch#135712). ``TORCHELASTIC_RESTART_COUNT`` cannot
name an attempt either: each node's agent counts its own restarts, so the counts of
two nodes can differ.

Instead rank 0 draws a fresh random *generation* and hands it to each rank that says
hello with a fresh random nonce of its own; a rank takes only an answer that carries
its own nonce, so a stale hello or welcome from an earlier attempt is never believed.
The ranks then announce themselves under the generation, whose keys are new, and the
process group is built on a store prefixed with it.
"""

import time
import uuid
from dataclasses import dataclass

import torch.distributed as dist

_ROOT = "funcensemble/rendezvous"


def _hello(rank: int) -> str:
    return f"{_ROOT}/hello/{rank}"


def _welcome(rank: int) -> str:
    return f"{_ROOT}/welcome/{rank}"


def _joined(generation: str, rank: int) -> str:
    return f"{_ROOT}/{generation}/joined/{rank}"


@dataclass(frozen=True)
class Outcome:
    """What the handshake ended with: a generation, or who was missing at the deadline."""

    generation: str | None  # None: this rank was never welcomed by rank 0
    missing: tuple[int, ...]  # ranks that had not joined at the deadline

    @property
    def complete(self) -> bool:
        return self.generation is not None and not self.missing


def _text(store: dist.Store, key: str) -> str:
    return store.get(key).decode()


def _wait_for_all(
    store: dist.Store, generation: str, world: int, deadline: float, poll: float
) -> Outcome:
    keys = [_joined(generation, r) for r in range(world)]
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = tuple(r for r, key in enumerate(keys) if not store.check([key]))
            return Outcome(generation, missing)
        time.sleep(poll)
    return Outcome(generation, ())


def _lead(store: dist.Store, world: int, deadline: float, poll: float) -> Outcome:
    """Rank 0: welcome every hello into a new generation until every rank has joined it."""
    generation = uuid.uuid4().hex
    keys = [_joined(generation, r) for r in range(world)]
    store.set(keys[0], "1")
    welcomed: dict[int, str] = {}
    while not store.check(keys):
        for rank in range(1, world):
            if store.check([keys[rank]]) or not store.check([_hello(rank)]):
                continue
            nonce = _text(store, _hello(rank))
            # A hello left by an earlier attempt gets an answer nobody takes; when the
            # rank of this attempt says hello, its new nonce is answered in turn.
            if welcomed.get(rank) != nonce:
                store.set(_welcome(rank), f"{nonce} {generation}")
                welcomed[rank] = nonce
        if time.monotonic() >= deadline:
            return Outcome(generation, tuple(r for r, k in enumerate(keys) if not store.check([k])))
        time.sleep(poll)
    return Outcome(generation, ())


def _follow(store: dist.Store, rank: int, world: int, deadline: float, poll: float) -> Outcome:
    """Rank r > 0: say hello, take rank 0's answer to it, join, wait for the others."""
    nonce = uuid.uuid4().hex
    store.set(_hello(rank), nonce)
    while True:
        if store.check([_welcome(rank)]):
            answered, _, generation = _text(store, _welcome(rank)).partition(" ")
            if answered == nonce:
                break
        if time.monotonic() >= deadline:
            return Outcome(None, (0,))
        time.sleep(poll)
    store.set(_joined(generation, rank), "1")
    return _wait_for_all(store, generation, world, deadline, poll)


def handshake(store: dist.Store, rank: int, world: int, deadline: float, poll: float) -> Outcome:
    """Agree with every rank on a fresh generation, or say who was missing at ``deadline``.

    ``deadline`` is a ``time.monotonic()`` value; ``poll`` the seconds between looks at
    the store. Store errors propagate (the caller wraps them).
    """
    if rank == 0:
        return _lead(store, world, deadline, poll)
    return _follow(store, rank, world, deadline, poll)


def namespaced(store: dist.Store, generation: str) -> dist.Store:
    """``store`` with every key under this generation (the process group's own keys)."""
    return dist.PrefixStore(f"{_ROOT}/{generation}", store)
