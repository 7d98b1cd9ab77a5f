"""Parameter groups: a different transform for each group of parameters, by name."""

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor

from .._tree import leaves
from ._protocol import GradientTransformation, PyTree, step_in_place, with_traits
from ._recipes import Recipe, describe, record_recipe

Labels = Mapping[str, str] | Callable[[str], str]


class _LabelsOf:
    """A partition's labels, held where member surgery rebuilds it (``_members.remap``
    calls a callable argument to see whether it is a schedule; this one is not)."""

    def __init__(self, labels: Labels) -> None:
        self.labels = labels

    def __repr__(self) -> str:  # as a recipe's record shows it (see _recipes.describe)
        return describe(self.labels)


def _check_transforms(where: str, transforms: object) -> dict[str, GradientTransformation]:
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"{where}: transforms must be a non-empty dict of label to transform (expected "
            f"e.g. {{'decay': fe.optim.adamw(1e-3), 'no_decay': fe.optim.adam(1e-3)}}, got "
            f"{type(transforms).__name__}). Give one transform per parameter group."
        )
    for label, t in transforms.items():
        if not isinstance(label, str):
            raise TypeError(
                f"{where}: the label {label!r} is a {type(label).__name__} (expected a str). "
                "Name each group with a string."
            )
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"{where}: transforms[{label!r}] is not a GradientTransformation (expected "
                f"one such as fe.optim.adam(1e-3), got {type(t).__name__}). Build it with "
                "fe.optim."
            )
    return dict(transforms)


