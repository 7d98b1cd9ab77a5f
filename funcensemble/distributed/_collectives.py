"""Looking at all members across ranks: gathered outputs and member-axis reductions.

Each function takes this rank's outputs ``[n_r, ...]`` (its members first) and a
``MemberShard``, runs ``torch.distributed`` collectives, and returns on every rank
what the single-process function returns for all N members. Every rank must call the
same function, in the same order, with the same arguments (``correction``, ``k``, ...),
tensors of the same trailing shape and dtype (checked first, with one small exchange:
ranks that differ all raise a ``ValueError`` naming them), and pytrees of the same
structure. The digests of the call (the function's name and its scalar arguments, and
of an enclosing ``predict``'s) and of the pytree's structure ride in the same exchange,
so they cost nothing more; ranks that differ all raise, naming what differs.
Results carry no autograd history: members train independently, so nothing here is
differentiated.
"""

import builtins
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from jaxtyping import Float, Real
from torch import Tensor

from .. import _reduce, _tree
from .._messages import expected_got
from .._types import StackedTree
from ._agreement import Description, agree, differences, exchange
from ._errors import failures
from ._gather import gather_rows, gather_stacked
from ._member_shard import MemberShard, rank_and_world

# " member *rest" starts with a space so that linters do not parse it as the Python
# expression `member * rest` (jaxtyping's advice); jaxtyping ignores the space.


def _collective(where: str, rank: int, world: int, op: Callable[[], Any], group: Any = None) -> Any:
    """Run ``op``; if the collective fails, raise a ``DistributedError`` naming this rank."""
    with failures(
        where,
        f"waiting for the other ranks in a collective over {world} ranks",
        rank,
        world,
        group=group,
    ):
        return op()


def _device(shard: MemberShard) -> torch.device:
    """Where a small exchange over the shard's groups runs (CUDA under NCCL)."""
    if dist.is_initialized() and dist.get_backend(shard.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_shard(where: str, shard: object) -> MemberShard:
    if not isinstance(shard, MemberShard):
        raise TypeError(
            f"{where}: shard is not a MemberShard (expected a fe.distributed.MemberShard "
            f"describing this rank's members, got {type(shard).__name__}). Build one with "
            "fe.distributed.MemberShard."
        )
    return shard


def _check_local(where: str, label: str, values: object, shard: MemberShard) -> Tensor:
    if not isinstance(values, Tensor):
        raise TypeError(
            f"{where}: {label} must be a tensor of this rank's outputs, members first, got "
            f"{type(values).__name__}."
        )
    if values.dim() == 0 or values.shape[0] != shard.size:
        got = values.shape[0] if values.dim() else "no member axis"
        raise ValueError(
            f"{where}: {label} has leading size {got}, but rank {shard.rank} holds "
            f"{shard.size} members ({shard.members.start}:{shard.members.stop} of "
            f"{shard.num_members}). Pass this rank's outputs with the member axis first."
        )
    return values.detach()


_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
)
_MAX_DIMS = 16


def _digest(text: str) -> int:
    """A nonzero signed 64-bit digest of ``text`` (0 stands for "nothing to compare")."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


# The public call a collective runs inside (``predict``): its name and what every rank
# must pass it alike, compared with the collective's own call.
_OUTER: ContextVar[tuple[str, Description] | None] = ContextVar(
    "funcensemble_distributed_call", default=None
)


@contextmanager
def calling(where: str, description: Description) -> Iterator[None]:
    """Compare ``description`` (the arguments of ``where``, a call made of several
    collectives) across the ranks at every collective inside, at no extra cost."""
    token = _OUTER.set((where, description))
    try:
        yield
    finally:
        _OUTER.reset(token)


def _call(where: str, args: Description | None) -> tuple[str, Description]:
    """Who reports a mismatch (``where``, or the enclosing call), and what the ranks'
    calls must agree on: the enclosing call's arguments, the collective and its own."""
    outer = _OUTER.get()
    description = {} if outer is None else dict(outer[1])
    description["the collective"] = where
    description.update(args or {})
    return (where if outer is None else outer[0]), description


def _layout_row(shape: tuple[int, ...], dtype: torch.dtype, structure: int, call: int) -> list[int]:
    code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    dims = list(shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - len(shape[:_MAX_DIMS]))
    return [structure, call, len(shape), code, *dims]


