"""The package's pytree helpers, on optree (the one pytree library funcensemble uses).

``None`` is a leaf of its own everywhere (``none_is_leaf=True``): a gradient of
``None`` or an input of ``None`` keeps its place, as in ``torch.func``'s own trees.
"""

import functools
from collections import OrderedDict, defaultdict
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


@functools.lru_cache(maxsize=64)
def insertion_order(spec: PyTreeSpec) -> tuple[int, ...]:
    """The leaves' indices in ``flatten``'s order, listed as the tree's dicts were filled.

    optree flattens a ``dict`` by sorted key (``'p10'`` before ``'p2'``), a module's
    ``named_parameters()`` come in registration order: a reduction over leaves that
    must round as torch's loop over ``parameters()`` takes them in this order.
    """
    tree = optree.tree_unflatten(spec, list(range(spec.num_leaves)))  # insertion order
    order: list[int] = []

    def walk(node: Any) -> None:
        if type(node) is int:
            order.append(node)
        elif type(node) in (dict, defaultdict):
            for child in node.values():
                walk(child)
        else:
            for child in optree.tree_flatten_one_level(node, none_is_leaf=True)[0]:
                walk(child)

    walk(tree)
    return tuple(order)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf, ``None`` leaves included."""
    return optree.tree_map(fn, tree, none_is_leaf=True)


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, ``None`` leaves included."""
    return optree.tree_leaves(tree, none_is_leaf=True)


# The containers optree flattens as nodes whose children it names by key (any of the
# three matches any other with the same keys) or by position (the same type only).
_MAPPINGS = (dict, OrderedDict, defaultdict)
_SEQUENCES = (list, tuple)


class _OtherNode(Exception):
    """A prefix node the walk does not know (a deque, a class registered with optree)."""


_NO_MATCH = object()  # what _walk returns where the prefix does not match the tree


def broadcast_prefix(prefix: Any, tree: Any) -> list[Any] | None:
    """``prefix`` (a pytree matching a prefix of ``tree``, e.g. an ``in_dims`` entry)
    broadcast to one value per leaf of ``tree``, or ``None`` if it is no prefix of it.

    A leaf of ``prefix`` (an int or ``None``) stands for the whole subtree at its place,
    as ``torch.func.vmap`` reads ``in_dims``. The values come in ``tree``'s leaf order,
    matched by key: a dict and an ``OrderedDict`` flatten in different key orders (sorted,
    and as inserted), so the prefix's own leaf order may not be ``tree``'s.
    """
    matched = _match(prefix, tree)
    return None if matched is None else matched[0]


def in_key_order(prefix: Any, tree: Any) -> Any:
    """``prefix`` with each of its dicts rebuilt as ``tree``'s container at that place
    (its type, its key order); ``prefix`` must be a prefix of ``tree``.

    ``torch.func.vmap`` pairs a dict of ``in_dims`` with its argument's keys by
    position: given in another key order, it would map the wrong leaf.
    """
    matched = _match(prefix, tree)
    if matched is None:
        raise ValueError(f"in_key_order: {prefix!r} is no prefix of the tree")
    return matched[1]


def _match(prefix: Any, tree: Any) -> tuple[list[Any], Any] | None:
    """``broadcast_prefix`` and ``in_key_order`` of ``prefix`` over ``tree`` together, or
    ``None`` if it is no prefix of it.

    The prefix's dicts, lists, tuples and namedtuples are walked here, and ``tree``'s
    leaves found by their paths: under ``torch.compile``, Dynamo cannot flatten a dict
    of ints with optree (torch 2.13), nor unflatten one. Other prefix nodes go through
    optree's ``flatten_up_to``.
    """
    found: dict[tuple[Any, ...], Any] = {}
    try:
        rebuilt = _walk(prefix, tree, (), found)
    except _OtherNode:
        return _match_by_spec(prefix, tree)
    if rebuilt is _NO_MATCH:
        return None
    values = []
    for path in optree.tree_paths(tree, none_is_leaf=True):
        # One of the path's heads is a prefix leaf (the walk matched every container
        # above it), unless a container names its children otherwise than by key or
        # position (a namedtuple registered with optree by field name).
        for end in range(len(path) + 1):
            if path[:end] in found:
                values.append(found[path[:end]])
                break
        else:
            return _match_by_spec(prefix, tree)
    return values, rebuilt


def _walk(prefix: Any, tree: Any, path: tuple[Any, ...], found: dict[tuple[Any, ...], Any]) -> Any:
    """Record in ``found`` the path of each of ``prefix``'s leaves in ``tree``, and return
    ``prefix`` with its dicts rebuilt as ``tree``'s; ``_NO_MATCH`` where a container of
    ``prefix`` is not ``tree``'s at the same place."""
    if prefix is None or isinstance(prefix, int):
        found[path] = prefix
        return prefix
    if type(prefix) in _MAPPINGS:
        if type(tree) not in _MAPPINGS or set(prefix) != set(tree):
            return _NO_MATCH
        items = []
        for k in tree:
            child = _walk(prefix[k], tree[k], (*path, k), found)
            if child is _NO_MATCH:
                return _NO_MATCH
            items.append((k, child))
        if type(tree) is defaultdict:
            return defaultdict(tree.default_factory, items)
        return type(tree)(items)
    namedtuple = _is_namedtuple(prefix)
    if type(prefix) in _SEQUENCES or namedtuple:
        if type(tree) is not type(prefix) or len(tree) != len(prefix):
            return _NO_MATCH
        children = []
        for i, (p, t) in enumerate(zip(prefix, tree, strict=True)):
            child = _walk(p, t, (*path, i), found)
            if child is _NO_MATCH:
                return _NO_MATCH
            children.append(child)
        return type(prefix)(*children) if namedtuple else type(prefix)(children)
    raise _OtherNode


def _is_namedtuple(x: Any) -> bool:
    """Whether ``x`` is a namedtuple that optree flattens as one, by position (in Python
    for Dynamo): a namedtuple class registered with optree as a node of its own names
    its children as it likes, and goes through optree's matching instead."""
    cls = type(x)
    fields = getattr(cls, "_fields", None)
    if not (
        issubclass(cls, tuple)
        and isinstance(fields, tuple)
        and all(type(f) is str for f in fields)
        and callable(getattr(cls, "_make", None))
    ):
        return False
    entry = optree.register_pytree_node.get(cls)  # optree's generic namedtuple entry
    return entry is not None and entry.type is not cls


def _match_by_spec(prefix: Any, tree: Any) -> tuple[list[Any], Any] | None:
    """``_match`` by optree's own matching, for any prefix node (eager only); the prefix
    comes back spelled out, one value per leaf in ``tree``'s own structure."""
    _, spec = flatten(tree)
    values = _broadcast_by_spec(prefix, spec)
    return None if values is None else (values, unflatten(spec, values))


def _broadcast_by_spec(prefix: Any, spec: PyTreeSpec) -> list[Any] | None:
    """``broadcast_prefix`` by optree's own matching, for any prefix node (eager only)."""
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
