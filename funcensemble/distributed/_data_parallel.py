"""Data parallelism within each member: gradients averaged over the mesh's ``"data"`` axis.

Each data replica of a member slice computes its members' gradients of the mean loss
over its equal part of the batch; the mean of those over the D replicas is the gradient
of the mean over the whole batch, what one process computes
(``DistributedDataParallel``'s semantics). A weighted mean divides by each replica's
own weight sum: with the weights given, the replicas' gradients are averaged weighted
by those sums instead, which is the whole batch's weighted mean's gradient. Every
tensor is packed into one flat buffer per dtype and device, so a step costs one
all-reduce (two for mixed dtypes), not one per parameter, after one small exchange
that checks the replicas passed alike trees, and carries a flag for a replica that
refused its own arguments (an integer gradient, weights that cancel), so that every
replica raises that replica's error instead of waiting for it.
"""

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _tree
from ._agreement import agree
from ._errors import failures
from ._gather import gather_rows
from ._member_shard import MemberShard
from ._refusal import raise_refusal


def _check_shard(where: str, shard: object) -> MemberShard:
    if not isinstance(shard, MemberShard):
        raise TypeError(
            f"{where}: shard is not a MemberShard (expected a fe.distributed.MemberShard "
            f"describing this rank's members, got {type(shard).__name__}). Build one with "
            "fe.distributed.MemberShard."
        )
    return shard


def _here(shard: MemberShard) -> str:
    """This replica, as the other replicas' messages name it too."""
    return "this replica" if shard.data_size == 1 else f"data replica {shard.data_rank}"


def _check_floating(where: str, leaves: list[Any], shard: MemberShard) -> None:
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor) and not leaf.is_floating_point():
            on = "" if shard.data_size == 1 else f" on {_here(shard)}"
            raise TypeError(
                f"{where}: leaf {i} has dtype {leaf.dtype}{on} (expected floating-point "
                f"gradients, got {leaf.dtype}). Average other values yourself (their "
                "mean is not of their dtype)."
            )


def _replica_weights(where: str, weights: object, shard: MemberShard, leaves: list[Any]) -> Tensor:
    """Each member's total weight on this replica, ``[n_r]``, from its sample weights."""
    if not isinstance(weights, Tensor) or not weights.is_floating_point():
        got = weights.dtype if isinstance(weights, Tensor) else type(weights).__name__
        raise TypeError(
            f"{where}: weights must be this replica's floating-point sample weights "
            f"(expected a tensor [members, samples...], got {got}). Pass the weights "
            "given to fe.weighted_mean."
        )
    if weights.dim() < 1 or weights.shape[0] != shard.size:
        got = tuple(weights.shape)
        raise ValueError(
            f"{where}: weights must have this rank's {shard.size} members first (expected "
            f"shape ({shard.size}, samples...), got {got}). Pass the member-first weights "
            "given to fe.weighted_mean (expand weights shared by all members)."
        )
    flat = weights.detach().reshape(shard.size, -1)
    totals = flat.sum(dim=1)
    # weighted_mean gives 0 where a member's weights sum to 0: a replica whose weights
    # cancel (mixed signs) would drop its samples' share, which the whole batch keeps.
    cancelled = ((totals == 0) & (flat != 0).any(dim=1)).nonzero().flatten().tolist()
    if cancelled:
        raise ValueError(
            f"{where}: member {shard.members.start + cancelled[0]}'s weights on "
            f"{_here(shard)} sum to 0 but are not all 0 (expected weights >= 0, or a "
            "nonzero sum on every replica): its weighted mean is 0 there, so its samples "
            "would drop out of the average. Scale each replica's sum(w * loss) by the "
            "all-reduced total weight instead (see the scale-out guide)."
        )
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor) and (leaf.dim() == 0 or leaf.shape[0] != shard.size):
            got = leaf.shape[0] if leaf.dim() else "no member axis"
            raise ValueError(
                f"{where}: leaf {i} has leading size {got} (expected this rank's "
                f"{shard.size} members first, got {got}): with weights every tensor is a "
                "member's gradient, weighted by that member's total weight."
            )
    return totals


