"""Member surgery on an optimizer: its state and its per-member hyperparameters follow.

A transform holds its hyperparameters in closures, so the library's own constructors
(``adam``, ``sgd``, ``chain``, ...) record how they were called (``rebuildable``); a
transform with ``[N]`` per-member values is rebuilt from that record with the values
of the selected members.
"""

import inspect
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

from .._core.members import Indices, check_indices, join, num_members, take
from .._tree import flatten_with_paths
from ._adam import AdamState
from ._protocol import GradientTransformation, PyTree
from ._recipes import Recipe, recipe_of
from ._rmsprop import RMSpropState
from ._sgd import SGDState
from ._transforms import ScheduleState


def _recipe(where: str, t: GradientTransformation) -> Recipe:
    recipe = recipe_of(t.update)
    if recipe is None:
        raise TypeError(
            f"{where}: cannot tell which hyperparameters of this transform are per member "
            f"(a GradientTransformation built by your own code, update="
            f"{getattr(t.update, '__qualname__', type(t.update).__name__)}). Build the "
            "transform for the selected members yourself (EnsembleOptimizer's surgery "
            "methods take it as transform=; fe.select picks the state's members)."
        )
    return recipe


def remap(where: str, t: GradientTransformation, fn: Callable[[str, Tensor], Tensor]) -> Any:
    """``t`` rebuilt with every ``[N]`` hyperparameter ``v`` replaced by ``fn(label, v)``.

    Floats, 0-dim tensors (shared by all members) and schedules are kept as they are.
    """
    build, args, kwargs = _recipe(where, t)
    name = getattr(build, "__name__", "transform")
    try:
        names = list(inspect.signature(build).parameters)
    except (TypeError, ValueError):
        names = []

    def arg(label: str, value: Any) -> Any:
        if isinstance(value, GradientTransformation):
            return remap(where, value, fn)
        if isinstance(value, Tensor) and value.dim() == 1:
            return fn(label, value)
        if isinstance(value, (tuple, list)):
            return type(value)(arg(f"{label}[{k}]", v) for k, v in enumerate(value))
        if isinstance(value, dict):  # partition's transforms, by label
            return {k: arg(f"{label}[{k!r}]", v) for k, v in value.items()}
        if callable(value):  # a schedule lr(count): kept, unless its values are per member
            first = value(torch.zeros((), dtype=torch.int64))
            if isinstance(first, Tensor) and first.dim() == 1:
                raise TypeError(
                    f"{where}: {label} is a schedule returning per-member values (shape "
                    f"{tuple(first.shape)}), which cannot be reordered with the members. Pass "
                    "transform= built for the new members (a schedule of their values)."
                )
        return value

    def label(k: int) -> str:
        return f"{name}({names[k]}=...)" if k < len(names) else f"{name}(argument {k})"

    new_args = [arg(label(k), v) for k, v in enumerate(args)]
    new_kwargs = {k: arg(f"{name}({k}=...)", v) for k, v in kwargs.items()}
    return build(*new_args, **new_kwargs)


def per_member_sizes(where: str, t: GradientTransformation) -> list[tuple[str, int]]:
    """``(label, length)`` of every per-member hyperparameter of ``t`` (none: ``[]``)."""
    found: list[tuple[str, int]] = []

    def record(label: str, value: Tensor) -> Tensor:
        found.append((label, value.shape[0]))
        return value

    remap(where, t, record)
    return found


def selected(where: str, t: GradientTransformation, indices: list[int], n: int) -> Any:
    """``t`` with its per-member hyperparameters of members ``indices`` (checked, of ``n``)."""

    def pick(label: str, value: Tensor) -> Tensor:
        if value.shape[0] != n:
            raise ValueError(
                f"{where}: {label} has {value.shape[0]} per-member values, but the optimizer "
                f"has {n} members (expected one value per member)."
            )
        return value.index_select(0, torch.tensor(indices, device=value.device))

    return remap(where, t, pick)


def _members(where: str, t: GradientTransformation, state: Any) -> int | None:
    """N as the state shows it, or as the transform's per-member values do."""
    n = num_members(where, "state", state)
    for label, size in per_member_sizes(where, t):
        if n is None:
            n = size
        elif size != n:
            raise ValueError(
                f"{where}: {label} has {size} per-member values, but the state has {n} "
                "members (expected one value per member)."
            )
    return n