def _layout_text(row: list[int]) -> str:
    _, _, ndim, code, *dims = row
    dtype = str(_DTYPES[code]).removeprefix("torch.") if code < len(_DTYPES) else "other dtype"
    shown = tuple(dims[: builtins.min(ndim, _MAX_DIMS)])
    return f"{dtype} {shown}" + (" ..." if ndim > _MAX_DIMS else "")


class _Tree:
    """A pytree passed to a collective: a digest of its structure, and a description
    naming its keys and leaves for the message when the ranks' digests differ."""

    def __init__(
        self, tree: Any, advice: str, *, member_first: bool, also: dict[str, str] | None = None
    ) -> None:
        paths, leaves, spec = _tree.flatten_with_paths(tree)
        # ``also``: what else every rank must agree on (broadcast's src), checked alike.
        self.description = {**(also or {}), "the pytree's structure": str(spec)}
        words = "per-member shape" if member_first else "shape"
        for path, leaf in zip(paths, leaves, strict=True):
            self.description[f"leaf `{path or 'the tree itself'}`"] = (
                f"{str(leaf.dtype).removeprefix('torch.')}, {words} "
                f"{tuple(leaf.shape[1:] if member_first else leaf.shape)}"
                if isinstance(leaf, Tensor)
                else type(leaf).__name__
            )
        # Which leaves are tensors matters too (broadcast keeps the others as they are).
        kinds = "".join("t" if isinstance(x, Tensor) else "o" for x in leaves)
        self.digest = _digest(f"{spec}|{kinds}|{also}")
        self.advice = advice

    def check_empty(self, where: str, rank: int, world: int, group: Any) -> None:
        """Without a tensor leaf there is no leaf check to carry the digest: exchange it
        alone, so that a rank passing an empty tree meets the others' first check."""
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        _check_layout(where, rank, world, group, torch.empty(0, device=device), (), "", self)


def _check_layout(
    where: str,
    rank: int,
    world: int,
    group: Any,
    t: Tensor,
    shape: tuple[int, ...],
    what: str,
    tree: _Tree | None = None,
    *,
    args: Description | None = None,
) -> None:
    """Every rank's ``shape`` and dtype, compared before the collective that needs them equal.

    Collectives of tensors with other shapes either combine values of different
    meanings without a word (same element count) or abort the process inside gloo.
    The row also carries a digest of the call: ``where`` (the collective), its scalar
    ``args`` (``correction``, ``k``, ...) and those of an enclosing ``predict``, so
    that ranks calling ``min`` here and ``max`` there (the same all-gather) or passing
    other arguments are refused instead of combining values of different meanings.
    With ``tree``, the row also carries a digest of the pytree the tensor belongs to,
    so that ranks passing pytrees of other structures (other keys) are refused at the
    first leaf's check, at no extra cost.
    """
    structure = 0 if tree is None else tree.digest
    name, call = _call(where, args)
    row = _layout_row(shape, t.dtype, structure, _digest(repr(sorted(call.items()))))
    mine = torch.tensor(row, dtype=torch.int64, device=t.device)
    layouts = _collective(where, rank, world, lambda: gather_rows(mine, world, group), group)
    if all(r == layouts[0] for r in layouts):
        return
    # Every rank sees the same rows, so every rank takes the same branches below, which
    # exchange what the digests stand for to name what differs (collectives).
    if any(r[1] != layouts[0][1] for r in layouts):
        _refuse_calls(name, call, rank, world, group)
    if tree is not None and any(r[0] != layouts[0][0] for r in layouts):
        agree(where, tree.description, rank, world, group, tree.advice)
    by_layout: dict[str, list[int]] = {}
    for r, row in enumerate(layouts):
        by_layout.setdefault(_layout_text(row), []).append(r)
    parts = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {text}"
        for text, rs in by_layout.items()
    )
    raise ValueError(
        f"{where}: the ranks passed {what} of different dtypes or shapes ({parts}), so "
        "the collective would combine values of different meanings. Every rank must pass "
        "tensors of the same dtype and shape (after its member axis)."
    )