def average_gradients(grads: Any, shard: MemberShard, *, weights: Tensor | None = None) -> Any:
    """The mean of every tensor of ``grads`` over the data replicas: DDP's gradient.

    With a ``("member", "data")`` mesh of D replicas, each replica computes its
    members' gradients on its part of the batch
    ([`batch_slice`][funcensemble.distributed.MemberShard.batch_slice]); this
    averages them, so every replica steps its members with the gradient of the loss on
    the whole batch, as one process does (up to rounding: the sum runs in another
    order). Floating-point tensors are packed into one buffer per dtype and device
    and all-reduced at once, one collective per step, not one per tensor, after one
    small exchange (an 8-byte digest per replica) that checks every replica passed a
    tree of the same structure, leaf dtypes and shapes: the flat sum would otherwise
    mix values of different parameters without a word. Losses or
    any other per-replica means can be averaged the same way. Without a data axis
    (D = 1) the tensors are returned as they are (copies), with no communication.

    This is exact when each replica's loss is a plain mean over its part (parts of
    equal size), or ``fe.weighted_mean(..., normalize="samples")``. A loss summed over
    the batch (``reduction="sum"``) gets ``1/D`` of the whole batch's gradient, as
    with ``DistributedDataParallel``: multiply it by D. With
    ``fe.weighted_mean``'s default ``normalize="weights"`` (bagging weights from
    [`bootstrap_masks`][funcensemble.bootstrap_masks]) each replica's loss is
    divided by its own weight sum, which differs between replicas, so the plain mean
    of the replicas' gradients is *not* the whole batch's: pass the replica's sample
    weights as ``weights`` and the result is the weighted average
    ``sum_d W_d g_d / sum_d W_d`` (``W_d`` a member's total weight on replica d),
    the gradient of the weighted mean over the whole batch, exactly as one process
    computes it (0 for a member whose weights sum to 0 on every replica, as
    ``fe.weighted_mean`` gives). The totals travel in the same all-reduce.

    Args:
        grads: A pytree of floating-point tensors (e.g. the gradients from
            [`value_and_grad`][funcensemble.value_and_grad]); ``None`` leaves and
            non-tensor leaves are kept as they are.
        shard: This rank's [`MemberShard`][funcensemble.distributed.MemberShard].
        weights: This replica's sample weights ``[n_r, *part]``, members first, as
            given to ``fe.weighted_mean`` (normalize="weights") for the loss; every
            tensor of ``grads`` must then have the ``n_r`` members first. Weights
            must be ``>= 0`` or sum to nonzero on every replica (checked).

    Returns:
        The same structure with the averaged tensors (new tensors, no autograd
        history), equal on every replica.

    Raises:
        TypeError: A tensor that is not floating-point (an average of integers is
            not an integer), or ``weights`` that are not.
        ValueError: The data replicas passed trees of different structures, leaf
            dtypes or shapes (raised on every replica, naming what differs), or
            ``weights`` not member-first, or cancelling on a replica. With data
            replicas, a replica's refusal of its own gradients or weights is raised
            on every replica, naming that replica (the flag rides in the digest
            exchange), so the others do not wait for it.
        DistributedError: The collective failed (another rank crashed or timed out).

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(2)  # one process: nothing to average
        >>> g = {"w": torch.ones(2, 3)}
        >>> torch.equal(fe.distributed.average_gradients(g, shard)["w"], g["w"])
        True
    """
    where = "average_gradients"
    shard = _check_shard(where, shard)
    leaves, spec = _tree.flatten(grads)
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
    refused, totals = None, None
    try:
        _check_floating(where, leaves, shard)
        totals = None if weights is None else _replica_weights(where, weights, shard, leaves)
    except (TypeError, ValueError) as error:
        if shard.data_size == 1:
            raise
        # The other replicas would wait in the exchange below for this one: the flag in
        # it makes every replica raise this error.
        refused = error
    out = list(leaves)
    with torch.no_grad():
        if shard.data_size == 1:
            for i in tensors:
                out[i] = leaves[i].detach().clone()
            return _tree.unflatten(spec, out)
        _check_replicas_alike(
            where,
            grads if weights is None else {"grads": grads, "weights": weights},
            shard,
            refused,
        )
        buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i in tensors:
            buckets.setdefault((leaves[i].dtype, leaves[i].device), []).append(i)
        for indices in buckets.values():
            if totals is not None:
                _weighted_sum(where, shard, leaves, indices, totals, out)
                continue
            flat = torch.cat([leaves[i].detach().reshape(-1) for i in indices])
            with failures(
                where,
                f"averaging gradients over {shard.data_size} data replicas",
                shard.data_rank,
                shard.data_size,
                group=shard.data_group,
            ):
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=shard.data_group)
            flat /= shard.data_size
            for i, part in zip(
                indices, flat.split([leaves[i].numel() for i in indices]), strict=True
            ):
                out[i] = part.view(leaves[i].shape)
    return _tree.unflatten(spec, out)


