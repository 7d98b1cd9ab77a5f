"""Per-member gradient clipping: ``clip_grad_norm_`` applied to each member on its own."""

from typing import Any

import torch
from torch import Tensor

from .. import _torch_compat
from .._tree import insertion_order
from ._hyper import Hyper, PerMember, check_members, hyperparameter
from ._protocol import (
    EmptyState,
    GradientTransformation,
    PyTree,
    check_one_member_axis,
    check_tensors,
    flatten,
    leaf_name,
    refuse_integer_updates,
    scatter,
    trainable,
)
from ._recipes import rebuildable

# Norms whose batched reduction over each member's row gives, bit for bit, the norm
# over that member's own tensor (checked in tests/test_clip.py; 1, 3 and 0.5 do not).
_BATCHED_NORMS = (2.0, float("inf"))


def _member_norms(
    where: str, spec: Any, leaves: list[Any], active: list[int], norm_type: float = 2.0
) -> Tensor:
    """Each member's ``norm_type`` norm over all its ``active`` leaves: a ``[N]`` tensor.

    As ``torch.nn.utils.clip_grad_norm_`` computes it for one member: the norm of each
    leaf, then the norm of those norms, in the promoted dtype, on the first leaf's device.
    """
    first = leaves[active[0]]
    norms = []
    # The leaves as the loop's parameters() lists them (optree sorts a dict's keys):
    # the norm of the leaves' norms sums them in that order, as clip_grad_norm_ does.
    # (Compiled, in flatten's order: Dynamo cannot trace rebuilding the tree, and
    # inductor's kernels sum in orders of their own anyway.)
    order = range(len(leaves)) if torch.compiler.is_compiling() else insertion_order(spec)
    taken = set(active)
    for i in [i for i in order if i in taken]:
        g = leaves[i]
        if g.dim() == 0 or g.shape[0] != first.shape[0]:
            got = "no member axis (0-dim)" if g.dim() == 0 else f"leading size {g.shape[0]}"
            raise ValueError(
                f"{where}: {leaf_name(spec, i)} has {got}, unlike "
                f"{leaf_name(spec, active[0])} (expected leading size {first.shape[0]}, got "
                f"{got}). Every gradient needs the member axis first."
            )
        if g.is_meta != first.is_meta:
            meta, other = (i, active[0]) if g.is_meta else (active[0], i)
            raise ValueError(
                f"{where}: {leaf_name(spec, meta)} is on the meta device, which holds no "
                f"values, unlike {leaf_name(spec, other)} (expected every gradient with "
                "values, on the devices of the parameters). Compute the gradients on the "
                "parameters' device."
            )
        if norm_type in _BATCHED_NORMS:
            # Rows read in order, as the loop's contiguous .grad is: across a strided
            # row (a transposed leaf) the float32 sum rounds otherwise.
            rows = g.reshape(g.shape[0], -1).contiguous()
            per_member = torch.linalg.vector_norm(rows, norm_type, dim=1)
        else:
            # A batched reduction sums p-th powers in another order than one over each
            # member's tensor (7e-6 off in float32 for p=1 on a 300x257 leaf, and member
            # 0's norm would depend on N): the norm of each member's slice, as the loop's
            # clip_grad_norm_ takes it of a contiguous .grad (_foreach_norm on CUDA).
            rows = g.contiguous().unbind(0)
            if _torch_compat.inside_transform():  # (vmap has no rule for _foreach_norm)
                per_member = torch.stack([torch.linalg.vector_norm(r, norm_type) for r in rows])
            else:
                per_member = torch.stack(torch._foreach_norm(list(rows), norm_type))
        norms.append(per_member.to(first.device))
    # Each member's leaf norms contiguous, reduced along the last axis as the loop's
    # clip_grad_norm_ reduces its 1-d stack: across a strided axis ([L, N], dim 0) the
    # float32 sum rounds otherwise (a relative 1e-7 for some members, from N >= 2).
    return torch.linalg.vector_norm(torch.stack(norms, dim=1), norm_type, dim=1)