def _check_replicas(
    where: str,
    shard: MemberShard,
    device: torch.device,
    *,
    args: Description | None = None,
    draw: Tensor | None = None,
) -> None:
    """Refuse, on every data replica of these members, calls that differ between them.

    A collective combines this rank's members with the other member ranks' (its member
    group); the data replicas holding the same members each run their own. Replicas
    calling ``min`` here and ``max`` there, with another ``correction``, or drawing
    another subset (generators seeded per data rank) would go on with results no one
    process gives: one 16-byte row per replica (the call's digest, and the drawn
    subset's) is gathered along the data axis, and only where they differ are the
    calls exchanged, to name what differs.
    """
    if shard.data_size <= 1:
        return
    name, call = _call(where, args)
    drawn = 0 if draw is None else _digest(draw.to(torch.uint8).cpu().numpy().tobytes().hex())
    mine = torch.tensor([_digest(repr(sorted(call.items()))), drawn], device=device)
    with failures(
        where,
        f"comparing the calls of {shard.data_size} data replicas",
        shard.data_rank,
        shard.data_size,
        group=shard.data_group,
    ):
        found = gather_rows(mine, shard.data_size, shard.data_group)
    if all(row == found[0] for row in found):
        return
    replicas = "data replicas (counted along the mesh's data axis)"
    if any(row[0] != found[0][0] for row in found):
        calls = exchange(name, call, shard.data_rank, shard.data_size, shard.data_group)
        raise ValueError(
            f"{name}: the {shard.data_size} {replicas} made different calls (expected the "
            f"same function with the same arguments on every replica of these members): "
            f"they differ in {differences(calls)}, so the replicas would go on with "
            "results of different meanings. Make every rank call the same fe.distributed "
            "functions, with the same arguments, in the same order."
        )
    raise ValueError(
        f"{where}: the {shard.data_size} {replicas} drew different subsets of members "
        "(expected one draw, from generators in the same state on every rank; with "
        "per_sample, replicas holding other batch sizes draw other subsets), so their "
        "results would be minima over different members. Pass "
        "generator=torch.Generator().manual_seed(step), the same seed on every rank "
        "(not seeded by rank), or use predict, which gathers the batch first."
    )


def _refuse_calls(name: str, call: Description, rank: int, world: int, group: Any) -> None:
    """Raise on every rank, naming each rank's call, when the ranks' calls differ."""
    shown = differences(exchange(name, call, rank, world, group))
    if not shown:  # digests of equal calls never differ; nothing to name
        return
    raise ValueError(
        f"{name}: the {world} ranks made different calls (expected the same function with "
        f"the same arguments on every rank): they differ in {shown}, so one rank's values "
        "would be combined with another's by another operation. Make every rank call the "
        "same fe.distributed functions, with the same arguments, in the same order."
    )


def _all_reduce(
    where: str, shard: MemberShard, t: Tensor, op: Any, *, args: Description | None = None
) -> Tensor:
    _check_layout(
        where,
        shard.rank,
        shard.world_size,
        shard.group,
        t,
        tuple(t.shape),
        "reduced outputs",
        args=args,
    )
    _collective(
        where,
        shard.rank,
        shard.world_size,
        lambda: dist.all_reduce(t, op=op, group=shard.group),
        shard.group,
    )
    return t


def _all_extreme(
    where: str, shard: MemberShard, partial: Tensor, largest: bool, *, checked: bool = False
) -> Tensor:
    """Every rank's minimum (maximum) over its members, combined as ``torch.amin`` does.

    A MIN or MAX all-reduce drops a NaN or keeps it depending on the order in which
    it meets the other ranks' values (gloo); one process's ``amin`` returns NaN
    wherever a member has one. So the per-rank results (one per rank, not one per
    member) are gathered and reduced here, on every rank in the same order.
    ``checked``: the ranks' layouts were compared already (``partial``'s shape is the
    values' after the member axis).
    """
    if not checked:
        _check_layout(
            where,
            shard.rank,
            shard.world_size,
            shard.group,
            partial,
            tuple(partial.shape),
            "reduced outputs",
        )
    ranks = _collective(
        where,
        shard.rank,
        shard.world_size,
        lambda: gather_stacked(partial, shard.world_size, shard.group),
        shard.group,
    )
    return ranks.amax(dim=0) if largest else ranks.amin(dim=0)


def _gather_one(where: str, shard: MemberShard, t: Tensor, tree: _Tree) -> Tensor:
    if shard.world_size == 1:
        return t.clone()
    _check_layout(
        where,
        shard.rank,
        shard.world_size,
        shard.group,
        t,
        tuple(t.shape[1:]),
        "outputs (shape after the member axis)",
        tree,
    )
    if t.dtype == torch.bool:  # not every backend reduces or gathers bools
        return _gather_checked(where, shard, t.to(torch.uint8)).bool()
    return _gather_checked(where, shard, t)


