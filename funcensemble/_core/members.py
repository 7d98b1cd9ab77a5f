"""Member surgery on stacked pytrees: pick members by index, or join pytrees member-wise.

A leaf with a leading axis is per member (``[N, ...]``); a 0-dim tensor (an optimizer's
step count, a schedule's count) or a non-tensor leaf is one value shared by all members.
"""

import operator
import re
from collections.abc import Sequence
from typing import Any, SupportsIndex

import numpy as np
import torch
from torch import Tensor, nn

from .. import _tree
from .._messages import a

PyTree = Any
Indices = Sequence[int] | Tensor | np.ndarray


def member_index(value: object) -> int | None:
    """``value`` as one member index: an int, a NumPy integer or a 0-d integer tensor
    (``losses.argmin()``); None for anything else, bools included."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, Tensor):
        integer = (
            not (value.is_floating_point() or value.is_complex()) and value.dtype != torch.bool
        )
        return int(value) if value.dim() == 0 and integer else None
    if isinstance(value, np.ndarray) and (value.ndim != 0 or value.dtype.kind not in "iu"):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def checked_member_index(where: str, index: SupportsIndex, n: int) -> int:
    """One member index in ``[0, n)`` (negative ones count back), or a clear error."""
    i = member_index(index)
    if i is None:
        raise TypeError(
            f"{where}: index must be an int (expected a member index, got "
            f"{type(index).__name__}). Pass an int in range(num_members); a NumPy integer "
            "or a 0-d integer tensor (losses.argmin()) works too."
        )
    if not -n <= i < n:
        raise IndexError(
            f"{where}: index {i} is out of range for an ensemble of {n} members (valid: "
            f"{-n} to {n - 1})."
        )
    return i % n


def check_indices(
    where: str, indices: object, n: int | None, *, what: str = "indices"
) -> list[int]:
    """``indices`` as a non-empty list of ints in ``[0, n)`` (negative ones count back).

    With ``n`` None (nothing in the tree has a member axis) negative indices are kept.
    """
    if isinstance(indices, Tensor):
        if indices.dim() != 1 or indices.is_floating_point() or indices.dtype == torch.bool:
            raise TypeError(
                f"{where}: {what} as a tensor must be a 1-D integer tensor, got shape "
                f"{tuple(indices.shape)} and dtype {indices.dtype}. For a boolean mask "
                "pass mask.nonzero().squeeze(1)."
            )
        out = [int(i) for i in indices.tolist()]
    elif isinstance(indices, np.ndarray):
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise TypeError(
                f"{where}: {what} as a NumPy array must be 1-D of integers, got shape "
                f"{indices.shape} and dtype {indices.dtype}. For a boolean mask pass "
                "mask.nonzero()[0]."
            )
        out = [int(i) for i in indices.tolist()]
    elif isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
        raise TypeError(
            f"{where}: {what} must be a sequence of ints or a 1-D integer tensor or "
            f"NumPy array, got {type(indices).__name__}."
        )
    else:
        out = []
        for k, i in enumerate(indices):
            try:  # ints, and integer scalars such as numpy's (not bool, not floats)
                if isinstance(i, bool) or (isinstance(i, Tensor) and i.dtype == torch.bool):
                    raise TypeError
                out.append(operator.index(i))
            except TypeError:
                raise TypeError(
                    f"{where}: {what}[{k}] must be an int (expected a member index, got "
                    f"{type(i).__name__} {i!r}). Pass member indices as ints."
                ) from None
    if not out:
        raise ValueError(f"{where}: {what} is empty (expected at least one member index).")
    if n is None:
        return out
    for k, i in enumerate(out):
        if not -n <= i < n:
            raise IndexError(
                f"{where}: {what}[{k}] is {i}, out of range for {n} members (valid: {-n} "
                f"to {n - 1})."
            )
    return [i % n for i in out]


_GROUP = re.compile(r"groups\.(\d+)\.stacked\.")


def _refuse_groups(where: str, what: str, paths: list[str]) -> None:
    """Refuse a HeteroEnsemble's tensors: one member axis per group, not one for all.

    Their names are ``groups.<g>.stacked.<name>`` (``HeteroEnsemble.stacked_params``
    and its optimizer's state); with groups of equal sizes every leaf has the same
    leading size, and indices would silently pick members within each group.
    """
    groups: dict[str, str] = {}
    for path in paths:
        found = _GROUP.search(path)
        if found is not None:
            groups.setdefault(found.group(1), path)
    if len(groups) > 1:
        first, second = list(groups.values())[:2]
        raise ValueError(
            f"{where}: {what} holds a HeteroEnsemble's groups ({first} and {second}), each "
            "with its own member axis (expected one member axis for all members), so "
            "member indices would pick members within each group. Rebuild instead: "
            "fe.HeteroEnsemble([hens.member(i) for i in indices]) and a new optimizer "
            "(hens.optimizer(...))."
        )


def num_members(where: str, what: str, tree: PyTree) -> int | None:
    """The leading size N shared by every leaf with a member axis, or None if no leaf has one."""
    paths, leaves, _ = _tree.flatten_with_paths(tree, what)
    _refuse_groups(where, what, paths)
    for path, leaf in zip(paths, leaves, strict=True):
        if isinstance(leaf, nn.Module):
            # A module is one opaque leaf: it would come back as it is, unselected.
            at = "" if path in ("", what) else f" at {path}"
            raise TypeError(
                f"{where}: {what}{at} is {a(type(leaf).__name__)} module, not a pytree of "
                "stacked tensors (expected e.g. params from fe.stack, or an optimizer "
                "state). For an Ensemble, use its own method (ens.select / ens.concat); "
                "for a HeteroEnsemble, build a new one from hens.member(i) for the members "
                "to keep."
            )
    n, first = None, None
    for path, leaf in zip(paths, leaves, strict=True):
        if isinstance(leaf, Tensor) and leaf.dim() >= 1:
            if n is None:
                n, first = leaf.shape[0], path
            elif leaf.shape[0] != n:
                raise ValueError(
                    f"{where}: {path} has leading size {leaf.shape[0]}, but {first} has {n} "
                    "(expected one member axis of one size N in every leaf with a leading "
                    "axis). Pass a stacked pytree (params, buffers or optimizer state)."
                )
    return n


def _fresh(leaf: Tensor, value: Tensor) -> Tensor:
    # Stacked parameters are fresh autograd leaves (as fe.stack makes them): a tensor
    # that required grad comes back as a leaf that requires grad, nothing else does.
    return value.requires_grad_(True) if leaf.requires_grad else value


def take(tree: PyTree, indices: list[int]) -> PyTree:
    """``tree`` with members ``indices`` (already checked), as fresh tensors."""
    leaves, spec = _tree.flatten(tree)
    out = []
    cache: dict[torch.device, Tensor] = {}
    with torch.no_grad():
        for leaf in leaves:
            if not isinstance(leaf, Tensor):
                out.append(leaf)
            elif leaf.dim() == 0:
                out.append(_fresh(leaf, leaf.detach().clone()))
            else:
                index = cache.get(leaf.device)
                if index is None:
                    index = cache[leaf.device] = torch.tensor(indices, device=leaf.device)
                out.append(_fresh(leaf, leaf.detach().index_select(0, index)))
    return _tree.unflatten(spec, out)


def select(tree: PyTree, indices: Indices) -> PyTree:
    """The members ``indices`` of a stacked pytree, as a new pytree.

    Every tensor with a leading member axis ``[N, ...]`` becomes ``[len(indices),
    ...]`` holding those members in that order; 0-dim tensors (e.g. an optimizer's
    step count) are values shared by all members and are copied as they are; other
    leaves (``None``) are kept. Works on ``params`` and ``buffers`` from
    [`stack`][funcensemble.stack] and on optimizer states. This is every kind of
    member surgery at once: drop members (select the others), reorder them, or copy
    member i over member j (``idx = list(range(N)); idx[j] = i``). Duplicates are
    allowed and give independent copies; negative indices count back from N. A tree
    without a member axis anywhere (``{}`` buffers, a state of step counts only)
    comes back copied.

    Nothing is shared with ``tree``: the results are new tensors on the leaves'
    devices, in their dtypes. A tensor that requires grad comes back as a fresh
    autograd leaf that requires grad (as [`stack`][funcensemble.stack] makes them),
    so a frozen parameter stays frozen; no autograd history links the two trees.

    Args:
        tree: A pytree whose tensors have the member axis first, e.g. ``params``.
        indices: Member indices: a sequence of ints, or a 1-D integer tensor or NumPy
            array.

    Returns:
        A pytree shaped like ``tree`` with ``len(indices)`` members.

    Raises:
        TypeError: ``indices`` is not a sequence of ints or a 1-D integer array.
        ValueError: ``indices`` is empty, or the leaves' leading sizes differ.
        IndexError: An index out of range (checked before anything is built).

    Example:
        >>> import torch, funcensemble as fe
        >>> fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 2) for _ in range(4)])
        >>> kept = fe.select(params, [0, 2, -1])  # drop member 1
        >>> kept["weight"].shape, torch.equal(kept["weight"][2], params["weight"][3])
        (torch.Size([3, 2, 3]), True)
        >>> copied = fe.select(params, [0, 1, 0, 3])  # copy member 0 over member 2
        >>> torch.equal(copied["bias"][2], params["bias"][0]), copied["bias"].is_leaf
        (True, True)
    """
    n = num_members("select", "tree", tree)
    return take(tree, check_indices("select", indices, n))


def join(where: str, trees: list[PyTree], what: str = "trees") -> PyTree:
    """``trees`` (already of one structure) joined member-wise, after checking every leaf."""
    spec = _tree.flatten(trees[0])[1]
    paths = _tree.flatten_with_paths(trees[0], "tree")[0]
    columns = [
        _tree.check_same_structure(
            where, f"{what}[{k}]", spec, t, f"Pass {what} of one structure (e.g. all params)."
        )
        for k, t in enumerate(trees)
    ]
    for k, t in enumerate(trees):
        num_members(where, f"{what}[{k}]", t)
    out = []
    for j, path in enumerate(paths):
        row = [c[j] for c in columns]
        first = row[0]
        if not isinstance(first, Tensor):
            for k, x in enumerate(row[1:], start=1):
                if isinstance(x, Tensor) or x != first:
                    raise ValueError(
                        f"{where}: {path} is {x!r} in {what}[{k}] but {first!r} in "
                        f"{what}[0] (a value shared by all members must agree)."
                    )
            out.append(first)  # not a list: kept as it is
            continue
        for k, x in enumerate(row[1:], start=1):
            if not isinstance(x, Tensor):
                raise TypeError(
                    f"{where}: {path} is a {type(x).__name__} in {what}[{k}] but a tensor in "
                    f"{what}[0]."
                )
            got = (x.dim() == 0, x.shape[1:], x.dtype, x.device, x.requires_grad)
            want = (first.dim() == 0, first.shape[1:], first.dtype, first.device)
            if got[:4] != want or got[4] != first.requires_grad:
                trailing = tuple(first.shape[1:])
                want_shape = "a 0-dim tensor" if first.dim() == 0 else f"shape (*, {trailing})"
                raise ValueError(
                    f"{where}: {path} has shape {tuple(x.shape)}, dtype {x.dtype}, device "
                    f"{x.device}, requires_grad={x.requires_grad} in {what}[{k}] (expected "
                    f"{want_shape}, {first.dtype}, {first.device}, "
                    f"requires_grad={first.requires_grad} as in {what}[0]). Members must "
                    "share one architecture, dtype and device."
                )
            if first.dim() == 0 and not torch.equal(x, first):
                raise ValueError(
                    f"{where}: {path} is {x.item()!r} in {what}[{k}] but {first.item()!r} in "
                    f"{what}[0]. A 0-dim tensor is one value shared by all members (an "
                    "optimizer's step count, say), so it must agree. To join optimizer "
                    "states that took different numbers of steps, make each count one "
                    "value per member first (count.expand(n).clone(), n its state's "
                    "members: fe.optim's adam, sgd and rmsprop step per-member counts, "
                    "but a learning-rate schedule takes one count, so states with a "
                    "schedule cannot join so); fe.optim.concat instead gives joining "
                    "members a fresh state."
                )
        out.append(row)
    with torch.no_grad():  # everything checked: build
        built = [_joined(row) if isinstance(row, list) else row for row in out]
    return _tree.unflatten(spec, built)


def _joined(row: list[Tensor]) -> Tensor:
    """One leaf's tensors from every tree, joined: the shared 0-dim value, or the cat."""
    first = row[0]
    value = first.detach().clone() if first.dim() == 0 else torch.cat([x.detach() for x in row])
    return _fresh(first, value)


