"""How N members are split into contiguous parts, one per device or rank.

One rule everywhere (devices, ranks, sharded checkpoints): part ``p`` of ``P`` gets
``N // P`` members, plus one more for each of the first ``N % P`` parts, in member
order (``numpy.array_split``'s rule). Sizes differ by at most one and no part is ever
empty, so the only split refused is one with more parts than members. The largest part,
``ceil(N / P)`` members, sets the time of a step whichever balanced rule is used.
"""

import torch

from .._messages import positive_int as _count


def member_slices(num_members: int, parts: int) -> list[slice]:
    """Split N members into ``parts`` contiguous, non-empty slices of near-equal size.

    Part ``p`` gets ``N // parts`` members, plus one more if ``p < N % parts``: sizes
    differ by at most one, larger parts first. This is the rule that
    [`ShardedEnsemble`][funcensemble.distributed.ShardedEnsemble] uses to place
    members on devices and [`MemberShard`][funcensemble.distributed.MemberShard] to
    give members to ranks.

    Args:
        num_members: N, the ensemble's member count.
        parts: How many devices or ranks share the members.

    Returns:
        ``parts`` slices ``slice(start, stop)`` (step ``None``) that cover
        ``range(N)`` in order.

    Raises:
        ValueError: ``parts > num_members`` (a part would get no member), or a count
            below 1.
        TypeError: A count that is not an int.

    Example:
        >>> import funcensemble as fe
        >>> [(s.start, s.stop) for s in fe.distributed.member_slices(10, 4)]
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    where = "member_slices"
    n = _count(where, "num_members", num_members)
    p = _count(where, "parts", parts)
    if p > n:
        raise ValueError(
            f"{where}: cannot split {n} member(s) into {p} parts: a part would hold no "
            f"member. Use at most {n} devices or ranks, or more members."
        )
    size, extra = divmod(n, p)
    out, start = [], 0
    for k in range(p):
        stop = start + size + (k < extra)
        out.append(slice(start, stop))
        start = stop
    return out


def slice_size(members: slice) -> int:
    """How many members a slice from ``member_slices`` holds."""
    return members.stop - members.start


def narrow_members(t: torch.Tensor, members: slice, dim: int = 0) -> torch.Tensor:
    """The rows of ``t`` along ``dim`` that belong to ``members`` (a view)."""
    return t.narrow(dim, members.start, slice_size(members))