def _gather_checked(where: str, shard: MemberShard, t: Tensor) -> Tensor:
    rows = builtins.max(shard.sizes)
    rest = t.shape[1:]
    if t.shape[0] < rows:  # uneven shards: pad to equal sizes, cut the padding afterwards
        t = torch.cat([t, t.new_zeros((rows - t.shape[0], *rest))])
    out = _collective(
        where,
        shard.rank,
        shard.world_size,
        lambda: gather_stacked(t, shard.world_size, shard.group).flatten(0, 1),
        shard.group,
    )
    if all(size == rows for size in shard.sizes):
        return out
    return torch.cat([out[r * rows : r * rows + size] for r, size in enumerate(shard.sizes)])


def all_gather(local: StackedTree, shard: MemberShard) -> StackedTree:
    """All N members' outputs on every rank, from each rank's own.

    Args:
        local: This rank's outputs: a tensor, or a pytree of tensors, with its
            ``shard.size`` members first.
        shard: This rank's [`MemberShard`][funcensemble.distributed.MemberShard].

    Returns:
        The same structure with ``[N, ...]`` tensors in member order (new tensors, no
        autograd history), equal to the single-process ensemble's outputs.

    Raises:
        ValueError: A tensor whose leading size is not this rank's member count, or
            ranks that passed pytrees of different structures (other keys; raised on
            every rank, naming the keys, before any output moves) or tensors of
            different dtypes or trailing shapes.
        DistributedError: The collective failed (another rank crashed or timed out).

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(4)  # one process here; the same under torchrun
        >>> ens = shard.from_factory(lambda: torch.nn.Linear(3, 2))
        >>> fe.distributed.all_gather(ens(torch.randn(5, 3)), shard).shape
        torch.Size([4, 5, 2])
    """
    where = "all_gather"
    shard = _check_shard(where, shard)
    leaves, spec = _tree.flatten(local)
    checked = [_check_local(where, f"leaf {i}", x, shard) for i, x in enumerate(leaves)]
    tree = _Tree(
        local,
        "Every rank must pass a pytree of the same structure (the same keys, in any "
        "order), with tensors of the same dtypes and shapes after the member axis.",
        member_first=True,
    )
    with torch.no_grad():
        _check_replicas(where, shard, checked[0].device if checked else _device(shard))
        if shard.world_size > 1 and not checked:
            tree.check_empty(where, shard.rank, shard.world_size, shard.group)
        out = [_gather_one(where, shard, t, tree) for t in checked]
    return _tree.unflatten(spec, out)


def _real(where: str, values: Tensor) -> None:
    if values.dtype == torch.bool or values.is_complex():
        raise TypeError(
            f"{where}: the values are not real numbers "
            f"{expected_got('a real dtype (not bool or complex)', values.dtype)}. "
            + _reduce.to_real_advice(values)
        )


def wide(t: Tensor) -> torch.dtype:
    """The dtype a sum of ``t`` over members accumulates and travels in: float32 at
    least, as ``torch.mean`` accumulates half-precision values (a float16 sum of float16
    values overflows at 65504, where their mean does not)."""
    return torch.promote_types(t.dtype, torch.float32)


def _wide_mean(where: str, values: Tensor, shard: MemberShard) -> Tensor:
    total = values.sum(dim=0, dtype=wide(values))
    return _all_reduce(where, shard, total, dist.ReduceOp.SUM) / shard.num_members


def _mean(where: str, values: Tensor, shard: MemberShard) -> Tensor:
    return _wide_mean(where, values, shard).to(values.dtype)


def mean(local: Float[Tensor, " member *rest"], shard: MemberShard) -> Float[Tensor, "*rest"]:
    """The mean over all N members, from each rank's own outputs (all-reduce of sums).

    Like [`fe.reduce.mean`][funcensemble.reduce.mean] over the gathered outputs, up to
    rounding (the sum runs in another order), without gathering them.

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(2)
        >>> fe.distributed.mean(torch.tensor([[1.0, 2.0], [3.0, 6.0]]), shard).tolist()
        [2.0, 4.0]
    """
    where = "mean"
    shard = _check_shard(where, shard)
    values = _reduce.check_floating(where, _check_local(where, "local", local, shard))
    _check_replicas(where, shard, values.device)
    if shard.world_size == 1:
        return _reduce.mean(values)
    with torch.no_grad():
        return _mean(where, values, shard)