def concat(trees: Sequence[PyTree]) -> PyTree:
    """Stacked pytrees of one structure joined along the member axis (members appended).

    Tensors with a member axis are concatenated in order: the result holds the
    members of ``trees[0]``, then those of ``trees[1]``, and so on. 0-dim tensors and
    other leaves are values shared by all members: they must be equal in every tree.
    The results are new tensors; tensors that require grad come back as fresh
    autograd leaves, as in [`select`][funcensemble.select]. Everything is checked
    before anything is built. To add members from modules, stack them first
    (``fe.stack(new_modules)``) or use
    [`Ensemble.concat`][funcensemble.Ensemble.concat], which checks that they share
    the ensemble's architecture.

    Args:
        trees: A non-empty sequence of stacked pytrees of one structure.

    Returns:
        One pytree with the members of all ``trees``.

    Raises:
        TypeError: ``trees`` is not a sequence, or a leaf is a tensor in one tree but
            not in another.
        ValueError: No trees; trees of different structures; a leaf differing in
            trailing shape, dtype, device or ``requires_grad``; or a shared (0-dim or
            non-tensor) value that differs between trees.

    Example:
        >>> import torch, funcensemble as fe
        >>> _, params, _ = fe.stack([torch.nn.Linear(3, 2) for _ in range(4)])
        >>> _, more, _ = fe.stack([torch.nn.Linear(3, 2) for _ in range(2)])
        >>> both = fe.concat([params, more])
        >>> both["weight"].shape, torch.equal(both["bias"][4:], more["bias"])
        (torch.Size([6, 2, 3]), True)
    """
    if isinstance(trees, (str, bytes)) or not isinstance(trees, Sequence):
        raise TypeError(
            f"concat: trees must be a sequence of pytrees (expected e.g. a list, got "
            f"{type(trees).__name__}). Pass the pytrees to join in a list."
        )
    trees = list(trees)
    if not trees:
        raise ValueError(
            "concat: trees is empty (expected at least one pytree, got 0). Pass the pytrees "
            "to join, one per group of members."
        )
    return join("concat", trees)


