"""Joining the ranks at start-up, within one deadline, naming any rank that never came.

``torch.distributed``'s own ``env://`` rendezvous overruns its timeout (a client that
finds no server retries for twice the timeout; the server waits a second more) and then
raises a bare ``DistStoreError``. Here every phase shares one deadline, ``join_timeout``
from the call: the client waits for the store server (rank 0's, or ``torchrun``'s
agent's), every rank agrees with rank 0 on a key namespace no earlier attempt of the
job has used (``_handshake``: ``torchrun --max-restarts`` keeps its store across
restarts) and waits until all have joined it, and only then is the process group built
on that store. A rank that is missing makes the others fail at the deadline, within a
fraction of a second, with a message that names it.
"""

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ._errors import failures, raise_failure
from ._handshake import handshake, namespaced

_POLL = 0.05  # seconds between checks of the store


@dataclass(frozen=True)
class Launch:
    """What the launcher (``torchrun``, or the user) put in the environment."""

    rank: int
    world_size: int
    host: str
    port: int
    agent_store: bool  # torchrun's agent hosts the store; no rank serves it

    @classmethod
    def from_env(cls, where: str) -> "Launch":
        values = {}
        for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
            text = os.environ[name]
            try:
                values[name] = int(text)
            except ValueError:
                raise ValueError(
                    f"{where}: the environment variable {name} must be an integer (expected "
                    f"digits, got {text!r}). Start the script with torchrun, which sets it."
                ) from None
        rank, world, port = values["RANK"], values["WORLD_SIZE"], values["MASTER_PORT"]
        if world < 1 or not 0 <= rank < world:
            raise ValueError(
                f"{where}: RANK must be in 0..WORLD_SIZE-1 (expected 0 <= RANK < WORLD_SIZE, "
                f"got RANK={rank} and WORLD_SIZE={world}). Start the script with torchrun, "
                "which sets both."
            )
        if not 0 <= port < 2**16:
            raise ValueError(
                f"{where}: MASTER_PORT must be in 0..65535 (expected a TCP port, got {port}). "
                "Set MASTER_PORT to a free port."
            )
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return cls(rank, world, os.environ["MASTER_ADDR"], port, agent)

    @property
    def serves(self) -> bool:
        return self.rank == 0 and not self.agent_store

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def _wait_for_server(where: str, launch: Launch, started: float, timeout: timedelta) -> None:
    """Wait until the store server accepts connections, at most until the deadline."""
    deadline = started + timeout.total_seconds()
    last: OSError | None = None
    while True:
        left = _remaining(deadline)
        if left <= 0:
            break
        try:
            with socket.create_connection((launch.host, launch.port), timeout=min(left, 1.0)):
                return
        except OSError as error:
            last = error
            time.sleep(min(_POLL * 4, max(_remaining(deadline), 0)))
    server = "torchrun's agent" if launch.agent_store else "rank 0"
    raise_failure(
        where,
        f"waiting for the rendezvous server ({server}) at {launch.address}",
        launch.rank,
        launch.world_size,
        started,
        timeout,
        f"It never answered: {server} has not started, has crashed, or MASTER_ADDR/"
        "MASTER_PORT point elsewhere. Start every rank with the same MASTER_ADDR and "
        "MASTER_PORT (torchrun does), or give a longer join_timeout.",
        last,
        timeout_name="join_timeout",
    )


def _store(where: str, launch: Launch, started: float, timeout: timedelta) -> dist.Store:
    left = max(_remaining(started + timeout.total_seconds()), 0.001)
    role = "starting the rendezvous server" if launch.serves else "connecting to the rendezvous"
    with failures(
        where,
        f"{role} at {launch.address}",
        launch.rank,
        launch.world_size,
        timeout=timeout,
        hint="Check that MASTER_PORT is free on rank 0's machine and reachable from every rank.",
        timeout_name="join_timeout",
    ):
        return dist.TCPStore(
            launch.host,
            launch.port,
            launch.world_size,
            is_master=launch.serves,
            timeout=timedelta(seconds=left),
            wait_for_workers=False,
            multi_tenant=True,
        )


def _wait_for_ranks(
    where: str, store: dist.Store, launch: Launch, started: float, timeout: timedelta
) -> str:
    """Agree with every rank on a fresh key namespace (``_handshake``), or fail at the deadline.

    Returns the generation under which the process group keeps its keys.
    """
    deadline = started + timeout.total_seconds()
    what = f"waiting for all {launch.world_size} ranks to join the rendezvous at {launch.address}"
    with failures(
        where, what, launch.rank, launch.world_size, timeout=timeout, timeout_name="join_timeout"
    ):
        outcome = handshake(store, launch.rank, launch.world_size, deadline, _POLL)
    if outcome.complete:
        assert outcome.generation is not None
        return outcome.generation
    if outcome.generation is None:
        who = (
            "Rank 0 never answered this rank's hello (rank 0 hands every rank the "
            "rendezvous's key namespace): it was not started, crashed before calling "
            "init_process_group, or was given another MASTER_ADDR/MASTER_PORT."
        )
    else:
        names = ", ".join(map(str, outcome.missing))
        who = (
            f"Rank(s) {names} never joined ({launch.world_size - len(outcome.missing)} of "
            f"{launch.world_size} did): they were not started, crashed before calling "
            "init_process_group, or were given another MASTER_ADDR/MASTER_PORT or WORLD_SIZE."
        )
    raise_failure(
        where,
        what,
        launch.rank,
        launch.world_size,
        started,
        timeout,
        f"{who} Their own output says which.",
        timeout_name="join_timeout",
    )


def join(
    where: str,
    backend: str,
    timeout: timedelta,
    device: torch.device | None,
    join_timeout: timedelta,
) -> dist.ProcessGroup:
    """Rendezvous with every rank within ``join_timeout``, then build the default group."""
    launch = Launch.from_env(where)
    started = time.monotonic()
    if not launch.serves:
        _wait_for_server(where, launch, started, join_timeout)
    store = _store(where, launch, started, join_timeout)
    generation = _wait_for_ranks(where, store, launch, started, join_timeout)
    store.set_timeout(timeout)
    with failures(
        where,
        f"connecting the {backend} process group of {launch.world_size} ranks",
        launch.rank,
        launch.world_size,
        timeout=timeout,
    ):
        # torch's env:// layout (the default group's keys under "default_pg"), inside
        # this attempt's own namespace: torchrun's store keeps an earlier attempt's keys.
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("default_pg", namespaced(store, generation)),
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            device_id=device,
        )
    return dist.group.WORLD