def _var_dtype(values: Tensor) -> torch.dtype:
    """float64 (float32 on MPS, which has no float64): the dtype ``_var`` works in."""
    return torch.float32 if values.device.type == "mps" else torch.float64


def _var(where: str, local: Tensor, shard: MemberShard, correction: int | float) -> Tensor:
    values = _reduce.check_floating(where, _check_local(where, "local", local, shard))
    _reduce._check_correction(where, correction, shard.num_members)
    _check_replicas(where, shard, values.device, args={"correction": repr(float(correction))})
    if shard.world_size == 1:
        return torch.var(values, dim=0, correction=correction)
    n = shard.num_members
    with torch.no_grad():
        # Two passes (mean, then squared deviations) as torch.var does: the one-pass
        # E[x^2] - E[x]^2 loses digits when the spread is small next to the mean. Both
        # run in float64 whatever the input's precision: a float32 mean is off by up
        # to an ulp of the mean (6e-5 at 1e3), which swamps a spread of 1e-4 (200% off
        # in the std), where torch.var accumulates float32 in float64 on the CPU. The
        # sum of the deviations rides along and corrects for what rounding is left in
        # the mean (the corrected two-pass algorithm: sum d^2 - (sum d)^2 / N).
        x = values.to(_var_dtype(values))
        args = {"correction": repr(float(correction))}
        total = _all_reduce(where, shard, x.sum(dim=0), dist.ReduceOp.SUM, args=args)
        centred = x - total / n
        sums = torch.stack([(centred * centred).sum(dim=0), centred.sum(dim=0)])
        squares, deviations = _all_reduce(where, shard, sums, dist.ReduceOp.SUM, args=args)
        total = squares - deviations * deviations / n
        return (total / (n - correction)).to(values.dtype)


def var(
    local: Float[Tensor, " member *rest"], shard: MemberShard, *, correction: int | float = 1
) -> Float[Tensor, "*rest"]:
    """The variance over all N members, from each rank's own outputs.

    As [`fe.reduce.var`][funcensemble.reduce.var] (``correction=1``: the unbiased
    sample variance), computed in two all-reduces without gathering the outputs:
    the mean, then the sums of squared deviations from it, both in float64 whatever
    the input's dtype, so that members that nearly agree (a spread of 1e-4 around
    1e3 in float32) keep their relative precision, as in one process.

    Raises:
        ValueError: ``N - correction <= 0``.

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(2)
        >>> fe.distributed.var(torch.tensor([[1.0, 0.0], [3.0, 0.0]]), shard).tolist()
        [2.0, 0.0]
    """
    return _var("var", local, _check_shard("var", shard), correction)


def std(
    local: Float[Tensor, " member *rest"], shard: MemberShard, *, correction: int | float = 1
) -> Float[Tensor, "*rest"]:
    """The standard deviation over all N members, the root of [`var`][funcensemble.distributed.var].

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(2)
        >>> fe.distributed.std(torch.tensor([[1.0, 5.0], [3.0, 5.0]]), shard, correction=0).tolist()
        [1.0, 0.0]
    """
    return _var("std", local, _check_shard("std", shard), correction).sqrt()


def _extreme(where: str, local: Tensor, shard: MemberShard, largest: bool) -> Tensor:
    shard = _check_shard(where, shard)
    values = _check_local(where, "local", local, shard)
    _real(where, values)
    _check_replicas(where, shard, values.device)
    with torch.no_grad():
        out = values.amax(dim=0) if largest else values.amin(dim=0)
        if shard.world_size == 1:
            return out
        return _all_extreme(where, shard, out, largest)


def min(local: Real[Tensor, " member *rest"], shard: MemberShard) -> Real[Tensor, "*rest"]:
    """The elementwise minimum over all N members (values only), exactly.

    Each rank's minimum over its members is gathered (one value per rank, not per
    member), so a NaN output of any member gives NaN, as ``torch.amin`` does.

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(2)
        >>> fe.distributed.min(torch.tensor([[1.0, 7.0], [3.0, 2.0]]), shard).tolist()
        [1.0, 2.0]
    """
    return _extreme("min", local, shard, largest=False)


