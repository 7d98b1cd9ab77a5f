"""Polyak averaging (soft target updates) of stacked parameters: ``t <- tau*o + (1-tau)*t``."""

from typing import Any

import optree
import torch
from torch import Tensor

from .. import _torch_compat
from .._core.tree_view import Stacked, state_view
from .._types import StackedTree
from . import _aliasing
from ._hyper import (
    Hyper,
    PerMember,
    check_members,
    hyperparameter,
    per_leaf,
)
from ._protocol import PyTree, flatten, leaf_name


def _check(
    where: str, target: PyTree, online: PyTree, tau: object, *, in_place: bool
) -> tuple[list[Any], list[Any], optree.PyTreeSpec, Hyper]:
    """Validate everything up front; return aligned leaves and tau."""
    # An Ensemble stands for its stacked parameters and buffers (its registered view).
    target_view, online_view = state_view(target), state_view(online)
    if (target_view is None) != (online_view is None):
        raise TypeError(
            f"{where}: target and online must both be Ensembles or both be pytrees of "
            f"tensors (expected two of a kind, got {type(target).__name__} and "
            f"{type(online).__name__}). Pass two Ensembles, or the two pytrees."
        )
    if target_view is not None:
        groups = [getattr(x, "group_members", None) for x in (target, online)]
        if groups[0] != groups[1]:
            # Two HeteroEnsembles of one structure whose members are grouped in
            # another order: leaf by leaf, target member i would take another member.
            raise ValueError(
                f"{where}: target and online group their members differently (expected "
                f"the same groups of members, got {groups[0]} in target and {groups[1]} "
                "in online). Build both from members of the same architectures in the "
                "same order, e.g. the target as a copy of the online ensemble."
            )
        target, online = target_view, online_view
    tau_ = hyperparameter(where, "tau", tau, label="tau", upper=1.0, upper_closed=True)
    targets, spec = flatten(target)
    onlines, online_spec = flatten(online)
    if spec != online_spec:
        raise ValueError(
            f"{where}: target and online differ in structure: {spec} vs {online_spec}. "
            "They must hold the same names (the same architecture)."
        )
    floats = []
    for i, (t, o) in enumerate(zip(targets, onlines, strict=True)):
        if t is None and o is None:
            continue
        if not isinstance(t, Tensor) or not isinstance(o, Tensor):
            raise TypeError(
                f"{where}: {leaf_name(spec, i, 'target')} must be a tensor in both trees, got "
                f"{type(t).__name__} (target) and {type(o).__name__} (online)."
            )
        if t.shape != o.shape or t.dtype != o.dtype or t.device != o.device:
            raise ValueError(
                f"{where}: {leaf_name(spec, i, 'target')} is {tuple(t.shape)} {t.dtype} on "
                f"{t.device} in target but {tuple(o.shape)} {o.dtype} on {o.device} in "
                "online; they must match."
            )
        if _averaged(t):
            floats.append(i)
        if in_place and not torch.compiler.is_compiling():
            _check_in_place(where, leaf_name(spec, i, "target"), t, o, tau_)
    if in_place and not torch.compiler.is_compiling():
        _check_across_leaves(where, spec, targets, onlines)
    check_members(tau_, where, spec, targets, floats, "target", exact=False)  # (see _lerped)
    return targets, onlines, spec, tau_


def _check_across_leaves(
    where: str, spec: optree.PyTreeSpec, targets: list[Any], onlines: list[Any]
) -> None:
    """Refuse target leaves sharing memory with one another or with another leaf of
    online: the loop would read, leaf after leaf, values it has already averaged."""
    ts = [i for i, t in enumerate(targets) if isinstance(t, Tensor)]
    os = [i for i, o in enumerate(onlines) if isinstance(o, Tensor)]
    clash = _aliasing.first_clash(
        [targets[i] for i in ts], [onlines[i] for i in os], allowed=lambda w, r: ts[w] == os[r]
    )
    if clash is None:
        return
    w, r = clash
    first = leaf_name(spec, ts[w], "target")
    second = leaf_name(spec, os[r], "online") if r >= 0 else leaf_name(spec, ts[-1 - r], "target")
    raise ValueError(
        f"{where}: {first} shares memory with {second} (expected separate tensors, got "
        "views of one tensor), so averaging one leaf in place would change what another "
        "reads. Make the target a copy of online (e.g. a .clone() of each leaf)."
    )