def select(
    transform: GradientTransformation, state: Any, indices: Indices
) -> tuple[GradientTransformation, Any]:
    """An optimizer's transform and state for the members ``indices``.

    The functional face of member surgery for the optimizer, beside
    [`fe.select`][funcensemble.select] for the parameters: the state's per-member
    tensors (moments, momentum buffers) are those of the selected members, and every
    ``[N]`` per-member hyperparameter of ``transform`` (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ...) is rebuilt with the selected members' values, so each
    member keeps stepping as before. Step counts are one per parameter, shared by all
    members while all members step together (then copied as they are), or one per
    member once members joined an optimizer that had stepped (then selected with
    their members). Copy member i over member j
    with ``idx = list(range(N)); idx[j] = i``: member j then has member i's state and
    hyperparameters, as after ``load_state_dict`` of member i's ``torch.optim``
    state. A learning-rate schedule is your function and is kept as it is; one that
    returns per-member values is refused (build the transform for the new members
    yourself).

    Args:
        transform: A transform built by ``fe.optim`` (``adam``, ``sgd``, ``chain`` of
            them, ...).
        state: Its state, for N members.
        indices: Member indices (a sequence of ints or a 1-D integer tensor; negative
            ones count back; duplicates give copies).

    Returns:
        ``(transform, state)`` for ``len(indices)`` members; new objects, the inputs
        are unchanged.

    Raises:
        TypeError: ``transform`` is not a GradientTransformation, or one built by your
            own code, or with a schedule returning per-member values (these cannot be
            reordered: rebuild it yourself and select the state with
            [`fe.select`][funcensemble.select]); bad ``indices``.
        ValueError: Empty ``indices``, or per-member values of another length than N.
        IndexError: An index out of range.

    Example:
        >>> import torch, funcensemble as fe
        >>> _, params, _ = fe.stack([torch.nn.Linear(3, 1) for _ in range(4)])
        >>> opt = fe.optim.adam(lr=torch.tensor([0.1, 0.2, 0.3, 0.4]))
        >>> state = opt.init(params)
        >>> opt2, state2 = fe.optim.select(opt, state, [3, 0])
        >>> params2 = fe.select(params, [3, 0])
        >>> grads = {k: torch.ones_like(v) for k, v in params2.items()}
        >>> updates, _ = opt2.update(grads, state2, params2)
        >>> updates["bias"].flatten()  # member 3's lr, then member 0's
        tensor([-0.4000, -0.1000])
    """
    where = "optim.select"
    if not isinstance(transform, GradientTransformation):
        raise TypeError(
            f"{where}: transform is not a GradientTransformation (expected one such as "
            f"fe.optim.adam(), got {type(transform).__name__}). Build one with fe.optim, "
            "e.g. fe.optim.adam(1e-3)."
        )
    n = _members(where, transform, state)
    idx = check_indices(where, indices, n)
    new_transform = transform if n is None else selected(where, transform, idx, n)
    return new_transform, take(state, idx)


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape)}, {x.dtype}, {x.device}"
    return repr(x)


def check_state_like(where: str, expected: Any, state: Any, fix: str) -> None:
    """Check that ``state`` has ``expected``'s structure and leaf shapes, dtypes, devices.

    Step counts may be per member (``[N]``) where ``expected``, fresh from ``init``,
    has them shared (0-dim).
    """
    per_member = [c.shape[0] for c in _counts(state) if isinstance(c, Tensor) and c.dim() == 1]
    paths, want, spec = flatten_with_paths(expected, "state")
    # Each count as it is, or per member: one transform's counts may be per member while
    # another's are not (a partition's groups).
    also = spec.flatten_up_to(_per_member_counts(expected, per_member[0])) if per_member else want
    try:
        got = spec.flatten_up_to(state)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{where}: the state does not match the transform's state for these parameters "
            f"(expected {spec}, got {optree.tree_structure(state, none_is_leaf=True)}). {fix}"
        ) from error
    for path, w, w_also, g in zip(paths, want, also, got, strict=True):
        if isinstance(w, Tensor) != isinstance(g, Tensor) or (
            isinstance(w, Tensor)
            and (w.shape, w.dtype, w.device) != (g.shape, g.dtype, g.device)
            and (w_also.shape, w_also.dtype, w_also.device) != (g.shape, g.dtype, g.device)
        ):
            raise ValueError(
                f"{where}: {path} is {_describe(g)}; these parameters need {_describe(w)}. {fix}"
            )


