"""funcensemble's pytree helpers (optree, None kept as a leaf)."""

import random
import warnings
from collections import OrderedDict, defaultdict, deque, namedtuple

import optree
import pytest
import torch

from funcensemble import _tree

Pair = namedtuple("Pair", "a b")


@pytest.mark.parametrize(
    ("prefix", "tree", "expected"),
    [
        (0, [1, 2], [0, 0]),
        (None, {"a": 1}, [None]),
        ({"a": 0, "b": None}, {"b": 1, "a": 2}, [0, None]),  # leaves in key order a, b
        # An OrderedDict flattens as inserted, a dict sorted: matched by key either way.
        (OrderedDict(b=0, a=None), {"a": 1, "b": 2}, [None, 0]),
        ({"a": 0, "b": None}, OrderedDict(b=1, a=2), [None, 0]),
        (
            OrderedDict(b=None, a=OrderedDict(q=0, p=None)),
            {"a": {"p": 1, "q": 2}, "b": [3, 4]},
            [None, 0, None, None],
        ),
        ((0, None), (1, [2, 3]), [0, None, None]),
        (Pair(0, None), Pair(1, (2, 3)), [0, None, None]),
        ([0, None], [1, {"x": 2, "y": None}], [0, None, None]),
        ((0,), (1, 2), None),
        ({"a": 0}, {"a": 1, "b": 2}, None),
    ],
)
def test_broadcast_prefix_reads_in_dims_as_vmap_does(prefix, tree, expected):
    assert _tree.broadcast_prefix(prefix, tree) == expected
    # The walk (dicts, lists, tuples, namedtuples) agrees with optree's own matching.
    assert _tree._broadcast_by_spec(prefix, _tree.flatten(tree)[1]) == expected


def test_none_is_a_leaf_and_dict_order_comes_back():
    tree = {"b": None, "a": torch.ones(1)}
    leaves, spec = _tree.flatten(tree)
    assert leaves[0] is not None and leaves[1] is None  # sorted keys: a, b
    assert list(_tree.unflatten(spec, leaves)) == ["b", "a"]
    assert _tree.tree_map(lambda x: x is None, tree) == {"b": True, "a": False}


def test_paths_name_the_leaves():
    paths, leaves, _ = _tree.flatten_with_paths({"x": [1, None]}, "batch")
    assert paths == ["batch['x'][0]", "batch['x'][1]"] and leaves == [1, None]


def test_check_same_structure_says_what_differs():
    _, spec = _tree.flatten({"w": 1, "b": 2})
    assert _tree.check_same_structure("f", "grads", spec, {"b": 3, "w": 4}, "Fix.") == [
        3,
        4,
    ]  # sorted keys
    with pytest.raises(
        ValueError, match=r"f: grads do not match the expected structure \(expected"
    ):
        _tree.check_same_structure("f", "grads", spec, {"w": 1}, "Fix.")


Triple = namedtuple("Triple", "a b c")


def _random_tree(rng, depth):
    """A random pytree of ints and ``None`` in dicts, OrderedDicts, defaultdicts,
    lists, tuples, namedtuples and deques (which the walk hands to optree)."""
    kind = rng.randrange(9 if depth else 2)
    if kind == 0:
        return None
    if kind == 1:
        return rng.randrange(3)
    size = rng.randrange(4)
    children = [_random_tree(rng, depth - 1) for _ in range(size)]
    keys = rng.sample(["a", "b", "c", 1, 2], size)
    if kind == 2:
        return dict(zip(keys, children, strict=True))
    if kind == 3:
        return OrderedDict(zip(keys, children, strict=True))
    if kind == 4:
        return defaultdict(list, zip(keys, children, strict=True))
    if kind == 5:
        return children
    if kind == 6:
        return tuple(children)
    if kind == 7:
        return Triple(*(children + [None] * 3)[:3])
    return deque(children)