def _check_in_place(where: str, name: str, t: Tensor, o: Tensor, tau: Hyper) -> None:
    """Refuse a target leaf that cannot take its new value in place, before any changes."""
    wrapped = _torch_compat.is_wrapped(t) or _torch_compat.is_wrapped(o)
    if not wrapped:
        _check_writable(where, name, t)
        shared = _aliasing.partly_shared(t, o)
    else:
        # Inside a torch.func transform the memory is the unwrapped tensors'.
        t_, o_ = _torch_compat.fully_unwrapped(t), _torch_compat.fully_unwrapped(o)
        _check_writable(where, name, t_)
        levels = _torch_compat.batch_levels(o)
        if _averaged(t) and isinstance(tau.value, Tensor):
            levels |= _torch_compat.batch_levels(tau.value)
        if not levels <= _torch_compat.batch_levels(t):
            raise ValueError(
                f"{where}: {name} is not batched by every torch.func.vmap that batches its "
                "new value (expected a target mapped wherever online or tau is, got one "
                "shared by the vmap's calls), and vmap cannot write it in place. Map the "
                "target as online (in_dims), or use polyak_update, which returns new tensors."
            )
        # The tensor beneath may be mapped along other dims for each: what a member
        # reads is unknown, so any memory in common counts (only t is o is safe).
        shared = _torch_compat.same_storage(t_, o_)
    if shared and t is not o:
        raise ValueError(
            f"{where}: {name} shares part of its memory with the same leaf of online "
            "(expected separate tensors, or the same one: got overlapping slices of one "
            "tensor"
            + (", or parts of one tensor inside a torch.func transform" if wrapped else "")
            + "), which torch cannot update in place. Make the target a copy of online "
            "(e.g. .clone())."
        )


def _averaged(t: Tensor) -> bool:
    """Floating-point and complex leaves are averaged; the others copied."""
    return t.is_floating_point() or t.is_complex()


def _check_writable(where: str, name: str, t: Tensor) -> None:
    """Refuse, before any leaf changes, a target leaf an in-place write would fail on."""
    problem = _aliasing.unwritable(t)
    if problem is None:
        return
    raise ValueError(
        f"{where}: {name} is {problem[0]}, which cannot be updated in place (expected a "
        f"tensor that owns its elements, got {problem[0]}). Make the target writable: "
        f"{problem[1]}."
    )


def _split(targets: list[Any]) -> tuple[list[int], list[int]]:
    floats = [i for i, t in enumerate(targets) if t is not None and _averaged(t)]
    others = [i for i, t in enumerate(targets) if t is not None and not _averaged(t)]
    return floats, others


_HALF = (torch.float16, torch.bfloat16)


def _lerped(ts: list[Tensor], os: list[Tensor], tau: Hyper) -> list[Tensor]:
    """``ts[k].lerp(os[k], tau)``, with a per-member ``tau`` in float32 for half-precision
    leaves, as the loop's ``t.lerp_(o, float(tau[i]))`` computes (a tau cast to the
    leaf's dtype would be rounded: 0.3 becomes 0.30078125 in bfloat16)."""
    if not isinstance(tau.value, Tensor) or not any(t.dtype in _HALF for t in ts):
        return _lerp(ts, os, per_leaf(tau, ts), in_place=False)
    out = []
    for t, o, w in zip(ts, os, per_leaf(tau, ts, [_wide(t) for t in ts]), strict=True):
        out.append(
            t.to(w.dtype).lerp(o.to(w.dtype), w).to(t.dtype) if t.dtype in _HALF else t.lerp(o, w)
        )
    return out


def _unbatchable(error: RuntimeError) -> bool:
    """Whether a multi-tensor op failed for want of a vmap batching rule (before it
    computed anything)."""
    return _torch_compat.missing_batching_rule(str(error)) is not None


def _lerp(
    ts: list[Tensor], os: list[Tensor], weights: float | list[Tensor], *, in_place: bool
) -> list[Tensor]:
    """``ts[k].lerp(os[k], w)`` for every leaf: one multi-tensor kernel, or one op per
    leaf under ``torch.func.vmap`` (the multi-tensor ops have no batching rule there)."""
    try:
        if in_place:
            torch._foreach_lerp_(ts, os, weights)
            return ts
        return list(torch._foreach_lerp(ts, os, weights))
    except RuntimeError as error:
        if not _unbatchable(error):
            raise
    ws = [weights] * len(ts) if isinstance(weights, float) else weights
    out = [t.lerp(o, w) for t, o, w in zip(ts, os, ws, strict=True)]
    if in_place:  # (lerp_ falls back to a slow loop with a warning; copy_ is batched)
        _copy_(ts, out)
        return ts
    return out


def _copy_(ts: list[Tensor], os: list[Tensor]) -> None:
    """``ts[k].copy_(os[k])`` for every leaf (one op per leaf under vmap, as ``_lerp``)."""
    try:
        torch._foreach_copy_(ts, os)
        return
    except RuntimeError as error:
        if not _unbatchable(error):
            raise
    for t, o in zip(ts, os, strict=True):
        t.copy_(o)


