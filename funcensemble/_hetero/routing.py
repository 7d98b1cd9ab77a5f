"""One optimizer over the groups of a ``HeteroEnsemble``: a transform per group.

The parameters are one flat dict over all groups (``groups.<g>.stacked.<name>``, the
ensemble's own parameter names). Each group gets its own copy of the transform and
steps only its own keys, so a transform that looks across leaves (per-member gradient
clipping) sees each member's own leaves only. Per-member hyperparameters are given in
member order (``[N]``) and routed: group g's transform is built with the values of
group g's members.
"""

import re
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from .._structure.same_value import closure_values
from ..optim._protocol import GradientTransformation, PyTree, step_in_place, with_traits
from ..optim._recipes import record_parts
from . import group_errors

# What each grouped transform was built for (its ensemble's layout), keyed by its
# `update` function, so an EnsembleOptimizer can tell it from a plain transform.
_BUILT_FOR: "weakref.WeakKeyDictionary[Callable[..., Any], Any]" = weakref.WeakKeyDictionary()


def built_for(transform: GradientTransformation) -> Any:
    """The layout ``transform`` was grouped for, or None for any other transform."""
    try:
        return _BUILT_FOR.get(transform.update)
    except TypeError:  # an update that cannot be weakly referenced: the user's own
        return None


# Each grouped transform's check of a built transform it runs (see check_assigned).
_CHECKS: "weakref.WeakKeyDictionary[Callable[..., Any], Callable[[PyTree], None]]" = (
    weakref.WeakKeyDictionary()
)


def check_assigned(transform: GradientTransformation, params: PyTree) -> None:
    """What a grouped transform's ``init`` checks of the transform it runs, without
    building a state: for a transform assigned to a running optimizer."""
    try:
        check = _CHECKS.get(transform.update)
    except TypeError:  # an update that cannot be weakly referenced: the user's own
        return
    if check is not None:
        check(params)


def _route(where: str, name: str, value: Any, index: Tensor, n: int) -> Any:
    """``value`` for the members ``index``: ``[N]`` tensors (also inside tuples and lists,
    and returned by schedules) indexed, everything else as it is."""
    if isinstance(value, Tensor):
        if value.dim() != 1:
            return value
        if value.shape[0] != n:
            raise ValueError(
                f"{where}: {name} has {value.shape[0]} per-member values; this ensemble has "
                f"{n} members. Give a [{n}] tensor, one value per member in member order."
            )
        return value.index_select(0, index.to(value.device))
    if type(value) in (tuple, list):
        return type(value)(_route(where, f"{name}[{k}]", v, index, n) for k, v in enumerate(value))
    if callable(value) and not isinstance(value, type):

        def routed(*args: Any, **kwargs: Any) -> Any:
            out = value(*args, **kwargs)
            if isinstance(out, Tensor) and out.dim() == 1:
                return _route(where, f"the value of the {name} schedule", out, index, n)
            return out

        return routed
    return value


def _split(where: str, what: str, tree: Any, keys: Sequence[Sequence[str]]) -> list[dict]:
    """``tree`` (a flat dict over all groups) as one dict per group."""
    if not isinstance(tree, dict):
        raise TypeError(
            f"{where}: {what} must be a dict keyed by the ensemble's parameter names (as "
            f"hens.stacked_params() returns) (expected a dict, got {type(tree).__name__}). "
            "Pass the dict that hens.stacked_params() returns."
        )
    expected = {k for group in keys for k in group}
    if tree.keys() != expected:
        missing, extra = sorted(expected - tree.keys()), sorted(tree.keys() - expected)
        raise ValueError(
            f"{where}: {what} do not match this ensemble's parameters: missing {missing}, "
            f"unexpected {extra}. Pass a dict with the keys of hens.stacked_params()."
        )
    return [{k: tree[k] for k in group} for group in keys]


def _check_grads(where: str, grads: list[dict], params: list[dict]) -> None:
    """Every gradient None or a tensor like its parameter (checked before any group steps)."""
    for g_part, p_part in zip(grads, params, strict=True):
        for k, g in g_part.items():
            p = p_part[k]
            if g is None:
                continue
            if not isinstance(g, Tensor):
                raise TypeError(
                    f"{where}: the gradient of `{k}` is not a tensor (expected a tensor or "
                    f"None, got {type(g).__name__}). Pass one tensor per parameter, or None."
                )
            if (g.shape, g.dtype, g.device) != (p.shape, p.dtype, p.device):
                raise ValueError(
                    f"{where}: the gradient of `{k}` has shape {tuple(g.shape)}, dtype "
                    f"{g.dtype}, device {g.device} (expected shape {tuple(p.shape)}, dtype "
                    f"{p.dtype}, device {p.device}, like the parameter). Give it the "
                    "parameter's shape, dtype and device."
                )