# The states whose step counts are one per parameter (0-dim), or one per member ([N])
# once members with counts of their own have joined, and the field holding them.
_COUNTED = {AdamState: "count", SGDState: "count", RMSpropState: "step"}


def _is_counted(node: Any) -> bool:
    return type(node) in _COUNTED or isinstance(node, ScheduleState)


def _counts(tree: Any) -> list[Any]:
    """Every step-count leaf of the counted states in ``tree``, in order."""
    out: list[Any] = []
    for node in optree.tree_leaves(tree, is_leaf=_is_counted, none_is_leaf=True):
        if type(node) in _COUNTED:
            out.extend(optree.tree_leaves(getattr(node, _COUNTED[type(node)]), none_is_leaf=True))
    return out


def count_sizes(tree: Any) -> list[int]:
    """For each leaf of ``tree`` (``None`` included): for a step count, the member count
    of its state (the leading size of the state's other tensors), else -1; -1 too where
    the state has no other tensor with a member axis."""

    def size(node: Any) -> Any:
        if type(node) not in _COUNTED:
            return optree.tree_map(lambda _: -1, node, none_is_leaf=True)
        field = _COUNTED[type(node)]
        others = [
            leaf
            for f, v in zip(node._fields, node, strict=True)
            if f != field
            for leaf in optree.tree_leaves(v)
            if isinstance(leaf, Tensor) and leaf.dim() > 0
        ]
        n = others[0].shape[0] if others else -1
        return type(node)(
            *(
                optree.tree_map(lambda _, f=f: n if f == field else -1, v, none_is_leaf=True)
                for f, v in zip(node._fields, node, strict=True)
            )
        )

    sized = optree.tree_map(size, tree, is_leaf=_is_counted, none_is_leaf=True)
    return optree.tree_leaves(sized, none_is_leaf=True)


def count_mask(tree: Any) -> list[bool]:
    """For each leaf of ``tree`` (``None`` included), whether it is a step count."""

    def mark(node: Any) -> Any:
        if type(node) not in _COUNTED:
            return optree.tree_map(lambda _: False, node, none_is_leaf=True)
        return type(node)(
            *(
                optree.tree_map(lambda _, f=f: f == _COUNTED[type(node)], v, none_is_leaf=True)
                for f, v in zip(node._fields, node, strict=True)
            )
        )

    marked = optree.tree_map(mark, tree, is_leaf=_is_counted, none_is_leaf=True)
    return optree.tree_leaves(marked, none_is_leaf=True)


def _per_member_counts(tree: Any, n: int) -> Any:
    """``tree`` with each 0-dim step count of a counted state expanded to ``[n]``."""

    def expand(c: Any) -> Any:
        return c.expand(n).clone() if isinstance(c, Tensor) and c.dim() == 0 else c

    def fix(node: Any) -> Any:
        if type(node) not in _COUNTED:
            return node
        field = _COUNTED[type(node)]
        counts = optree.tree_map(expand, getattr(node, field), none_is_leaf=True)
        return node._replace(**{field: counts})

    return optree.tree_map(fix, tree, is_leaf=_is_counted, none_is_leaf=True)


