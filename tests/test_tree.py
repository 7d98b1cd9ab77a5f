"""funcensemble's pytree helpers (optree, None kept as a leaf)."""

from collections import OrderedDict, namedtuple

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
    _, spec = _tree.flatten(tree)
    assert _tree.broadcast_prefix(prefix, spec) == expected


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