def _holds_per_member(obj: Any, depth: int, seen: set[int]) -> bool:
    """Whether a built transform's functions hold a tensor with a member axis (a
    per-member hyperparameter), followed through closures, tuples and lists."""
    if depth > 12 or id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        return obj.dim() > 0
    if isinstance(obj, (tuple, list)):  # transforms and Hyper values are tuples too
        return any(_holds_per_member(x, depth + 1, seen) for x in obj)
    if isinstance(obj, dict):  # partition's transforms, by label (not a user's tensors)
        return any(
            _holds_per_member(x, depth + 1, seen)
            for x in obj.values()
            if isinstance(x, GradientTransformation)
        )
    if isinstance(obj, types.FunctionType):
        return any(_holds_per_member(x, depth + 1, seen) for x in closure_values(obj))
    return False


def _refuse_hidden_per_member(
    where: str,
    transform: GradientTransformation,
    parts: list[dict],
    members: Sequence[Sequence[int]],
) -> None:
    """Refuse a built transform that holds per-member values where ``_holds_per_member``
    cannot see them (a ``functools.partial``, a callable object, a schedule returning
    them): it steps, once and at count 0, a few tiny tensors shaped like each group's
    with a member count no group has, which a per-member value of any group's length
    cannot fit. Only a transform's own refusal of such a value counts: another error
    (a transform of the user's own that needs the real shapes) proves nothing."""
    size = max(len(m) for m in members) + 1
    for part in parts:
        probe = {
            k: torch.zeros((size,) + (1,) * (v.dim() - 1), dtype=v.dtype, device=v.device)
            for k, v in part.items()
        }
        grads = {
            k: torch.zeros_like(v) if v.is_floating_point() else None for k, v in probe.items()
        }
        try:
            transform.update(grads, transform.init(probe), probe)
        except (ValueError, TypeError, RuntimeError) as error:
            if "per-member value" not in str(error):
                continue
            raise ValueError(
                f"{where}: the transform holds per-member values, which a built transform "
                f"cannot route to this ensemble's {len(members)} groups: stepped with "
                f"{size} members, it said: {error} (expected a transform with shared "
                "values only, or the function that builds one). Pass the function and the "
                "values, e.g. hens.optimizer(fe.optim.adam, lr=lrs), to give each group its "
                "members' values."
            ) from None


def _in_group(where: str, message: str, g: int, group: Sequence[int], routed: set[str]) -> str:
    """``message`` from building group ``g``'s transform, naming the group, with the
    member positions of the values routed to it ("member 0 of the per-member lr", for
    a keyword in ``routed``) as the ensemble's indices."""

    def member(m: re.Match) -> str:
        k, name = int(m.group(1)), m.group(2)
        if name not in routed or k >= len(group):
            return m.group(0)  # a value the function holds itself: its own numbering
        return f"member {group[k]} of the per-member {name}"

    message = re.sub(r"\bmember (\d+) of the per-member (\w+)", member, message)
    return f"{where}: building group {g} (members {list(group)}): {message}"