def partition(
    transforms: Mapping[str, GradientTransformation], labels: Labels
) -> GradientTransformation:
    """Run a different transform on each group of parameters: ``torch.optim``'s param groups.

    ``labels`` names each parameter's group: a dict of parameter name to label, or a
    function of the name (``lambda name: "no_decay" if name.endswith("bias") else
    "decay"``); ``transforms`` gives each label its transform. The parameters are the
    flat dict an ensemble's optimizer steps (``ens.stacked_params()``, ``fe.stack``'s
    ``params``). Over a [`HeteroEnsemble`][funcensemble.HeteroEnsemble] these are
    ``hens.stacked_params()``'s names, ``groups.<g>.stacked.<member's name>`` (e.g.
    ``groups.0.stacked.0.weight``), not the members' own ``0.weight``: a function that
    tests the start of a member's name (``name.startswith("0.")``) must strip
    ``name.split(".stacked.", 1)[1]`` first, while one that tests the end works on
    either. Each transform sees only its own group's leaves (the others are None to
    it), keeps its own state, and steps its leaves as ``torch.optim`` steps a param
    group with those hyperparameters. The state is a dict of label to that transform's
    state. A transform that looks across leaves sees its group's only: chain
    [`clip_by_global_norm`][funcensemble.optim.clip_by_global_norm] before the
    partition to clip each member over all its parameters, as
    ``clip_grad_norm_(model.parameters())`` does.

    Args:
        transforms: One transform per label.
        labels: Each parameter's label: a dict keyed by parameter name (names it
            lacks are refused; names of other parameters are ignored), or a function
            from the name to the label.

    Returns:
        A [`GradientTransformation`][funcensemble.optim.GradientTransformation].

    Raises:
        TypeError: ``transforms`` not a dict of str to transforms, ``labels`` neither a
            dict nor a function, or params not a dict keyed by name.
        ValueError: A parameter without a label, or with a label ``transforms`` lacks.

    Example:
        >>> import torch, funcensemble as fe
        >>> ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(4)])
        >>> opt = fe.optim.EnsembleOptimizer(ens, fe.optim.partition(
        ...     {"decay": fe.optim.adamw(1e-3, weight_decay=0.1),
        ...      "no_decay": fe.optim.adamw(1e-3, weight_decay=0.0)},
        ...     lambda name: "no_decay" if name.endswith("bias") else "decay"))
        >>> sorted(opt.state)
        ['decay', 'no_decay']
    """
    where = "partition"
    parts = _check_transforms(where, transforms)
    if not (isinstance(labels, Mapping) or callable(labels)):
        raise TypeError(
            f"{where}: labels must be a dict of parameter name to label or a function of "
            f"the name (expected one of those, got {type(labels).__name__}). E.g. lambda "
            "name: 'no_decay' if name.endswith('bias') else 'decay'."
        )
    names = sorted(parts)
    if isinstance(labels, Mapping):
        labels = dict(labels)  # a later edit of the caller's dict would move parameters

    def label_of(name: str) -> str:
        if isinstance(labels, Mapping):
            if name not in labels:
                raise ValueError(
                    f"{where}: the parameter `{name}` has no label (expected a key for every "
                    f"parameter, got keys {sorted(labels)[:6]}...). Add it to labels."
                )
            label = labels[name]
        else:
            label = labels(name)
        if not isinstance(label, str) or label not in parts:
            raise ValueError(
                f"{where}: the parameter `{name}` has the label {label!r}, which transforms "
                f"lacks (expected one of {names}). Give that label a transform, or the "
                "parameter another label."
            )
        return label

    def grouping(params: PyTree, what: str) -> dict[str, str]:
        if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
            raise TypeError(
                f"{where}: {what} must be a dict keyed by parameter name (expected the flat "
                f"dict an ensemble's optimizer steps, e.g. ens.stacked_params(), got "
                f"{type(params).__name__}). Pass that dict."
            )
        return {k: label_of(k) for k in params}

    def part(tree: PyTree, group: dict[str, str], label: str) -> dict[str, Any]:
        return {k: (v if group[k] == label else None) for k, v in tree.items()}

    held_by_structure: dict[Any, frozenset[str]] = {}

    def held(substate: Any) -> frozenset[str]:
        """``_names_with_state``, once per state structure (where its Nones are)."""
        key = optree.tree_structure(substate, none_is_leaf=False)
        found = held_by_structure.get(key)
        if found is None:
            found = held_by_structure[key] = frozenset(_names_with_state(substate))
        return found

    def check_grouping(state: dict[str, Any], group: dict[str, str], grads: PyTree) -> None:
        """Refuse a parameter with a gradient that its group keeps no state for while it
        keeps state for its other parameters: the labels changed since the state was
        built, and the group would skip it. (A group that keeps no state per parameter,
        SGD without momentum, takes any.) Not under torch.compile, which cannot trace
        the walk of the state's paths."""
        if torch.compiler.is_compiling():
            return
        for label in names:
            mine = held(state[label])
            if not mine:
                continue
            for k, g in grads.items():
                if group[k] == label and g is not None and k not in mine:
                    raise ValueError(
                        f"{where}: the parameter `{k}` has the label {label!r}, but group "
                        f"{label!r}'s optimizer state has none for it (expected the labels "
                        "the state was built with, got another labelling). Moving a "
                        "parameter to another group is not supported: keep its label, or "
                        "build a new optimizer state for the new groups."
                    )

    def check_state(state: Any) -> None:
        if not isinstance(state, dict) or sorted(state) != names:
            raise ValueError(
                f"{where}: the state is not this partition's (expected a dict with the "
                f"labels {names}, got {type(state).__name__}"
                + (f" with {sorted(state)}" if isinstance(state, dict) else "")
                + "). Pass the state its init returned."
            )

    def init(params: PyTree) -> dict[str, Any]:
        group = grouping(params, "params")
        return {label: parts[label].init(part(params, group, label)) for label in names}

    def update(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        check_state(state)
        group = grouping(grads, "grads")
        check_grouping(state, group, grads)
        out: dict[str, Any] = dict.fromkeys(grads)
        new_state = {}
        params_group = None if params is None else grouping(params, "params")
        for label in names:
            mine = None if params_group is None else part(params, params_group, label)
            updates, new_state[label] = parts[label].update(
                part(grads, group, label), state[label], mine
            )
            for k, u in updates.items():
                if group.get(k) == label:
                    out[k] = u
        return out, new_state

    def update_inplace(grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, Any]:
        check_state(state)
        group = grouping(grads, "grads")
        check_grouping(state, group, grads)
        if not isinstance(params, Mapping) or params.keys() != grads.keys():
            grouping(params, "params")
            raise ValueError(
                f"{where}: params and grads have different names (expected the same keys, "
                f"got {sorted(params)[:6]} and {sorted(grads)[:6]}). Pass grads keyed as "
                "the params."
            )
        # Each group's update_ checks before it writes; so that a later group's refusal
        # leaves the earlier ones as they were too, their parameters and state are
        # copied before they step (the last group's never need to be) and put back.
        saved: list[tuple[Tensor, Tensor]] = []
        new_state = dict(state)
        # The largest group last: its parameters and state need no copy.
        sizes = dict.fromkeys(names, 0)
        for k, label in group.items():
            if isinstance(params[k], Tensor):
                sizes[label] += params[k].numel()
        order = sorted(names, key=lambda label: sizes[label])
        try:
            for k, label in enumerate(order):
                mine = part(params, group, label)
                # Compiled, a refusal stops the tracing, before any step runs.
                if k < len(order) - 1 and not torch.compiler.is_compiling():
                    tensors = [*_tensors(mine), *_tensors(state[label])]
                    saved += [(t, t.clone()) for t in tensors]
                # (The whole tree's memory was checked by the update_ that runs this.)
                new_state[label] = step_in_place(
                    parts[label], part(grads, group, label), state[label], mine, check=False
                )
        except BaseException:
            with torch.no_grad():
                for t, copy in saved:
                    t.copy_(copy)
            raise
        return dict.fromkeys(grads), new_state

    out = GradientTransformation(init, update, update_inplace)
    record_recipe(out, _recipe(parts, labels))
    # Each group's update_ adds its own step to its parameters: the in-place form
    # applies the updates itself (and a chain runs it only last).
    return with_traits(out, applies=True)


def _rebuilt(transforms: dict[str, GradientTransformation], labels: _LabelsOf) -> Any:
    """``partition`` called again by member surgery, with the transforms rebuilt."""
    return partition(transforms, labels.labels)


_rebuilt.__name__ = "partition"  # (what messages and records call it)


def _recipe(parts: dict[str, GradientTransformation], labels: Labels) -> Recipe:
    return (_rebuilt, (parts,), {"labels": _LabelsOf(labels)})


def _tensors(tree: Any) -> list[Tensor]:
    return [x for x in leaves(tree) if isinstance(x, Tensor)]


def _names_with_state(state: Any) -> set[str]:
    """The parameter names a transform's state holds a tensor for (the dict keys its
    tensors sit under)."""
    paths, found = optree.tree_flatten_with_path(state, none_is_leaf=True)[:2]
    return {
        path[-1]
        for path, x in zip(paths, found, strict=True)
        if path and isinstance(path[-1], str) and x is not None
    }
