"""One error type for distributed failures: which rank, doing what, for how long, and why.

torch.distributed reports a missing or crashed rank as a ``DistStoreError``, a gloo
``RuntimeError`` with a C++ stack trace, NCCL's ``DistBackendError`` (a timeout or an
aborted communicator), or DCP's ``CheckpointException`` (a ``BaseException``).
Every set-up, collective, save and load of ``fe.distributed`` turns them into a
[`DistributedError`][funcensemble.distributed.DistributedError] that says which rank
failed, what it was waiting for, how long it waited and under which timeout, with the
original error chained as its cause.
"""

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ._backend_errors import backend_hint

_MAX_CAUSE = 600  # characters of the original message kept in ours


class DistributedError(RuntimeError):
    """A distributed operation failed on this rank, usually because of another rank.

    Raised by [`init_process_group`][funcensemble.distributed.init_process_group]
    (a rank never joined), by the collectives (another rank crashed, or did not reach
    the same call within the process group's timeout) and by sharded
    [`save`][funcensemble.distributed.save] and [`load`][funcensemble.distributed.load].
    The message names this rank, what it waited for, how long, and the cause; the
    original exception is chained (``__cause__``). A subclass of ``RuntimeError``, what
    torch.distributed raises itself.

    Attributes:
        rank: This process's rank (in the group the operation ran on).
        world_size: The number of ranks.
        operation: What was being done, e.g. ``"all_gather"``.
        waited: Seconds this rank spent in the operation before it failed.
        timeout: The timeout in force, when known.

    Example:
        >>> import funcensemble as fe
        >>> error = fe.distributed.DistributedError(
        ...     "all_gather: ...", rank=1, world_size=2, operation="all_gather", waited=0.5)
        >>> isinstance(error, RuntimeError), error.rank, error.waited
        (True, 1, 0.5)
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        world_size: int,
        operation: str,
        waited: float,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.world_size = world_size
        self.operation = operation
        self.waited = waited
        self.timeout = timeout


def group_timeout(group: Any = None) -> timedelta | None:
    """The timeout of ``group``'s CPU or CUDA backend, ``None`` where torch does not say."""
    try:
        pg = group if group is not None else dist.group.WORLD
        for device in ("cpu", "cuda"):
            with contextlib.suppress(Exception):
                return pg._get_backend(torch.device(device)).options._timeout
    except Exception:  # private API: a missing attribute only loses the figure
        pass
    return None


def _checkpoint_causes(error: CheckpointException) -> str:
    """Each failed rank's own error, without DCP's Python tracebacks."""
    causes = []
    for rank, failure in sorted(error.failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        causes.append(f"on rank {rank}, {cause_text(inner)}")
    return "; ".join(causes)


def cause_text(error: BaseException) -> str:
    """The first part of an exception's message, without torch's C++ stack trace."""
    if isinstance(error, CheckpointException) and getattr(error, "failures", None):
        return f"{type(error).__name__}: {_checkpoint_causes(error)}"
    text = str(error).split("\nException raised from", 1)[0].strip()
    text = " ".join(text.split())
    if len(text) > _MAX_CAUSE:
        text = text[:_MAX_CAUSE] + " [...]"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _timeout_words(timeout: timedelta | None, name: str) -> str:
    return "" if timeout is None else f" ({name} {timeout.total_seconds():g} s)"


def raise_failure(
    where: str,
    what: str,
    rank: int,
    world: int,
    started: float,
    timeout: timedelta | None,
    hint: str,
    cause: BaseException | None = None,
    *,
    timeout_name: str = "timeout",
) -> NoReturn:
    """Raise a ``DistributedError`` for ``what`` (a phrase: "waiting for ...")."""
    waited = time.monotonic() - started
    message = (
        f"{where}: rank {rank} of {world} failed while {what}, after {waited:.1f} s"
        f"{_timeout_words(timeout, timeout_name)}. {hint}{backend_hint(cause)}"
    )
    if cause is not None:
        message += f" Cause: {cause_text(cause)}"
    error = DistributedError(
        message, rank=rank, world_size=world, operation=where, waited=waited, timeout=timeout
    )
    raise error from cause


PEER_HINT = (
    "Another rank has probably crashed, or has not reached this call within the "
    "process group's timeout; its own output says why."
)
CHECKPOINT_HINT = (
    "A sharded checkpoint is one directory that every rank reads and writes: give a "
    "path on a filesystem all ranks share (not a node-local disk), that exists or can "
    "be created, and is readable and writable by every rank. If the cause is on "
    "another rank, or none is given, that rank's own output says more."
)


@contextlib.contextmanager
def failures(
    where: str,
    what: str,
    rank: int,
    world: int,
    *,
    group: Any = None,
    timeout: timedelta | None = None,
    hint: str = PEER_HINT,
    timeout_name: str = "timeout",
) -> Iterator[None]:
    """Turn what torch.distributed raises inside the block into a ``DistributedError``."""
    started = time.monotonic()
    try:
        yield
    except DistributedError:
        raise
    except (Exception, CheckpointException) as error:  # CheckpointException: BaseException
        if timeout is None and world > 1:
            timeout = group_timeout(group)
        raise_failure(
            where, what, rank, world, started, timeout, hint, error, timeout_name=timeout_name
        )
