"""The error dialect's builders (funcensemble/_messages.py)."""

import re
from pathlib import Path

import pytest
import torch
from helpers import runtime_typecheck_off

import funcensemble as fe
from funcensemble import _messages as m


def test_names_sorts_labels_and_counts_the_rest():
    assert m.names(["b", "a", 3]) == "`3`, `a`, `b`"
    assert m.names(["d", "c", "b", "a"], limit=2) == "`a`, `b` and 2 more"
    assert m.names(["x"], label=m.pytree_leaf) == "leaf `x`"


def test_key_difference_names_both_sides_or_nothing():
    assert m.key_difference(["w"], []) == "is missing `w`"
    assert m.key_difference([], ["w"], label=m.ensemble_leaf) == "has extra leaf `w`"
    assert m.key_difference(["['buffers']['bn.running_mean']"], [], label=m.ensemble_leaf) == (
        "is missing buffer `bn.running_mean`"
    )
    assert m.key_difference((), ()) == ""


def test_labels():
    assert m.submodule("") == "the root module"
    assert m.submodule("net.0") == "submodule `net.0`"
    assert m.tensor_spec("torch.int64", (3, 2)) == "an int64 tensor of shape (3, 2)"
    assert m.tensor_spec("float32", ()) == "a float32 tensor of shape ()"


@pytest.mark.parametrize(
    ("value", "or_none", "error", "match"),
    [
        (0, False, ValueError, r"^f: n must be a positive int \(expected an int >= 1, got 0\)\. "),
        (True, False, TypeError, r"\(expected an int >= 1, got bool\)\. Pass n as an int >= 1\.$"),
        (2.0, True, TypeError, r"must be a positive int or None \(expected an int >= 1 or None"),
    ],
)
def test_positive_int_refuses_in_the_dialect(value, or_none, error, match):
    with pytest.raises(error, match=match):
        m.positive_int("f", "n", value, or_none=or_none)
    assert m.positive_int("f", "n", 3) == 3


def test_no_message_in_the_old_capitalised_style():
    """``where: Expected X, got Y.`` was the old style; the dialect says what is wrong
    first, in lower case, with ``(expected X, got Y)`` after it."""
    root = Path(fe.__file__).parent
    old = re.compile(r"""f?["'](?:\{\w+\}|[\w.]+): Expected\b""")
    found = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if old.search(line)
    ]
    assert found == []
    assert old.search('f"{where}: Expected a callable, got int."')
    assert old.search('"concat: Expected at least one pytree, got 0."')


def test_no_message_with_a_trailing_expected_clause():
    """``X is a str, expected an nn.Module.`` (or ``; expected ...``) was the other old
    style; the dialect puts what was expected in parentheses: ``(expected X, got Y)``."""
    root = Path(fe.__file__).parent
    old = re.compile(r"""[}\w'"][;,] expected (?:a|an|the)\b""")
    found = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if old.search(line)
    ]
    assert found == []
    assert old.search('f"{where}: member {index} is a {name}, expected an nn.Module."')
    assert old.search('f"{where}: state is a {name}; expected an fe.Ensemble"')
    assert not old.search('"(expected a tensor or None, got float)"')


def test_boolean_refuses_in_the_dialect():
    with pytest.raises(
        TypeError, match=r"^f: b must be a bool \(expected True or False, got int\)\. Pass b=True"
    ):
        m.boolean("f", "b", 1)
    assert m.boolean("f", "b", False) is False


def test_a_non_tensor_output_is_refused_in_our_words_naming_what_to_do():
    torch.manual_seed(0)
    mha = [torch.nn.MultiheadAttention(4, 2, batch_first=True) for _ in range(2)]
    x = torch.randn(3, 5, 4)
    with pytest.raises(ValueError, match=r"returned a NoneType among its outputs .* \[0\] of it"):
        fe.Ensemble(mha)(x, x, x, need_weights=False)
    fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 1) for _ in range(2)])
    with pytest.raises(ValueError, match=r"vmap: the function returned a float among its outputs"):
        fe.vmap(lambda p, b, x: (fmodel(p, b, x), 1.5))(params, buffers, torch.ones(4, 3))
    with pytest.raises(ValueError, match=r"returned a NoneType .* return the loss, and any aux"):
        fe.value_and_grad(lambda p, b, x: (fmodel(p, b, x).sum(), None), has_aux=True)(
            params, buffers, torch.ones(4, 3)
        )


def test_a_loss_using_no_parameter_is_refused_naming_likely_causes():
    fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 1) for _ in range(2)])
    for loss_fn, message in (
        (lambda p, b, x: fmodel(p, b, x).detach().sum(), "the loss depends on no trainable"),
        (lambda p, b, x: fmodel(p, b, x).argmax(), "loss_fn returned a int64 loss .* no gradient"),
    ):
        with pytest.raises(ValueError, match=rf"value_and_grad: {message}"):
            fe.value_and_grad(loss_fn)(params, buffers, torch.ones(4, 3))


def test_unstack_of_an_ensemble_or_without_the_state_says_what_to_call():
    ens = fe.Ensemble([torch.nn.Linear(3, 1) for _ in range(2)])
    with runtime_typecheck_off(), pytest.raises(TypeError, match=r"got Ensemble\).* ens.unstack"):
        fe.unstack(ens)
    fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 1) for _ in range(2)])
    with pytest.raises(TypeError, match=r"params and buffers are missing .* fe.unstack\(fmodel"):
        fe.unstack(fmodel)
    assert len(fe.unstack(fmodel, params, buffers)) == 2
