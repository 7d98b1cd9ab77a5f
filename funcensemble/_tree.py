"""The package's pytree helpers, on optree (the one pytree library funcensemble uses).

``None`` is a leaf of its own everywhere (``none_is_leaf=True``): a gradient of
``None`` or an input of ``None`` keeps its place, as in ``torch.func``'s own trees.
"""

from collections.abc import Callable
from typing import Any

import optree

PyTreeSpec = optree.PyTreeSpec


def flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Leaves and structure, with every ``None`` kept as a leaf of its own."""
    return optree.tree_flatten(tree, none_is_leaf=True)


def unflatten(spec: PyTreeSpec, leaves: list[Any]) -> Any:
    """The inverse of [`flatten`][]."""
    return optree.tree_unflatten(spec, leaves)


def flatten_with_paths(tree: Any, root: str = "") -> tuple[list[str], list[Any], PyTreeSpec]:
    """Leaves with readable paths (``root['x'][0]``), and the structure."""
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, none_is_leaf=True)
    return [a.codify(root) for a in accessors], leaves, spec


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf, ``None`` leaves included."""
    return optree.tree_map(fn, tree, none_is_leaf=True)


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, ``None`` leaves included."""
    return optree.tree_leaves(tree, none_is_leaf=True)


def broadcast_prefix(prefix: Any, spec: PyTreeSpec) -> list[Any] | None:
    """``prefix`` (a pytree matching a prefix of ``spec``, e.g. an ``in_dims`` entry)
    broadcast to one value per leaf of ``spec``, or ``None`` if it is no prefix of it.

    A leaf of ``prefix`` (an int or ``None``) stands for the whole subtree at its place,
    as ``torch.func.vmap`` reads ``in_dims``. The values come in ``spec``'s leaf order,
    matched by key: a dict and an ``OrderedDict`` flatten in different key orders (sorted,
    and as inserted), so the prefix's own leaf order may not be ``spec``'s.
    """
    try:
        prefix_leaves, prefix_spec = flatten(prefix)
        # Each of spec's leaves replaced by its position, to see where each subtree lands.
        positions = optree.tree_unflatten(spec, list(range(spec.num_leaves)))
        subtrees = prefix_spec.flatten_up_to(positions)
    except (ValueError, TypeError):
        return None
    out: list[Any] = [None] * spec.num_leaves
    for value, subtree in zip(prefix_leaves, subtrees, strict=True):
        for position in leaves(subtree):
            out[position] = value
    return out


def check_same_structure(
    where: str,
    what: str,
    expected: PyTreeSpec,
    tree: Any,
    fix: str,
    reference: str = "the expected structure",
) -> list[Any]:
    """``tree``'s leaves aligned with ``expected``'s, or a ``ValueError`` saying how the
    structures differ (``where: what do not match reference (expected S, got T). fix``)."""
    try:
        return expected.flatten_up_to(tree)
    except (ValueError, TypeError) as error:
        got = optree.tree_structure(tree, none_is_leaf=True)
        raise ValueError(
            f"{where}: {what} do not match {reference} (expected {expected}, got {got}). {fix}"
        ) from error
