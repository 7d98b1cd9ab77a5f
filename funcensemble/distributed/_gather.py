"""The all-gather into one tensor, under the name the running torch prefers, and the
exchange of a small row of integers per rank that the agreement checks make."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor


def all_gather_single(out: Tensor, t: Tensor, group: Any = None) -> None:
    """``dist.all_gather_single`` where torch has it, else ``all_gather_into_tensor``.

    torch 2.13 deprecates ``all_gather_into_tensor`` (a ``FutureWarning`` on every
    call) for ``all_gather_single``, which older versions lack; both fill ``out``
    alike. Looked up at each call, so a patched ``torch.distributed`` is honoured.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)


def gather_rows(mine: Tensor, world: int, group: Any = None) -> list[list[int]]:
    """Every rank's row of integers ``mine`` (one rank's digests, flags, sizes), in rank order.

    Call it inside ``failures``: under NCCL the gather only queues work, and a failure
    may surface when the rows reach the host, which happens here.
    """
    rows = mine.new_empty(world * mine.numel())
    all_gather_single(rows, mine, group=group)
    return rows.view(world, -1).tolist()


def gather_stacked(t: Tensor, world: int, group: Any = None) -> Tensor:
    """Every rank's ``t`` stacked along a new first axis: ``[world, *t.shape]``.

    Every rank must pass one dtype and shape (``_check_layout`` compares them first).
    """
    flat = t.contiguous().reshape(-1)
    out = flat.new_empty(world * flat.numel())
    all_gather_single(out, flat, group=group)
    return out.view(world, *t.shape)
