"""Raising one rank's refusal of its own arguments on every rank.

A rank that refuses its arguments (a batch it cannot split, an unknown reduction) and
stops before a collective leaves the other ranks waiting in it for the whole timeout,
or lets them go on to the next call out of step. So a call checks its arguments
first, and its first exchange carries a flag saying whether this rank refused them:
where one did, its error is sent to every rank, and every rank raises it.
"""

import builtins
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ._agreement import Description
from ._collectives import _digest, _refuse_calls
from ._errors import failures
from ._gather import gather_rows
from ._member_shard import MemberShard


def ranks(shard: MemberShard | None) -> tuple[int, int, Any, torch.device]:
    """Every rank holding these members (the default group without a shard): this
    rank, their number, their group, and where a small exchange among them runs."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, None, torch.device("cpu")  # nothing to exchange with
    if shard is None:
        rank, world, group = dist.get_rank(), dist.get_world_size(), None
    else:
        rank, world, group = shard._all_ranks()
    if world > 1 and dist.get_backend(group) == "nccl":
        return rank, world, group, torch.device("cuda", torch.cuda.current_device())
    return rank, world, group, torch.device("cpu")


def raise_refusal(
    where: str, refused: Exception | None, rank: int, world: int, group: Any
) -> NoReturn:
    """Raise, on every rank of ``group`` (every rank calls this once one of them refused),
    a refusal: a refusing rank its own error; the others the first refusing rank's, of
    its type, naming that rank."""
    mine = None if refused is None else (type(refused).__name__, str(refused))
    refusals: list[Any] = [None] * world
    with failures(where, f"exchanging the refusals of {world} ranks", rank, world, group=group):
        dist.all_gather_object(refusals, mine, group=group)
    if refused is not None:
        raise refused  # this rank's own error, as it raised it
    first = next(r for r, found in enumerate(refusals) if found is not None)
    kind, message = refusals[first]
    error = getattr(builtins, kind, None)
    if not (isinstance(error, type) and issubclass(error, Exception)):
        error = ValueError  # a library's own error class: its message says what it is
    said = f"{message} (Refused on rank {first} of {world}; every rank raises it.)"
    raise error(said)


def agree_to_start(
    where: str,
    call: Description,
    refused: Exception | None,
    rank: int,
    world: int,
    group: Any,
    device: torch.device,
) -> None:
    """Before ``where``'s first collective: raise on every rank a rank's refusal of its
    arguments (``refused``), or, naming each rank's, calls that differ (``call``)."""
    if refused is not None and world == 1:
        raise refused
    if world == 1:
        return
    digest = 0 if refused is not None else _digest(repr(sorted(call.items())))
    mine = torch.tensor([digest, int(refused is not None)], dtype=torch.int64, device=device)
    doing = "comparing its arguments with the other ranks'"
    with failures(where, doing, rank, world, group=group):
        rows = gather_rows(mine, world, group)
    if any(flag for _, flag in rows):
        raise_refusal(where, refused, rank, world, group)
    if any(d != rows[0][0] for d, _ in rows):
        _refuse_calls(where, call, rank, world, group)