def _weighted_sum(
    where: str,
    shard: MemberShard,
    leaves: list[Any],
    indices: list[int],
    totals: Tensor,
    out: list[Any],
) -> None:
    """``sum_d W_d g_d / sum_d W_d`` per member, the totals in the same all-reduce."""
    first = leaves[indices[0]]
    w = totals.to(first.dtype).to(first.device)

    def scaled(g: Tensor) -> Tensor:
        wr = w.view(-1, *[1] * (g.dim() - 1))
        # A replica with no weight adds nothing, even a NaN its loss did not mask.
        return torch.where(wr == 0, torch.zeros_like(g), wr * g.detach()).reshape(-1)

    flat = torch.cat([*[scaled(leaves[i]) for i in indices], w])
    with failures(
        where,
        f"averaging gradients over {shard.data_size} data replicas",
        shard.data_rank,
        shard.data_size,
        group=shard.data_group,
    ):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=shard.data_group)
    parts = flat.split([*[leaves[i].numel() for i in indices], w.numel()])
    total = parts[-1]
    for i, part in zip(indices, parts[:-1], strict=True):
        t = total.view(-1, *[1] * (leaves[i].dim() - 1))
        g = part.view(leaves[i].shape)
        out[i] = torch.where(t == 0, torch.zeros_like(g), g / torch.where(t == 0, 1, t))


def _layout(tree: Any) -> dict[str, str]:
    """The pytree's structure and each leaf's dtype and shape (other leaves by type)."""
    paths, leaves, spec = _tree.flatten_with_paths(tree)
    out = {"the pytree's structure": str(spec)}
    for path, leaf in zip(paths, leaves, strict=True):
        out[f"leaf `{path or 'the tree itself'}`"] = (
            f"{str(leaf.dtype).removeprefix('torch.')}, shape {tuple(leaf.shape)}"
            if isinstance(leaf, Tensor)
            else type(leaf).__name__
        )
    return out


def _nccl(group: Any) -> bool:
    """Whether the group's collectives need CUDA tensors (NCCL)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl"


def _check_replicas_alike(
    where: str, grads: Any, shard: MemberShard, refused: Exception | None = None
) -> None:
    """Refuse, on every data replica, trees that differ in structure, dtypes or shapes,
    and a replica's own refusal of its arguments (``refused``).

    The all-reduce sums flat buffers element by element: trees of another structure or
    leaf shapes with the same number of elements would be averaged without a word,
    mixing values of different parameters. One 8-byte digest per replica is gathered,
    with a flag saying whether the replica refused its arguments; only when a flag is
    set are the refusals exchanged (every replica raises the first one), and only when
    the digests differ are the descriptions exchanged, to name what differs.
    """
    layout = _layout(grads)
    digest = hashlib.blake2b(repr(sorted(layout.items())).encode(), digest_size=8).digest()
    mine = torch.tensor(
        [int.from_bytes(digest, "little", signed=True), int(refused is not None)],
        dtype=torch.int64,
        device="cuda" if _nccl(shard.data_group) else "cpu",
    )
    with failures(
        where,
        f"checking the trees of {shard.data_size} data replicas",
        shard.data_rank,
        shard.data_size,
        group=shard.data_group,
    ):
        found = gather_rows(mine, shard.data_size, shard.data_group)
    if any(flag for _, flag in found):
        raise_refusal(where, refused, shard.data_rank, shard.data_size, shard.data_group)
    if all(d == found[0][0] for d, _ in found):
        return
    advice = (
        "Every data replica must pass gradients of the same members: the same pytree, "
        "leaf dtypes and shapes (the data replicas' ranks in the messages count along "
        "the mesh's data axis)."
    )
    agree(where, layout, shard.data_rank, shard.data_size, shard.data_group, advice)
    raise ValueError(f"{where}: the data replicas passed different pytrees. {advice}")