def grown(where: str, state: Any, fresh: Any) -> Any:
    """``state`` followed by the members ``fresh`` has beyond it (``fresh`` from init)."""
    n_old = num_members(where, "state", state)
    n_new = num_members(where, "the new state", fresh)
    if n_old is not None and (n_new is None or n_new <= n_old):
        raise ValueError(
            f"{where}: the parameters have {n_new} members, the state {n_old} (expected "
            "the grown parameters: the state's members followed by the new ones)."
        )
    spec = optree.tree_structure(state, none_is_leaf=True)
    try:
        spec.flatten_up_to(fresh)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{where}: the state does not match the transform's state for these parameters "
            f"(expected {optree.tree_structure(fresh, none_is_leaf=True)}, got {spec}). Pass "
            "the transform the state came from (or one with the same layout)."
        ) from error
    schedules = [
        (old, new)
        for old, new in zip(
            optree.tree_leaves(state, is_leaf=_is_counted, none_is_leaf=True),
            optree.tree_leaves(fresh, is_leaf=_is_counted, none_is_leaf=True),
            strict=True,
        )
        if isinstance(old, ScheduleState) and isinstance(new, ScheduleState)
    ]
    for old, new in schedules:
        if not torch.equal(old.count, new.count.to(old.count.device)):
            raise ValueError(
                f"{where}: the learning-rate schedule has been called {old.count.item()} "
                "times; its count is one for all members, so new members cannot start their "
                "schedule at 0 as a new torch.optim scheduler would. Add members before the "
                "first step, or use a constant (float or per-member) lr."
            )
    if n_old is None:
        # No member axis anywhere in the state: its step counts enter no arithmetic
        # (SGD without momentum keeps no buffer), so the old ones stand for all members.
        return join(where, [state, _same_counts(state, fresh)], "states")
    tail = take(fresh, list(range(n_old, n_new)))  # type: ignore[arg-type]
    old_counts, new_counts = _counts(state), _counts(tail)
    differ = any(
        isinstance(o, Tensor)
        and isinstance(c, Tensor)
        and (o.dim() != 0 or not torch.equal(o, c.to(o.device, o.dtype)))
        for o, c in zip(old_counts, new_counts, strict=True)
    )
    if differ:
        # The old members have stepped, the new ones start at 0, as in torch.optim:
        # each member keeps its own count from now on.
        state = _per_member_counts(state, n_old)
        tail = _per_member_counts(tail, n_new - n_old)
    return join(where, [state, tail], "states")


def _same_counts(state: Any, fresh: Any) -> Any:
    """``fresh`` with the step counts of ``state``."""
    olds = iter(_counts(state))

    def fix(node: Any) -> Any:
        if type(node) not in _COUNTED:
            return node
        field = _COUNTED[type(node)]
        counts = optree.tree_map(lambda _: next(olds), getattr(node, field), none_is_leaf=True)
        return node._replace(**{field: counts})

    return optree.tree_map(fix, fresh, is_leaf=_is_counted, none_is_leaf=True)


def concat(transform: GradientTransformation, state: Any, params: PyTree) -> Any:
    """The state for ``params`` grown by new members: the old state, then a fresh one.

    The members beyond the state's N get the state ``transform.init`` gives them, as
    a fresh ``torch.optim`` optimizer of a new member would have. ``transform`` is
    the one that will step the grown ensemble: reuse the old one if its
    hyperparameters are floats, or build one with ``[N + M]`` per-member values
    (``fe.optim.adam(lr=torch.cat([lr, new_lr]))``). Grow the parameters with
    [`fe.concat`][funcensemble.concat] first.

    Step counts (Adam's bias correction, SGD's first momentum step) are one per
    parameter, shared by all members, while all members have stepped together. New
    members start at 0, as in a new ``torch.optim`` optimizer, so once the old ones
    have stepped the counts become ``[N + M]`` tensors, one per member, and every
    member goes on counting its own steps. A learning-rate schedule's count is one for
    all members: new members cannot join a schedule that has been called (a clear
    error), since a new ``torch.optim`` scheduler would start at 0.

    Args:
        transform: The transform for all N + M members.
        state: The state for the first N members.
        params: The grown parameters, N + M members (the first N the state's).

    Returns:
        The state for ``params``; new tensors, ``state`` is unchanged.

    Raises:
        TypeError: ``transform`` is not a GradientTransformation.
        ValueError: ``params`` with no more members than the state, a state of another
            transform, or a schedule that has been called (see above); and ``init``'s
            errors (per-member values not shaped ``[N + M]``).

    Example:
        >>> import torch, funcensemble as fe
        >>> _, params, _ = fe.stack([torch.nn.Linear(3, 1) for _ in range(2)])
        >>> opt = fe.optim.sgd(lr=0.1, momentum=0.9)
        >>> state = opt.init(params)
        >>> _, more, _ = fe.stack([torch.nn.Linear(3, 1)])
        >>> params = fe.concat([params, more])
        >>> state = fe.optim.concat(opt, state, params)
        >>> state[0].momentum_buffer["weight"].shape
        torch.Size([3, 1, 3])
    """
    where = "optim.concat"
    if not isinstance(transform, GradientTransformation):
        raise TypeError(
            f"{where}: transform is not a GradientTransformation (expected one such as "
            f"fe.optim.adam(), got {type(transform).__name__}). Build one with fe.optim, "
            "e.g. fe.optim.adam(1e-3)."
        )
    with torch.no_grad():
        fresh = transform.init(params)
    return grown(where, state, fresh)