@rebuildable
def clip_by_global_norm(
    max_norm: float | PerMember, norm_type: float = 2.0
) -> GradientTransformation:
    """Clip each member's gradients by that member's own norm over all its leaves.

    Member i's updates are multiplied by ``min(max_norm / (norm_i + 1e-6), 1)``, where
    ``norm_i`` is the ``norm_type`` norm (L2 by default) of member i's slices of every
    floating-point leaf: what ``torch.nn.utils.clip_grad_norm_(member_i.parameters(),
    max_norm, norm_type)`` does to
    member i alone, with the same arithmetic (norms of the leaves, then the norm of
    those; the factor in the promoted dtype of the leaves, each leaf multiplied by it as
    ``clip_grad_norm_`` multiplies: float16 and bfloat16 ones in float32, rounded once).
    Members never affect each other. Leaves whose update is None (no gradient, a
    frozen parameter) are skipped, as ``clip_grad_norm_`` skips parameters without a
    ``.grad``. A non-finite norm makes that member's updates non-finite, as
    ``clip_grad_norm_(error_if_nonfinite=False)`` does.

    Put it first in a [`chain`][funcensemble.optim.chain]:
    ``chain(clip_by_global_norm(1.0), adam(lr=1e-3))`` is, per member,
    ``clip_grad_norm_(member.parameters(), 1.0)`` then ``torch.optim.Adam.step()``.
    The clip acts on the update: through an
    [`EnsembleOptimizer`][funcensemble.optim.EnsembleOptimizer], ``.grad`` keeps the
    unclipped gradients after ``step()`` (``clip_grad_norm_`` scales ``.grad`` in
    place), for logging a gradient norm, say.

    Args:
        max_norm: The largest norm a member's gradients keep: one float, or a ``[N]``
            tensor of per-member values.
        norm_type: The norm's order, as ``clip_grad_norm_``'s: ``2.0`` (the L2 norm),
            any positive float, or ``float("inf")`` (the largest absolute value).

    Raises:
        TypeError: ``max_norm`` is not a float or a floating-point tensor.
        ValueError: A negative ``max_norm``, a per-member tensor not shaped ``[N]``, or
            a ``norm_type`` that is not positive.

    Example:
        >>> import torch, funcensemble as fe
        >>> clip = fe.optim.clip_by_global_norm(1.0)
        >>> grads = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}  # norms 5 and 0.5
        >>> updates, _ = clip.update(grads, clip.init(grads))
        >>> torch.linalg.vector_norm(updates["w"], dim=1)  # member 1 is left as it was
        tensor([1.0000, 0.5000])
    """
    where = "clip_by_global_norm"
    limit = hyperparameter(where, "max_norm", max_norm, label="max_norm")
    order = _norm_type(where, norm_type)

    def init(params: PyTree) -> EmptyState:
        leaves, spec = flatten(params)
        active = trainable(leaves)
        check_one_member_axis(where, "each member's norm", spec, active)
        check_members(limit, where, spec, leaves, active)
        return EmptyState()

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        leaves, spec = flatten(updates)
        check_tensors(where, "the update", spec, leaves)
        refuse_integer_updates(where, "the update", spec, leaves, _leaves_of(params, spec))
        active = trainable(leaves)
        check_one_member_axis(where, "each member's norm", spec, active)
        check_members(limit, where, spec, leaves, active)
        out: list[Any] = [None] * len(leaves)
        if not active:
            return spec.unflatten(out), state
        with torch.no_grad():
            total = _member_norms(where, spec, leaves, active, order)
            coef = _max_norm(limit, total) / (total + 1e-6)
            coef = torch.clamp(coef, max=1.0)
            new = []
            for i in active:
                new.append(_scaled(leaves[i], coef))
        return spec.unflatten(scatter(out, active, new)), state

    # Stateless, and `update` writes none of its inputs: it is its own in-place form.
    return GradientTransformation(init, update, update)


def _leaves_of(params: PyTree, spec: Any) -> list[Any] | None:
    """``params``' leaves in ``spec``'s order, or None (no params, or another tree)."""
    if params is None:
        return None
    leaves, found = flatten(params)
    return leaves if found == spec else None


def _scaled(g: Tensor, coef: Tensor) -> Tensor:
    """``g`` times each member's ``coef``, rounded as ``clip_grad_norm_``'s
    ``_foreach_mul_`` by a 0-dim factor rounds it: the product in the leaf's compute
    dtype (float32 for float16 and bfloat16 leaves, which reads a float32 factor whole),
    then one rounding to the leaf's dtype."""
    compute = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else g.dtype
    factor = coef.to(device=g.device, dtype=compute).reshape([-1] + [1] * (g.dim() - 1))
    if compute == g.dtype:
        return g * factor
    return (g.to(compute) * factor).to(g.dtype)


def _norm_type(where: str, norm_type: object) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(
            f"{where}: norm_type must be a float (expected e.g. 2.0 or float('inf'), got "
            f"{type(norm_type).__name__}). Pass the norm's order as a number."
        )
    if not norm_type > 0:
        raise ValueError(
            f"{where}: norm_type must be positive (expected e.g. 2.0 or float('inf'), got "
            f"{norm_type!r}). Pass a positive order, or float('inf') for the largest value."
        )
    return float(norm_type)


def _max_norm(limit: Hyper, total: Tensor) -> float | Tensor:
    """``max_norm`` as torch uses it: a Python float, or per-member values like ``total``."""
    if isinstance(limit.value, Tensor):
        return limit.value.to(device=total.device, dtype=total.dtype)
    return limit.value