def _prefixes(rng, tree):
    """Prefixes of ``tree`` (an int or None for a subtree, containers kept or retyped
    among the mappings), and near misses: a key added or dropped, a sequence retyped
    or shortened."""
    if rng.random() < 0.3 or tree is None or isinstance(tree, int):
        return rng.choice([None, 0, 1])
    if isinstance(tree, dict):
        items = [(k, _prefixes(rng, v)) for k, v in tree.items()]
        rng.shuffle(items)  # the prefix's key order need not be the tree's
        out = dict(items)
        r = rng.random()
        if r < 0.1:
            out["z"] = 0
        elif r < 0.2 and out:
            out.pop(next(iter(out)))
        kind = rng.choice([dict, OrderedDict, lambda items: defaultdict(int, items)])
        return kind(list(out.items()))
    children = [_prefixes(rng, v) for v in tree]
    r = rng.random()
    if r < 0.1 and children:
        children = children[:-1]
    if isinstance(tree, Triple):
        return Triple(*(children + [None] * 3)[:3]) if r >= 0.2 else tuple(children)
    if isinstance(tree, deque):
        return deque(children)
    kind = type(tree) if r >= 0.2 else rng.choice([list, tuple])
    return kind(children)


def _assert_dicts_like(prefix, tree):
    """Every dict of ``prefix`` is ``tree``'s at its place: same type, same key order."""
    if isinstance(prefix, dict):
        assert type(prefix) is type(tree) and list(prefix) == list(tree)
        for k in prefix:
            _assert_dicts_like(prefix[k], tree[k])
    elif isinstance(prefix, (list, tuple, deque)):
        for p, t in zip(prefix, tree, strict=True):
            _assert_dicts_like(p, t)


def test_broadcast_prefix_walk_agrees_with_optree_on_random_trees():
    rng = random.Random(0)
    matched = refused = 0
    for _ in range(3000):
        tree = _random_tree(rng, 3)
        prefix = _prefixes(rng, tree)
        want = _tree._broadcast_by_spec(prefix, _tree.flatten(tree)[1])
        assert _tree.broadcast_prefix(prefix, tree) == want, (prefix, tree)
        if want is None:
            refused += 1
            continue
        matched += 1
        # Spelled out: the tree's own containers and key order, the same broadcast.
        spelled = _tree.in_key_order(prefix, tree)
        assert _tree.broadcast_prefix(spelled, tree) == want
        _assert_dicts_like(spelled, tree)
    assert matched > 1000 and refused > 300  # both sides of the walk were exercised


# A namedtuple class registered with optree as a node of its own, in the namespace
# funcensemble reads (optree only warns): it may name and order its children as it likes.
_GLOBAL = optree.registry.__dict__.get("__GLOBAL_NAMESPACE", "")


@pytest.mark.parametrize(
    ("entries", "swapped"), [(("a", "b"), False), ((0, 1), True)], ids=["by_name", "swapped"]
)
def test_broadcast_prefix_reads_a_registered_namedtuple_as_optree_does(entries, swapped):
    Swapped = namedtuple("Swapped", "a b")

    def flatten(t):
        return ((t.b, t.a) if swapped else (t.a, t.b)), None, entries

    def unflatten(_, children):
        return Swapped(*(reversed(children) if swapped else children))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optree: namedtuples are nodes already
        optree.register_pytree_node(Swapped, flatten, unflatten, namespace=_GLOBAL)
    try:
        tree = Swapped([1, 2], None)
        prefix = Swapped(0, None)
        want = [None, 0, 0] if swapped else [0, 0, None]
        assert _tree._broadcast_by_spec(prefix, _tree.flatten(tree)[1]) == want
        assert _tree.broadcast_prefix(prefix, tree) == want
        assert _tree.broadcast_prefix({"x": prefix}, {"x": tree}) == want
    finally:
        optree.unregister_pytree_node(Swapped, namespace=_GLOBAL)
