"""The value comparison behind the members' structure check (``_same_value``)."""

import enum
import functools
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from funcensemble._structure.same_value import SameValue, same_tensor


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Plain:
    def __init__(self, value: object) -> None:
        self.value = value


class Slotted:
    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value


def _scaled(x: float, factor: float = 2.0) -> float:
    return x * factor


def _make_closure(factor: float):
    return lambda x: x * factor


def _same(a: object, b: object) -> bool:
    return SameValue({}, set())(a, b)


nan = float("nan")
SAME = [
    (1, 1),
    (0.5, 0.5),
    (nan, nan),
    ("a", "a"),
    (None, None),
    ((1, (2.0, nan)), (1, (2.0, nan))),
    ([1, [2]], [1, [2]]),
    ({"a": 1, "b": [nan]}, {"a": 1, "b": [nan]}),
    ({1, 2}, {2, 1}),
    ({float("nan"), 1.0}, {1.0, float("nan")}),  # a NaN made by each member
    ({frozenset({float("nan")})}, {frozenset({float("nan")})}),  # nested too
    (Color.RED, Color.RED),
    (torch.float32, torch.float32),
    (torch.tensor([1.0, nan]), torch.tensor([1.0, nan])),
    (np.array([1.0, nan]), np.array([1.0, nan])),
    (_make_closure(2.0), _make_closure(2.0)),
    (functools.partial(_scaled, factor=3.0), functools.partial(_scaled, factor=3.0)),
    (Plain([1, 2]), Plain([1, 2])),
    (Slotted(1.5), Slotted(1.5)),
    (torch.relu, torch.relu),
]
DIFFERENT = [
    (1, 2),
    (1, 1.0),  # the type is part of the value
    (True, 1),
    (0.0, -0.0),
    ({float("nan")}, {float("nan"), float("nan")}),
    ({float("nan"), 1.0}, {float("nan"), 2.0}),
    ({0.0}, {-0.0}),
    ({1}, {True}),
    ({frozenset({0.0})}, {frozenset({-0.0})}),
    (nan, 1.0),
    ((1, 2), [1, 2]),
    ((1, 2), (1, 2, 3)),
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}),  # key order: iteration order may matter
    (Color.RED, Color.BLUE),
    (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0])),
    (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64)),
    (torch.tensor([1.0]), torch.tensor([[1.0]])),
    (np.array([1.0, 2.0]), np.array([1.0, 3.0])),
    (np.array([1, 2]), np.array([1.0, 2.0])),
    (_make_closure(2.0), _make_closure(3.0)),
    (_scaled, _make_closure(2.0)),
    (functools.partial(_scaled, factor=3.0), functools.partial(_scaled, factor=4.0)),
    (Plain([1, 2]), Plain([1, 3])),
    (Slotted(1.5), Slotted(2.5)),
    (torch.Generator(), torch.Generator()),  # opaque: only equal to itself
    (torch.relu, torch.tanh),
]


@pytest.mark.parametrize(("a", "b"), SAME)
def test_same_values(a: object, b: object) -> None:
    assert _same(a, b)


@pytest.mark.parametrize(("a", "b"), DIFFERENT)
def test_different_values(a: object, b: object) -> None:
    assert not _same(a, b)


def test_references_to_a_members_own_submodules_and_tensors_correspond() -> None:
    ref, other = nn.Linear(2, 2), nn.Linear(2, 2)
    same = SameValue({id(other): ref, id(other.weight): ref.weight}, {id(ref), id(ref.weight)})
    assert same(ref.forward, other.forward)  # bound methods of counterpart modules
    assert same(weakref.ref(ref), weakref.ref(other))
    assert same([ref.weight], [other.weight])
    assert not same(ref.weight, other.bias)  # other.bias is not ref.weight's counterpart
    assert not same(ref, nn.Linear(2, 2))


def test_cycles_terminate() -> None:
    a, b = Plain(None), Plain(None)
    a.value, b.value = a, b
    assert _same(a, b)
    a.other, b.other = 1, 2
    assert not _same(a, b)


def test_same_tensor_on_meta_and_sparse() -> None:
    assert same_tensor(torch.empty(2, device="meta"), torch.empty(2, device="meta"))
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    assert same_tensor(dense.to_sparse(), dense.clone().to_sparse())
    assert not same_tensor(dense.to_sparse(), (dense * 2).to_sparse())
