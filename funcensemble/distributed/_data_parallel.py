"""Data parallelism within each member: gradients averaged over the mesh's ``"data"`` axis.

Each data replica of a member slice computes its members' gradients of the mean loss
over its equal part of the batch; the mean of those over the D replicas is the gradient
of the mean over the whole batch, what one process computes
(``DistributedDataParallel``'s semantics). Every tensor is packed into one flat buffer
per dtype and device, so a step costs one all-reduce (two for mixed dtypes), not one
per parameter.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _tree
from ._errors import failures
from ._member_shard import MemberShard


def _check_shard(where: str, shard: object) -> MemberShard:
    if not isinstance(shard, MemberShard):
        raise TypeError(
            f"{where}: shard is not a MemberShard (expected a fe.distributed.MemberShard "
            f"describing this rank's members, got {type(shard).__name__}). Build one with "
            "fe.distributed.MemberShard."
        )
    return shard


def average_gradients(grads: Any, shard: MemberShard) -> Any:
    """The mean of every tensor of ``grads`` over the data replicas: DDP's gradient.

    With a ``("member", "data")`` mesh of D replicas, each replica computes its
    members' gradients on its part of the batch
    ([`batch_slice`][funcensemble.distributed.MemberShard.batch_slice]); this
    averages them, so every replica steps its members with the gradient of the loss on
    the whole batch, as one process does (up to rounding: the sum runs in another
    order). Floating-point tensors are packed into one buffer per dtype and device
    and all-reduced at once, one collective per step, not one per tensor. Losses or
    any other per-replica means can be averaged the same way. Without a data axis
    (D = 1) the tensors are returned as they are (copies), with no communication.

    Args:
        grads: A pytree of floating-point tensors (e.g. the gradients from
            [`value_and_grad`][funcensemble.value_and_grad]); ``None`` leaves and
            non-tensor leaves are kept as they are.
        shard: This rank's [`MemberShard`][funcensemble.distributed.MemberShard].

    Returns:
        The same structure with the averaged tensors (new tensors, no autograd
        history), equal on every replica.

    Raises:
        TypeError: A tensor that is not floating-point (an average of integers is
            not an integer).
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
    for i in tensors:
        if not leaves[i].is_floating_point():
            raise TypeError(
                f"{where}: leaf {i} has dtype {leaves[i].dtype} (expected floating-point "
                f"gradients, got {leaves[i].dtype}). Average other values yourself (their "
                "mean is not of their dtype)."
            )
    out = list(leaves)
    with torch.no_grad():
        if shard.data_size == 1:
            for i in tensors:
                out[i] = leaves[i].detach().clone()
            return _tree.unflatten(spec, out)
        buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i in tensors:
            buckets.setdefault((leaves[i].dtype, leaves[i].device), []).append(i)
        for indices in buckets.values():
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