def _wide(t: Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in _HALF else t.dtype


def polyak_update_(
    target: Stacked | StackedTree, online: Stacked | StackedTree, tau: float | PerMember
) -> None:
    """Move ``target`` towards ``online`` in place: ``target <- tau*online + (1-tau)*target``.

    The soft target-network update of DDPG/SAC/TD3, for all leaves at once (one
    ``torch._foreach_lerp_`` kernel): each member gets what ``t.lerp_(o, tau)`` gives
    it, bit for bit. A loop written as ``t.mul_(1 - tau).add_(tau * o)`` rounds twice
    more: the two agree to a few float32 ulps, but in float16 or bfloat16 they drift
    apart over many steps (the ``lerp`` being the closer to exact). With Ensembles,
    their stacked parameters and floating-point buffers (e.g. BatchNorm running
    statistics) are averaged. Leaves that are not floating point (e.g. BatchNorm's
    ``num_batches_tracked``) cannot be averaged: they are copied from ``online``,
    whatever ``tau``; complex leaves are averaged. Everything is checked before anything
    changes (a target that cannot be written in place, such as an expanded view or an
    inference tensor, is refused; so, eagerly, is a target sharing memory with its
    online leaf or another target leaf, a check ``torch.compile`` skips: see the
    compile guide); no autograd history is recorded. Under
    ``torch.func.vmap`` (e.g. over seeds) it runs one op per leaf, with the same
    numbers; a target leaf must be mapped wherever its online leaf or ``tau`` is.

    Args:
        target: The tree updated in place: an [`Ensemble`][funcensemble.Ensemble] or a
            pytree (e.g. dict) of tensors.
        online: The tree averaged in; same kind, structure, shapes, dtypes and devices.
        tau: How far to move, in ``[0, 1]``; a float or a ``[N]`` tensor of
            per-member values. ``1`` gives ``online``'s values wherever ``target`` is
            finite; a NaN or infinite target value gives NaN, as ``t.lerp_(o, 1.0)``
            does (``0 * inf``): fill a fresh target with ``copy_``, not with ``tau=1``.

    Raises:
        ValueError: ``tau`` outside ``[0, 1]``, a per-member ``tau`` not matching the
            member count, or trees that differ in structure, shape, dtype or device.
        TypeError: An Ensemble paired with a pytree, or non-tensor leaves.

    Example:
        >>> import torch, funcensemble as fe
        >>> target = {"w": torch.zeros(2, 3)}
        >>> fe.optim.polyak_update_(target, {"w": torch.ones(2, 3)}, tau=0.1)
        >>> torch.allclose(target["w"], torch.full((2, 3), 0.1))
        True
    """
    targets, onlines, _, tau_ = _check("polyak_update_", target, online, tau, in_place=True)
    floats, others = _split(targets)
    with torch.no_grad():
        if floats:
            ts, os = [targets[i] for i in floats], [onlines[i] for i in floats]
            if isinstance(tau_.value, Tensor) and any(t.dtype in _HALF for t in ts):
                _copy_(ts, _lerped(ts, os, tau_))
            else:
                _lerp(ts, os, per_leaf(tau_, ts), in_place=True)
        if others:
            _copy_([targets[i] for i in others], [onlines[i] for i in others])


def polyak_update(target: StackedTree, online: StackedTree, tau: float | PerMember) -> StackedTree:
    """``tau * online + (1 - tau) * target`` as a new pytree; the inputs are untouched.

    The pure form of [`polyak_update_`][funcensemble.optim.polyak_update_] for pytrees
    (use the in-place form for Ensembles). Non-floating leaves are copies of
    ``online``'s. Results are fresh autograd leaves with ``target``'s
    ``requires_grad``.

    Args:
        target: A pytree of tensors.
        online: A pytree of the same structure, shapes, dtypes and devices.
        tau: In ``[0, 1]``; a float or a ``[N]`` tensor of per-member values.

    Returns:
        The averaged tree, shaped like ``target``.

    Raises:
        ValueError: As [`polyak_update_`][funcensemble.optim.polyak_update_].
        TypeError: An Ensemble (use ``polyak_update_``), or non-tensor leaves.

    Example:
        >>> import torch, funcensemble as fe
        >>> target, online = {"w": torch.zeros(3, 2)}, {"w": torch.ones(3, 2)}
        >>> new = fe.optim.polyak_update(target, online, tau=torch.tensor([0.0, 0.5, 1.0]))
        >>> new["w"][:, 0].tolist(), target["w"].sum().item()
        ([0.0, 0.5, 1.0], 0.0)
    """
    where = "polyak_update"
    if state_view(target) is not None or state_view(online) is not None:
        raise TypeError(
            f"{where}: got an Ensemble; use polyak_update_ to update an Ensemble in place, "
            "or pass pytrees such as ens.stacked_params()."
        )
    targets, onlines, spec, tau_ = _check(where, target, online, tau, in_place=False)
    floats, others = _split(targets)
    out = list(targets)
    with torch.no_grad():
        if floats:
            ts, os = [targets[i] for i in floats], [onlines[i] for i in floats]
            fresh_leaves = not _torch_compat.inside_transform()  # (wrapped: no leaves)
            for i, new in zip(floats, _lerped(ts, os, tau_), strict=True):
                out[i] = new.requires_grad_(targets[i].requires_grad) if fresh_leaves else new
        for i in others:
            out[i] = onlines[i].clone()
    return spec.unflatten(out)