def grouped(
    where: str,
    keys: Sequence[Sequence[str]],
    members: Sequence[Sequence[int]],
    layout: Any,
    transform: GradientTransformation | Callable[..., GradientTransformation],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> GradientTransformation:
    """One transform over the flat parameter dict, run group by group (see the module)."""
    n = sum(len(m) for m in members)
    if isinstance(transform, GradientTransformation):
        if args or kwargs:
            raise TypeError(
                f"{where}: got a built transform and arguments; pass either a transform "
                "(the same for every group) or the function that builds one and its "
                "arguments, e.g. hens.optimizer(fe.optim.adam, lr=lrs)."
            )
        if len(keys) > 1 and _holds_per_member(transform, 0, set()):
            # Each group would read the same values by position: value k would reach
            # the k-th member of every group, not member k.
            raise ValueError(
                f"{where}: the transform holds per-member values (a [N] tensor), which a "
                f"built transform cannot route to this ensemble's {len(keys)} groups "
                "(expected a transform with shared values only, or the function that "
                "builds one). Pass the function and the values, e.g. "
                "hens.optimizer(fe.optim.adam, lr=lrs), to give each group its members' values."
            )
        per_group = [transform] * len(keys)
    elif callable(transform):
        routed = []
        for group in members:  # every value is checked before any transform is built
            index = torch.tensor(group)
            routed.append(
                (
                    tuple(_route(where, f"argument {k}", v, index, n) for k, v in enumerate(args)),
                    {name: _route(where, name, v, index, n) for name, v in kwargs.items()},
                )
            )
        per_group = []
        for g, (a, kw) in enumerate(routed):
            try:
                per_group.append(transform(*a, **kw))
            except (ValueError, TypeError) as error:
                if type(error) not in (ValueError, TypeError):
                    raise
                routed_names = {k for k, v in kw.items() if v is not kwargs[k]}
                message = _in_group(where, str(error), g, members[g], routed_names)
                raise type(error)(message) from None
        for t in per_group:
            if not isinstance(t, GradientTransformation):
                raise TypeError(
                    f"{where}: the function did not build a GradientTransformation "
                    f"(expected one such as fe.optim.adam(1e-3), got {type(t).__name__}). "
                    "Pass a function that returns one, such as fe.optim.adam."
                )
    else:
        raise TypeError(
            f"{where}: transform is neither a GradientTransformation nor a function "
            f"building one (expected e.g. fe.optim.adam(1e-3) or fe.optim.adam, got "
            f"{type(transform).__name__}). Build one with fe.optim."
        )

    def check_state(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(keys):
            raise ValueError(
                f"{where}: the state is not this optimizer's (expected the state returned by "
                f"its init, a tuple of {len(keys)} group states, got "
                f"{type(state).__name__}). Pass the state that init returned."
            )

    def check_built(params: PyTree) -> None:
        if isinstance(transform, GradientTransformation) and len(keys) > 1:
            parts = _split(where, "params", params, keys)
            _refuse_hidden_per_member(where, transform, parts, members)

    def init(params: PyTree) -> tuple[Any, ...]:
        states = []
        parts = _split(where, "params", params, keys)
        check_built(params)
        for g, (t, part) in enumerate(zip(per_group, parts, strict=True)):
            try:
                states.append(t.init(part))
            except ValueError as error:
                raise ValueError(
                    f"{where}: group {g} (members {list(members[g])}): {error} With "
                    "several groups, give per-member hyperparameters as "
                    "hens.optimizer(fe.optim.adam, lr=lrs): they are then routed to "
                    "each group's members."
                ) from error
        return tuple(states)

    def update(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        check_state(state)
        g_parts = _split(where, "grads", grads, keys)
        p_parts = (
            _split(where, "params", params, keys) if params is not None else [None] * len(keys)
        )
        updates: dict[str, Any] = {}
        states = []
        for k, (t, g, s, p) in enumerate(zip(per_group, g_parts, state, p_parts, strict=True)):
            with group_errors.naming(where, k, members[k], len(per_group)):
                u, s = t.update(g, s, p)
            updates.update(u)
            states.append(s)
        return {k: updates[k] for k in grads}, tuple(states)

    def update_inplace(grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, Any]:
        check_state(state)
        g_parts = _split(where, "grads", grads, keys)
        p_parts = _split(where, "params", params, keys)
        _check_grads(where, g_parts, p_parts)
        # Each group's update_ checks before it writes; so that a later group's refusal
        # leaves the earlier groups as they were too, their parameters and state are
        # copied before they step (the last group's never need to be) and put back.
        saved: list[tuple[Tensor, Tensor]] = []
        states = []
        try:
            for k, (t, g, s, p) in enumerate(zip(per_group, g_parts, state, p_parts, strict=True)):
                if k < len(per_group) - 1:
                    leaves = optree.tree_leaves((p, s), none_is_leaf=False)
                    saved += [(x, x.clone()) for x in leaves if isinstance(x, Tensor)]
                with group_errors.naming(where, k, members[k], len(per_group)):
                    # (The whole tree's memory was checked by the update_ running this.)
                    states.append(step_in_place(t, g, s, p, check=False))
        except BaseException:
            with torch.no_grad():
                for x, copy in saved:
                    x.copy_(copy)
            raise
        return dict.fromkeys(grads), tuple(states)

    out = GradientTransformation(init, update, update_inplace)
    _BUILT_FOR[out.update] = layout
    _CHECKS[out.update] = check_built
    record_parts(out, "groups", per_group)  # what a checkpoint records of it
    # Each group's update_ adds its own step to its parameters, so the in-place form
    # applies the updates itself (and a chain runs it only last).
    return with_traits(out, applies=True)