def copy_mapping(
    where: str, src: SupportsIndex | Indices, dst: SupportsIndex | Indices, n: int
) -> list[int]:
    """``list(range(n))`` with ``dst[k]`` replaced by ``src[k]``, after checking both."""

    def as_list(what: str, value: Any) -> list[int]:
        one = member_index(value)
        return check_indices(where, value if one is None else [one], n, what=what)

    s, d = as_list("src", src), as_list("dst", dst)
    if len(s) != len(d):
        raise ValueError(
            f"{where}: src and dst must pair up (expected as many sources as destinations, "
            f"got {len(s)} and {len(d)})."
        )
    if len(set(d)) != len(d):
        twice = sorted({j for j in d if d.count(j) > 1})
        raise ValueError(
            f"{where}: dst names member {twice[0]} more than once (expected distinct "
            "destinations: which source would it get?)."
        )
    mapping = list(range(n))
    for i, j in zip(s, d, strict=True):
        mapping[j] = i
    return mapping


def copy_leaves_(tree: PyTree, mapping: list[int]) -> None:
    """Every leaf with a member axis rewritten in place as ``leaf[mapping]``.

    Only the members that change are read and written; the sources are read before
    anything is written (so a swap works).
    """
    moved = [(i, j) for j, i in enumerate(mapping) if i != j]
    if not moved:
        return
    src, dst = [i for i, _ in moved], [j for _, j in moved]
    with torch.no_grad():
        for leaf in _tree.leaves(tree):
            if isinstance(leaf, Tensor) and leaf.dim() >= 1:
                rows = leaf.index_select(0, torch.tensor(src, device=leaf.device))
                leaf.index_copy_(0, torch.tensor(dst, device=leaf.device), rows)
