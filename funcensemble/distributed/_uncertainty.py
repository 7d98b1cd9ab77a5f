"""A classifier ensemble's predictive distribution and uncertainties, across ranks.

The ranks' versions of ``fe.reduce.mean_probs``, ``predictive_entropy``,
``expected_entropy`` and ``mutual_information``: each rank passes the logits of its own
members and gets the result for all N, computed from all-reduces of per-class and
per-sample sums (never the members' outputs themselves):

- ``log(mean_i p_i)``: the logsumexp over members, across ranks: an all-reduce of the
  per-rank maxima, then of the sums of ``exp(log p_i - max)``.
- the members' mean entropy: an all-reduce of the sums of per-member entropies.
- the mutual information, as ``fe.reduce`` computes it, ``mean_i KL(p_i || mean_j p_j)``
  (no cancellation of two nearly equal entropies): an all-reduce of the sums of
  per-member divergences from the all-reduced mean.

The sums run in another order than in one process, so results agree with
``fe.reduce`` up to rounding (one rank: exactly, it is ``fe.reduce``).
"""

import math

import torch
import torch.distributed as dist
from jaxtyping import Float
from torch import Tensor

from .. import _reduce
from ._collectives import _all_reduce, _check_local, _check_replicas, _check_shard, wide
from ._member_shard import MemberShard


def _local_log_probs(where: str, local: object, shard: object) -> tuple[Tensor, MemberShard]:
    shard = _check_shard(where, shard)
    logits = _check_local(where, "local", local, shard)
    log_probs = _reduce._log_probs(where, logits)
    _check_replicas(where, shard, log_probs.device)
    return log_probs, shard


def _log_mean(where: str, log_probs: Tensor, shard: MemberShard) -> Tensor:
    """``log(mean_i p_i)`` over all N members: ``torch.logsumexp`` split over ranks."""
    top = _all_reduce(where, shard, log_probs.amax(dim=0), dist.ReduceOp.MAX)
    # As torch.logsumexp: an infinite maximum (a class every member gives probability 0)
    # is shifted by 0, so that -inf - -inf never makes a NaN.
    top = torch.where(top.isinf(), torch.zeros_like(top), top)
    exps = (log_probs - top).exp().sum(dim=0, dtype=wide(log_probs))
    total = _all_reduce(where, shard, exps, dist.ReduceOp.SUM)
    return (total.log() + top - math.log(shard.num_members)).to(log_probs.dtype)


def mean_log_probs(
    local: Float[Tensor, "member *batch classes"], shard: MemberShard
) -> Float[Tensor, "*batch classes"]:
    """``log(mean_i softmax(logits_i))`` over all N members, from each rank's logits.

    As [`fe.reduce.mean_log_probs`][funcensemble.reduce.mean_log_probs], in log space
    (a logsumexp over members split into two all-reduces), up to rounding.

    Args:
        local: This rank's logits ``[n_r, ..., C]``, members first, classes last.
        shard: This rank's [`MemberShard`][funcensemble.distributed.MemberShard].

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(2)  # one process; the same under torchrun
        >>> logits = torch.tensor([[[1e4, 0.0]], [[0.0, 1e4]]])
        >>> fe.distributed.mean_log_probs(logits, shard).exp().tolist()
        [[0.5, 0.5]]
    """
    where = "mean_log_probs"
    log_probs, shard = _local_log_probs(where, local, shard)
    if shard.world_size == 1:
        return _reduce._average(log_probs)
    with torch.no_grad():
        return _log_mean(where, log_probs, shard)


def mean_probs(
    local: Float[Tensor, "member *batch classes"], shard: MemberShard
) -> Float[Tensor, "*batch classes"]:
    """The ensemble's predictive distribution ``mean_i softmax(logits_i)`` over all N.

    The exponential of [`mean_log_probs`][funcensemble.distributed.mean_log_probs].

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(5)
        >>> p = fe.distributed.mean_probs(torch.randn(5, 8, 3), shard)
        >>> p.shape, torch.allclose(p.sum(-1), torch.ones(8))
        (torch.Size([8, 3]), True)
    """
    return mean_log_probs(local, shard).exp()


def predictive_entropy(
    local: Float[Tensor, "member *batch classes"], shard: MemberShard
) -> Float[Tensor, "*batch"]:
    """The entropy of all N members' mean prediction, in nats (total uncertainty).

    As [`fe.reduce.predictive_entropy`][funcensemble.reduce.predictive_entropy], from
    the all-reduced [`mean_log_probs`][funcensemble.distributed.mean_log_probs].

    Example:
        >>> import math, torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(2)
        >>> logits = torch.tensor([[[1e4, 0.0]], [[0.0, 1e4]]])  # confident, opposed
        >>> h = fe.distributed.predictive_entropy(logits, shard)
        >>> math.isclose(h.item(), math.log(2), rel_tol=1e-6)
        True
    """
    return _reduce._entropy(mean_log_probs(local, shard))


def expected_entropy(
    local: Float[Tensor, "member *batch classes"], shard: MemberShard
) -> Float[Tensor, "*batch"]:
    """All N members' mean entropy, in nats (aleatoric uncertainty): one all-reduce.

    As [`fe.reduce.expected_entropy`][funcensemble.reduce.expected_entropy].

    Example:
        >>> import torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(2)
        >>> logits = torch.tensor([[[1e4, 0.0]], [[0.0, 1e4]]])  # each member is certain
        >>> fe.distributed.expected_entropy(logits, shard).tolist()
        [0.0]
    """
    where = "expected_entropy"
    log_probs, shard = _local_log_probs(where, local, shard)
    entropies = _reduce._entropy(log_probs)
    if shard.world_size == 1:
        return entropies.mean(dim=0)
    with torch.no_grad():
        total = entropies.sum(dim=0, dtype=wide(entropies))
        total = _all_reduce(where, shard, total, dist.ReduceOp.SUM)
        return (total / shard.num_members).to(entropies.dtype)


def mutual_information(
    local: Float[Tensor, "member *batch classes"], shard: MemberShard
) -> Float[Tensor, "*batch"]:
    """Predictive minus expected entropy over all N members, in nats (BALD).

    As [`fe.reduce.mutual_information`][funcensemble.reduce.mutual_information]:
    ``mean_i KL(p_i || mean_j p_j)``, clamped at 0. Each rank sums its members'
    divergences from the all-reduced mean prediction; one more all-reduce adds them.

    Example:
        >>> import math, torch, funcensemble as fe
        >>> shard = fe.distributed.MemberShard(2)
        >>> logits = torch.tensor([[[1e4, 0.0]], [[0.0, 1e4]]])  # confident, opposed
        >>> mi = fe.distributed.mutual_information(logits, shard)
        >>> math.isclose(mi.item(), math.log(2), rel_tol=1e-6)
        True
    """
    where = "mutual_information"
    log_probs, shard = _local_log_probs(where, local, shard)
    if shard.world_size == 1:
        return _reduce.mutual_information(_check_local(where, "local", local, shard))
    with torch.no_grad():
        average = _log_mean(where, log_probs, shard)
        divergence = (log_probs.exp() * (log_probs - average)).sum(dim=-1)
        total = divergence.sum(dim=0, dtype=wide(divergence))
        total = _all_reduce(where, shard, total, dist.ReduceOp.SUM)
        return (total / shard.num_members).clamp(min=0).to(divergence.dtype)