def max(local: Real[Tensor, " member *rest"], shard: MemberShard) -> Real[Tensor, "*rest"]:
    """The elementwise maximum over all N members (values only), exactly (NaN as in
    ``torch.amax``).

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(2)
        >>> fe.distributed.max(torch.tensor([[1.0, 7.0], [3.0, 2.0]]), shard).tolist()
        [3.0, 7.0]
    """
    return _extreme("max", local, shard, largest=True)


def subset_min(
    local: Real[Tensor, " member *rest"],
    shard: MemberShard,
    k: int,
    *,
    generator: torch.Generator | None = None,
    per_sample: bool = False,
) -> Real[Tensor, "*rest"]:
    """The minimum over a random subset of ``k`` of all N members (REDQ's target), exactly.

    Every rank draws the same subset of member indices, the way
    [`fe.reduce.subset_min`][funcensemble.reduce.subset_min] draws it, takes the
    minimum over its own selected members and the ranks' minima are combined (gathered,
    one per rank, so that a NaN counts as in ``torch.amin``). So with the
    generator in the same state on every rank (e.g. each rank seeds
    ``torch.Generator().manual_seed(step)``, or all ranks seed torch alike) the result
    equals ``fe.reduce.subset_min`` on the gathered outputs with that generator, bit
    for bit. Each call advances the generator as ``fe.reduce.subset_min`` does.

    Args:
        local: This rank's outputs, members first (e.g. target Q-values ``[n_r, batch]``).
        shard: This rank's [`MemberShard`][funcensemble.distributed.MemberShard].
        k: How many members to take the minimum over, ``1 <= k <= N``.
        generator: Draw the subset from this generator; ``None`` uses torch's default
            generator for the device of ``local``. Its state must match on every rank.
        per_sample: An independent subset for each index of dim 1.

    Raises:
        ValueError: ``k`` out of range, ``per_sample`` with no dim after the member
            axis, or subsets drawn differently on different ranks (their generators
            out of step; the draws are compared before the minimum is combined).

    Example:
        >>> import torch, funcensemble as fe
        >>> q = torch.tensor([[3.0, 3.0], [1.0, 1.0], [2.0, 2.0]])  # 3 members, batch 2
        >>> shard = fe.distributed.MemberShard(3)
        >>> got = fe.distributed.subset_min(q, shard, 2, generator=torch.Generator().manual_seed(0))
        >>> torch.equal(got, fe.reduce.subset_min(q, 2, generator=torch.Generator().manual_seed(0)))
        True
    """
    where = "subset_min"
    shard = _check_shard(where, shard)
    values = _check_local(where, "local", local, shard)
    n = shard.num_members
    k = _reduce.check_subset_options(where, "local", values, n, k, generator, per_sample)
    _real(where, values)

    device = values.device if generator is None else generator.device
    if shard.world_size > 1:
        # Before the draws are exchanged: with per_sample their size is dim 1's, and
        # exchanges of different sizes abort the process inside gloo.
        _check_layout(
            where,
            shard.rank,
            shard.world_size,
            shard.group,
            values,
            tuple(values.shape[1:]),
            "values (shape after the member axis)",
            args={"k": repr(k), "per_sample": repr(per_sample)},
        )
    with torch.no_grad():
        # The same draws as fe.reduce.subset_min, turned into a mask over all N members.
        if not per_sample:
            chosen = _reduce.draw_subset(n, k, None, generator, device)
            mask = torch.zeros(n, dtype=torch.bool, device=device)
            mask[chosen] = True
            mine = mask[shard.members].to(values.device)
            mine = mine.reshape(-1, *[1] * (values.dim() - 1))
        else:
            batch = values.shape[1]
            chosen = _reduce.draw_subset(n, k, batch, generator, device)
            mask = torch.zeros(batch, n, dtype=torch.bool, device=device)
            mask.scatter_(1, chosen, True)
            mine = mask[:, shard.members].T.to(values.device)
            mine = mine.reshape(*mine.shape, *[1] * (values.dim() - 2))
        _check_replicas(
            where,
            shard,
            values.device,
            args={"k": repr(k), "per_sample": repr(per_sample)},
            draw=mask,
        )
        if shard.world_size > 1:
            _check_same_draw(where, shard, mask.to(values.device))
        if values.is_floating_point():
            fill = torch.tensor(float("inf"), dtype=values.dtype, device=values.device)
        else:
            fill = torch.tensor(
                torch.iinfo(values.dtype).max, dtype=values.dtype, device=values.device
            )
        # Members that are not selected become +inf (or the largest int): they never
        # win the minimum, here or in the all-reduce.
        out = torch.where(mine, values, fill).amin(dim=0)
        if shard.world_size == 1:
            return out
        return _all_extreme(where, shard, out, largest=False, checked=True)


def _check_same_draw(where: str, shard: MemberShard, mask: Tensor) -> None:
    """Refuse subsets drawn differently on different ranks (generators out of step).

    Each rank keeps its own members of the subset it drew: with different draws the
    combined minimum is over no subset at all (``+inf`` where no rank kept a member).
    The drawn masks are gathered and compared, on every rank alike.
    """
    mine = mask.to(torch.uint8).reshape(-1)
    drawn = _collective(  # read inside: under NCCL a failure may surface at the copy
        where,
        shard.rank,
        shard.world_size,
        lambda: gather_stacked(mine, shard.world_size, shard.group).cpu(),
        shard.group,
    )
    differ = [r for r in range(1, shard.world_size) if not torch.equal(drawn[r], drawn[0])]
    if not differ:
        return

    def members(r: int) -> str:
        row = drawn[r].view(mask.shape)
        if mask.dim() == 1:
            return str(row.nonzero().flatten().tolist())
        return f"{row[0].nonzero().flatten().tolist()} for sample 0"

    raise ValueError(
        f"{where}: the ranks drew different subsets (rank 0: members {members(0)}, rank "
        f"{differ[0]}: {members(differ[0])}), so the minimum would be over no subset of "
        "k members (expected one draw, from generators in the same state on every rank). "
        "Pass generator=torch.Generator().manual_seed(step) (the same seed on every "
        "rank): torch's default generator drifts apart as soon as a rank draws for its "
        "own members (dropout, per-member noise)."
    )


def broadcast(tree: Any, *, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s tensors, on every rank: one batch of data for all members.

    Every rank passes a pytree of the same structure, with tensors of the same shapes
    and dtypes (on non-``src`` ranks their values are ignored, e.g. ``torch.empty``).
    Drawing the batch from the same seed on every rank gives the same result with no
    communication at all; broadcast when the batch comes from a source only one rank
    reads (an environment, a stream).

    Args:
        tree: A tensor or pytree of tensors; non-tensor leaves are kept as they are.
        src: The rank whose values everyone gets.
        group: The process group; the default group if ``None``.

    Returns:
        A new pytree holding ``src``'s values (new tensors; the input is untouched).

    Raises:
        ValueError: ``src`` is not a rank of the group, or the ranks passed pytrees of
            different structures (other keys; raised on every rank, naming them) or
            tensors of different dtypes or shapes.

    Example:
        >>> import torch, funcensemble as fe
        >>> batch = {"x": torch.ones(4, 3), "y": torch.zeros(4)}
        >>> fe.distributed.broadcast(batch)["x"].shape  # one process: a copy
        torch.Size([4, 3])
    """
    where = "broadcast"
    rank, world = rank_and_world(where, group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(
            f"{where}: src must be a rank in 0..{world - 1} (expected an int rank of the "
            f"group, got {src!r}). Pass the rank that holds the values."
        )
    global_src = dist.get_global_rank(group, src) if world > 1 and group is not None else src
    leaves, spec = _tree.flatten(tree)
    described = _Tree(
        tree,
        "Every rank must pass the same src, and a pytree of the same structure (the same "
        "keys, in any order), with tensors of the same dtypes and shapes where src has "
        "tensors.",
        member_first=False,
        also={"src": str(src)},
    )
    if world > 1 and not any(isinstance(x, Tensor) for x in leaves):
        described.check_empty(where, rank, world, group)
    out = []
    with torch.no_grad():
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                leaf = leaf.detach().clone(memory_format=torch.contiguous_format)
                if world > 1:
                    _check_layout(
                        where, rank, world, group, leaf, tuple(leaf.shape), "tensors", described
                    )
                    _collective(
                        where,
                        rank,
                        world,
                        lambda t=leaf: dist.broadcast(t, global_src, group=group),
                        group,
                    )
            out.append(leaf)
    return _tree.unflatten(spec, out)
