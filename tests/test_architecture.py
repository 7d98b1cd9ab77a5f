"""Every bad input to the core: a clear error, of the right type, raised before any mutation.

In the test run jaxtyping+beartype check every public funcensemble function, so a
wrong-typed argument is rejected by beartype before funcensemble's own check runs.
Tests of wrong *types* therefore check both: a ``TypeError`` in the test run, and
funcensemble's own message with the runtime checker off (what users see).
"""

import cmath
import collections
import copy
import dataclasses
import functools
import io
import math
import random
import re
import subprocess
import sys
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jaxtyping
import numpy as np
import pytest
import torch
from helpers import (
    ZOO,
    assert_trees_equal,
    runtime_typecheck_off,
    skip_unless_dynamo_traces_optree,
)
from torch import Tensor, nn
from torch.nn.utils import parametrizations as P
from torch.nn.utils import prune

import funcensemble as fe


def snapshot(*modules: nn.Module) -> list[dict[str, Tensor]]:
    """Deep copies of the modules' state and flags, to prove nothing was mutated."""
    return [
        {
            **{k: v.clone() for k, v in m.state_dict(keep_vars=True).items()},
            **{f"{k}:training": torch.tensor(s.training) for k, s in m.named_modules()},
            **{
                f"{k}:requires_grad": torch.tensor(p.requires_grad) for k, p in m.named_parameters()
            },
        }
        for m in modules
    ]


def lin(d_in: int = 3, d_out: int = 2, **kwargs) -> nn.Linear:
    return nn.Linear(d_in, d_out, **kwargs)


# --- stack / Ensemble: members ---------------------------------------------------------


@pytest.mark.parametrize("build", [fe.stack, fe.Ensemble])
def test_no_members(build) -> None:
    with pytest.raises(
        ValueError, match=r": modules is empty \(expected at least one module, got 0\)\. Pass"
    ):
        build([])


@pytest.mark.parametrize("build", [fe.stack, fe.Ensemble])
def test_single_module_instead_of_a_sequence(build) -> None:
    with pytest.raises(TypeError):
        build(nn.Sequential(lin(), lin(2, 2)))
    with (
        runtime_typecheck_off(),
        pytest.raises(
            TypeError,
            match=r"modules is a single module \(expected a sequence .* got a single Sequential\)",
        ),
    ):
        build(nn.Sequential(lin(), lin(2, 2)))


@pytest.mark.parametrize("build", [fe.stack, fe.Ensemble, fe.HeteroEnsemble])
def test_an_ensemble_instead_of_modules_points_to_its_parts(build) -> None:
    # Found by a new-user audit: "Wrap it in a list", then fe.stack([ens]) refused too.
    ens = fe.Ensemble([lin() for _ in range(3)])
    hens = fe.HeteroEnsemble([lin(), lin(3, 4)])
    with runtime_typecheck_off():
        with pytest.raises(
            TypeError,
            match=r"modules is an fe\.Ensemble, already stacked .* ens\.fmodel, "
            r"ens\.stacked_params\(\) and ens\.stacked_buffers\(\); ens\.unstack\(\)",
        ):
            build(ens)
        with pytest.raises(
            TypeError,
            match=r"modules is an fe\.HeteroEnsemble, already stacked .*\)\. ens\.unstack",
        ):
            build(hens)


@pytest.mark.parametrize("build", [fe.stack, fe.Ensemble])
def test_non_module_member(build) -> None:
    with pytest.raises(
        TypeError,
        match=r"member 1 is a str, not a module \(expected an nn\.Module, got str\)|'modules'",
    ):
        build([lin(), "not a module"])
    with (
        runtime_typecheck_off(),
        pytest.raises(
            TypeError,
            match=r"member 1 is a str, not a module \(expected an nn\.Module, got str\)\. Pass",
        ),
    ):
        build([lin(), "not a module"])


class MyLinear(nn.Linear):
    pass


def test_members_of_different_classes() -> None:
    members = [lin(), MyLinear(3, 2)]
    with pytest.raises(
        TypeError,
        match=r"member 1 is a MyLinear; member 0 is a Linear \(expected a Linear as member 0, "
        r"got a MyLinear\)\.",
    ):
        fe.stack(members)


def test_different_train_eval_modes_name_the_submodule() -> None:
    members = [nn.Sequential(lin(), nn.Dropout()) for _ in range(3)]
    members[2][1].eval()
    before = snapshot(*members)
    with pytest.raises(
        ValueError,
        match=r"member 2 has submodule `1` in eval mode; member 0 has it in train mode "
        r"\(expected train mode as member 0, got eval\)\. "
        r"Call \.train\(\) or \.eval\(\)",
    ):
        fe.Ensemble(members)
    assert_trees_equal(snapshot(*members), before)
    with pytest.raises(ValueError, match=r"member 1 has the root module in eval mode"):
        fe.stack([lin(), lin().eval()])


class WithExtra(nn.Module):
    def __init__(self, extra_param: bool = False, extra_buffer: bool = False) -> None:
        super().__init__()
        self.fc = lin()
        if extra_param:
            self.gain = nn.Parameter(torch.ones(()))
        if extra_buffer:
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_missing_or_extra_parameters_and_buffers_are_listed() -> None:
    with pytest.raises(ValueError, match=r"member 1 is missing parameters `bias` compared with"):
        fe.stack([lin(), lin(bias=False)])
    with pytest.raises(ValueError, match=r"member 2 has extra parameters `gain` compared with"):
        fe.stack([WithExtra(), WithExtra(), WithExtra(extra_param=True)])
    with pytest.raises(ValueError, match=r"member 1 has extra buffers `steps`"):
        fe.stack([WithExtra(), WithExtra(extra_buffer=True)])
    with pytest.raises(
        ValueError,
        match=r"member 1 is missing buffers `num_batches_tracked`, `running_mean`, "
        r"`running_var` compared with member 0",
    ):
        fe.stack([nn.BatchNorm1d(4), nn.BatchNorm1d(4, track_running_stats=False)])
    with pytest.raises(
        ValueError, match=r"is missing parameters `fc.bias` and has extra parameters `gain`"
    ):
        other = WithExtra(extra_param=True)
        other.fc = lin(bias=False)
        fe.stack([WithExtra(), other])


def test_shape_dtype_device_mismatch_name_parameter_member_and_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"member 2 has parameter `0.weight` with shape \(2, 4\); member 0 has \(2, 3\) "
        r"\(expected \(2, 3\) as member 0, got \(2, 4\)\)\.",
    ):
        fe.stack([nn.Sequential(lin()), nn.Sequential(lin()), nn.Sequential(lin(4, 2))])
    with pytest.raises(
        ValueError,
        match=r"member 1 has parameter `weight` with dtype torch.float64; member 0 has "
        r"torch.float32 \(expected torch.float32 as member 0, got torch.float64\)\..*module\.to",
    ):
        fe.stack([lin(), lin().double()])
    with pytest.raises(
        ValueError,
        match=r"member 1 has parameter `weight` with device meta; member 0 has cpu "
        r"\(expected cpu as member 0, got meta\)\.",
    ):
        fe.stack([lin(), lin().to("meta")])
    with pytest.raises(
        ValueError,
        match=r"member 1 has buffer `running_mean` with dtype torch.float64; member 0 has",
    ):
        bn = nn.BatchNorm1d(3)
        bn.running_mean = bn.running_mean.double()
        fe.stack([nn.BatchNorm1d(3), bn])


def test_mixed_requires_grad() -> None:
    frozen = lin()
    frozen.bias.requires_grad_(False)
    with pytest.raises(
        ValueError,
        match=r"member 1 has parameter `bias` with requires_grad=False; member 0 has "
        r"requires_grad=True \(expected requires_grad=True as member 0, got False\)\. Freeze "
        r"or unfreeze",
    ):
        fe.Ensemble([lin(), frozen, lin()])
    assert not frozen.bias.requires_grad


class Recurrent(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.encoder = nn.Sequential(lin(3, 3), layer)


@pytest.mark.parametrize(
    ("layer", "label"),
    [
        (nn.LSTM(3, 4, batch_first=True), "LSTM"),
        (nn.GRUCell(3, 4), "GRUCell"),
        (nn.RNN(3, 4), "RNN"),
    ],
)
def test_fused_rnn_layers_refused_at_stack_time(layer: nn.Module, label: str) -> None:
    pattern = (
        rf"member 0 contains {label} at submodule `encoder.1`\. "
        r"torch.func.vmap has no batching rule"
    )
    with pytest.raises(TypeError, match=pattern):
        fe.stack([Recurrent(layer), Recurrent(copy.deepcopy(layer))])
    with pytest.raises(TypeError, match=pattern):
        fe.Ensemble([Recurrent(layer)])
    with pytest.raises(TypeError, match=rf"member 0 contains {label} at the root module"):
        fe.stack([layer])
    with pytest.raises(TypeError, match=rf"from_factory: member 0 contains {label}"):
        fe.Ensemble.from_factory(lambda: Recurrent(copy.deepcopy(layer)), 2)


# --- vmap: inputs and options ----------------------------------------------------------


@pytest.fixture
def bn_train() -> tuple:
    """A train-mode BatchNorm ensemble of 3 (its buffers change on every successful call)."""
    modules = ZOO["int_buffers"].members(3, train=True)
    fmodel, params, buffers = fe.stack(modules)
    return fmodel, params, buffers


def _unchanged_after(call, *trees) -> None:
    before = copy.deepcopy(trees)
    call()
    assert_trees_equal(trees, before)


@pytest.mark.parametrize("n_given", [2, 4])
def test_per_member_input_with_wrong_leading_size(bn_train: tuple, n_given: int) -> None:
    fmodel, params, buffers = bn_train
    x = torch.randn(n_given, 6, 5, dtype=torch.float64)
    pattern = rf"argument 0 has size {n_given} along its member dim 0, but the ensemble has 3"

    def call() -> None:
        with pytest.raises(ValueError, match=pattern):
            fe.vmap(fmodel, in_dims=0)(params, buffers, x)

    _unchanged_after(call, params, buffers)
    ens = fe.Ensemble(ZOO["int_buffers"].members(3, train=True))
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match=pattern):
        ens(x, in_dims=0)
    assert_trees_equal(ens.state_dict(), before)
    # Along another member dim, and inside a pytree argument.
    with pytest.raises(ValueError, match=r"argument 1 has size 2 along its member dim 1, but"):
        fe.vmap(lambda p, b, a, y: a, in_dims=(None, 1))(params, buffers, x, torch.ones(5, 2))
    with pytest.raises(ValueError, match=r"leaf `\['x'\]` of argument 0 has size 4 along"):
        fe.vmap(lambda p, b, d: d["x"], in_dims=({"x": 0},))(params, buffers, {"x": torch.ones(4)})
    # The leaf at fault is named, not only its argument (found by an audit).
    both = {"x": torch.ones(3, 2), "off": torch.ones(4, 2)}
    with pytest.raises(ValueError, match=r"leaf `\['off'\]` of argument 0 has size 4 along"):
        fe.vmap(lambda p, b, d: d["x"], in_dims=({"x": 0, "off": 0},))(params, buffers, both)
    with pytest.raises(ValueError, match=r"leaf `\['x'\]` of argument 0 has 0 dimension"):
        fe.vmap(lambda p, b, d: d["x"], in_dims=({"x": 0},))(params, buffers, {"x": torch.ones(())})


def test_bad_in_dims(bn_train: tuple) -> None:
    fmodel, params, buffers = bn_train
    x = torch.randn(3, 6, 5, dtype=torch.float64)

    def call(in_dims, *args) -> None:
        _unchanged_after(lambda: fe.vmap(fmodel, in_dims)(params, buffers, *args), params, buffers)

    with pytest.raises(
        ValueError, match=r"in_dims has 2 entries but the call passed 1 positional argument"
    ):
        call((0, None), x)
    with pytest.raises(ValueError, match=r"in_dims entry 0 \(\{'a': 0\}\) does not match"):
        call(({"a": 0},), x)
    with pytest.raises(TypeError, match=r"argument 0 is mapped \(in_dims 0\) but holds a float"):
        fe.vmap(lambda p, b, s: s, in_dims=(0,))(params, buffers, 1.5)
    # A None inside a mapped dict is named by its key, with what to pass instead.
    with pytest.raises(
        TypeError,
        match=r"leaf `\['mask'\]` of argument 0 is mapped \(in_dims 0\) but holds a NoneType;"
        r".* Give that leaf None in an in_dims entry shaped like the argument",
    ):
        call((0,), {"x": x, "mask": None})
    with pytest.raises(ValueError, match=r"argument 0 has 3 dimension\(s\); it cannot be split"):
        call((3,), x)
    # Wrong types: beartype in the test run, funcensemble's own TypeError for users.
    with pytest.raises(TypeError, match=r"in_dims"):
        fe.vmap(fmodel, in_dims=[0])
    with runtime_typecheck_off():
        with pytest.raises(
            TypeError, match=r"in_dims must be None, an int or a tuple \(expected .*, got list\)"
        ):
            fe.vmap(fmodel, in_dims=[0])
        with pytest.raises(
            TypeError, match=r"in_dims must be None, an int or a tuple \(expected .*, got bool\)"
        ):
            fe.vmap(fmodel, in_dims=True)
    with pytest.raises(
        TypeError, match=r"in_dims must be None, an int or a tuple \(expected .*, got bool\)"
    ):
        fe.vmap(fmodel, in_dims=True)


@pytest.mark.parametrize("build", ["vmap", "Ensemble"])
def test_bad_chunk_size(build: str) -> None:
    def make(chunk_size) -> None:
        if build == "vmap":
            fe.vmap(lambda p, b: p, chunk_size=chunk_size)
        else:
            fe.Ensemble([lin()], chunk_size=chunk_size)

    for bad in (0, -2):
        with pytest.raises(
            ValueError,
            match=rf"chunk_size must be a positive int or None \(expected an int >= 1 or None, "
            rf"got {bad}",
        ):
            make(bad)
    with pytest.raises(
        TypeError,
        match=r"chunk_size must be a positive int or None \(expected an int >= 1 or None, got bool",
    ):
        make(True)
    with pytest.raises(TypeError, match=r"chunk_size"):
        make("2")
    with (
        runtime_typecheck_off(),
        pytest.raises(
            TypeError,
            match=r"chunk_size must be a positive int or None \(expected an int >= 1 or None, "
            r"got str",
        ),
    ):
        make("2")


@pytest.mark.parametrize("build", ["vmap", "Ensemble"])
def test_bad_randomness(build: str) -> None:
    def make(randomness) -> None:
        if build == "vmap":
            fe.vmap(lambda p, b: p, randomness=randomness)
        else:
            fe.Ensemble([lin()], randomness=randomness)

    with pytest.raises(TypeError, match=r"randomness"):
        make("sometimes")
    with (
        runtime_typecheck_off(),
        pytest.raises(
            ValueError,
            match=r"randomness must be 'different', 'same' or 'error' \(.*, got 'sometimes'\)",
        ),
    ):
        make("sometimes")


def test_vmap_non_callable_and_bad_state() -> None:
    with pytest.raises(TypeError, match=r"fn|fn is not callable"):
        fe.vmap(3)
    with (
        runtime_typecheck_off(),
        pytest.raises(TypeError, match=r"fn is not callable \(expected a callable, got int\)"),
    ):
        fe.vmap(3)
    with pytest.raises(
        ValueError, match=r"the module has no state to map over \(expected .* got none\)"
    ):
        fe.vmap(lambda p, b, x: x)({}, {}, torch.ones(2))
    with pytest.raises(ValueError, match=r"`c` has leading size 2, but `a` has 3"):
        fe.vmap(lambda p, b: p)(
            {"a": torch.ones(3, 1), "b": torch.ones(3), "c": torch.ones(2, 1)}, {}
        )
    # Most tensors share N: the odd one is named, wherever it comes (the first tensor
    # was taken as N, so a forgotten member axis on a weight blamed its bias).
    with pytest.raises(ValueError, match=r"`a` has leading size 2, but `b` has 3"):
        fe.vmap(lambda p, b: p)(
            {"a": torch.ones(2, 1), "b": torch.ones(3), "c": torch.ones(3, 1)}, {}
        )
    # Two tensors, two sizes: neither is blamed.
    with pytest.raises(
        ValueError,
        match=r"vmap: the stacked tensors' leading sizes disagree \(`a`: 3; `b`: 2\), and no "
        r"size is shared by most of them",
    ):
        fe.vmap(lambda p, b: p)({"a": torch.ones(3, 1), "b": torch.ones(2, 1)}, {})
    with pytest.raises(ValueError, match=r"`b` has leading size None, but `a` has 3"):
        fe.vmap(lambda p, b: p)({"a": torch.ones(3)}, {"b": torch.tensor(1.0)})


class FlashAttention(nn.Module):
    """Calls an aten kernel that has no vmap batching rule (only vmap's slow fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = lin(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        q = self.proj(x).unsqueeze(1)  # [batch, heads=1, seq, dim]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)[0]


@pytest.mark.parametrize("nested", [False, True])
def test_op_without_batching_rule_raises_instead_of_looping(nested: bool) -> None:
    modules = [FlashAttention() for _ in range(3)]
    x = torch.randn(2, 5, 4)
    modules[0](x)  # runs fine outside vmap
    fmodel, params, buffers = fe.stack(modules)
    functorch = torch._C._functorch
    fallback_before = functorch._is_vmap_fallback_enabled()
    where = "vmap" if nested else "Ensemble"  # the entry point called
    pattern = (
        rf"{where}: the operator aten::_scaled_dot_product_flash_attention_for_cpu has no "
        r"vmap batching rule, so the members cannot run as one vectorized call"
    )
    with pytest.raises(RuntimeError, match=pattern) as info:
        if nested:
            torch.func.grad(lambda p: fe.vmap(fmodel)(p, buffers, x).sum())(params)
        else:
            fe.Ensemble(modules)(x)
    assert "could not generate a fallback" not in "".join(traceback.format_exception(info.value))
    # The global switches are restored after the error.
    assert functorch._is_vmap_fallback_enabled() == fallback_before
    assert torch.backends.mha.get_fastpath_enabled()


def test_op_vmap_does_not_support_gets_the_same_clear_error() -> None:
    """nn.RReLU calls aten::rrelu even in eval mode; vmap refuses it with its own wording
    ("we do not yet support aten::rrelu"), which must come out as funcensemble's error
    (found by the property tests, tests/test_properties.py)."""
    modules = [nn.Sequential(lin(3, 4), nn.RReLU()).eval() for _ in range(3)]
    fmodel, params, buffers = fe.stack(modules)
    pattern = r": the operator aten::rrelu has no vmap batching rule.*nn\.LeakyReLU"
    with pytest.raises(RuntimeError, match="vmap" + pattern):
        fe.vmap(fmodel)(params, buffers, torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="Ensemble" + pattern):
        fe.Ensemble(modules)(torch.randn(2, 3))


class RunningMax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = lin(3, 4)
        self.register_buffer("top", torch.full((4,), -1e9))

    def forward(self, x: Tensor) -> Tensor:
        y = self.lin(x)
        torch.maximum(self.top, y.detach().amax(0), out=self.top)
        return y - self.top


def test_an_out_call_in_forward_gets_a_clear_error_and_the_batching_form() -> None:
    # Found by an audit: torch's raw "Batching rule not implemented for
    # aten::maximum.out; the fallback path doesn't work on out= or view ops" came out.
    modules = [RunningMax() for _ in range(3)]
    fmodel, params, buffers = fe.stack(modules)
    pattern = (
        r": the operator aten::maximum\.out \(a call with out=\) has no vmap batching "
        r"rule.*Write buf\.copy_\(torch\.maximum\(buf, value\)\)"
    )
    with pytest.raises(RuntimeError, match="vmap" + pattern):
        fe.vmap(fmodel)(params, buffers, torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="Ensemble" + pattern):
        fe.Ensemble(modules)(torch.randn(2, 3))


# --- Ensemble.member, load_state_dict, from_factory, unstack ---------------------------


@pytest.mark.parametrize("n", [1, 3])
def test_member_index_out_of_range_and_non_int(n: int) -> None:
    ens = fe.Ensemble([lin() for _ in range(n)])
    for bad in (n, -n - 1, 100):
        with pytest.raises(
            IndexError,
            match=rf"index {bad} is out of range for an ensemble of {n} members "
            rf"\(valid: -{n} to {n - 1}\)",
        ):
            ens.member(bad)
    with pytest.raises(
        TypeError, match=r"index must be an int \(expected a member index, got bool\)"
    ):
        ens.member(True)
    for bad in ("0", 1.0):
        with pytest.raises(TypeError, match=r"index"):
            ens.member(bad)
        with (
            runtime_typecheck_off(),
            pytest.raises(
                TypeError,
                match=rf"index must be an int \(expected a member index, got {type(bad).__name__}",
            ),
        ):
            ens.member(bad)


def _ens(n: int = 3, d_in: int = 3, **kwargs) -> fe.Ensemble:
    torch.manual_seed(0)
    return fe.Ensemble([nn.Sequential(lin(d_in, 2, **kwargs), nn.BatchNorm1d(2)) for _ in range(n)])


def _assert_load_fails(ens: fe.Ensemble, state: dict, pattern: str, **kwargs) -> None:
    before = copy.deepcopy(ens.state_dict())
    with pytest.raises(ValueError, match=pattern):
        ens.load_state_dict(state, **kwargs)
    assert_trees_equal(ens.state_dict(), before)


def test_load_state_dict_from_another_architecture() -> None:
    ens = _ens()
    other = _ens(bias=False)
    # Keys are checked before any value is copied, so a partly valid dict changes nothing.
    _assert_load_fails(
        ens,
        other.state_dict(),
        r"architecture: it is missing `stacked\.0\.bias`\.$",
    )
    extra = {**ens.state_dict(), "stacked.2.weight": torch.ones(3)}
    _assert_load_fails(ens, extra, r"architecture: it has extra `stacked\.2\.weight`\.$")
    one_member = nn.Sequential(lin(), nn.BatchNorm1d(2)).state_dict()
    _assert_load_fails(ens, one_member, r"it is missing `stacked\.0\.bias`.* and has extra `0")
    # Shapes are checked for every entry before the first one is copied.
    wider = {k: v + 1 for k, v in _ens(d_in=4).state_dict().items()}
    _assert_load_fails(
        ens,
        wider,
        r"`stacked.0.weight` has shape \(3, 2, 4\) in the state_dict; this ensemble has "
        r"\(3, 2, 3\) \(expected \(3, 2, 3\), got \(3, 2, 4\)\)\. It comes from a different "
        r"architecture\.",
    )
    _assert_load_fails(ens, wider, r"`stacked.0.weight` has shape", strict=False)
    as_int = {**ens.state_dict()}
    as_int["stacked.1.running_var"] = torch.ones(3, 2, dtype=torch.int64)
    _assert_load_fails(ens, as_int, r"`stacked.1.running_var` has dtype torch.int64")


@pytest.mark.parametrize("n_other", [1, 4])
def test_load_state_dict_with_another_member_count(n_other: int) -> None:
    ens = _ens(3)
    state = {k: v + 1 for k, v in _ens(n_other).state_dict().items()}
    _assert_load_fails(
        ens,
        state,
        rf"has {n_other} members in the state_dict; this ensemble has 3 \(expected 3 members, "
        rf"got {n_other}\)\. Build an Ensemble with the same num_members",
    )
    state["stacked.1.num_batches_tracked"] = torch.tensor(5)  # a 0-dim entry
    _assert_load_fails(ens, state, r"has \d members in the state_dict|shape with no member axis")


def test_from_factory_bad_inputs_restore_global_rng() -> None:
    state = torch.get_rng_state()
    with pytest.raises(TypeError, match=r"factory"):
        fe.Ensemble.from_factory(3, 2)
    with (
        runtime_typecheck_off(),
        pytest.raises(
            TypeError,
            match=r"factory must be callable \(expected a function building one member, got int\)",
        ),
    ):
        fe.Ensemble.from_factory(3, 2)
    for bad in (0, -1):
        with pytest.raises(
            ValueError,
            match=rf"num_members must be a positive int \(expected an int >= 1, got {bad}",
        ):
            fe.Ensemble.from_factory(lin, bad)
    with pytest.raises(
        TypeError, match=r"num_members must be a positive int \(expected an int >= 1, got bool"
    ):
        fe.Ensemble.from_factory(lin, True)
    with pytest.raises(
        TypeError, match=r"from_factory: member 0 is an int, not a module \(expected an nn\.Module"
    ):
        fe.Ensemble.from_factory(lambda: 3, 2)
    sizes = iter([3, 3, 4])
    with pytest.raises(
        ValueError,
        match=r"from_factory: member 2 has parameter `weight` with shape \(2, 4\); member 0 "
        r"has \(2, 3\)",
    ):
        fe.Ensemble.from_factory(lambda: lin(next(sizes)), 3)
    assert torch.equal(torch.get_rng_state(), state)


def test_unstack_bad_inputs() -> None:
    fmodel, params, buffers = fe.stack([lin(), lin()])
    with pytest.raises(TypeError, match=r"FunctionalModule"):
        fe.unstack(lin(), params, buffers)
    with (
        runtime_typecheck_off(),
        pytest.raises(
            TypeError,
            match=r"fmodel is not a FunctionalModule \(expected the one .*, got Linear\)",
        ),
    ):
        fe.unstack(lin(), params, buffers)
    with pytest.raises(
        ValueError,
        match=r"unstack: the parameters do not match the architecture: the dict is missing "
        r"`bias`\. Pass the parameters that fe.stack returned",
    ):
        fe.unstack(fmodel, {"weight": params["weight"]}, buffers)
    with pytest.raises(ValueError, match=r"leading sizes disagree \(`weight`: 2; `bias`: 3\)"):
        fe.unstack(fmodel, {"weight": params["weight"], "bias": torch.ones(3, 2)}, buffers)


# --- the test run's runtime type checking is really on ---------------------------------


def test_jaxtyping_beartype_runtime_checking_is_active() -> None:
    # A wrong type is caught by beartype before funcensemble's own (ValueError) check.
    with pytest.raises(jaxtyping.TypeCheckError, match=r"parameter 'randomness'"):
        fe.vmap(lambda p, b: p, randomness="sometimes")
    # jaxtyping shape annotations are checked too: stacked tensors need a member axis.
    fmodel, _, _ = fe.stack([lin(3, 2, bias=False)])
    with pytest.raises(jaxtyping.TypeCheckError, match=r"parameter 'params'"):
        fe.unstack(fmodel, {"weight": torch.tensor(1.0)}, {})
    assert hasattr(fe.stack, "__wrapped__")  # the import hook decorated the package


# --- everything forward reads besides tensors: attributes, hooks, parametrizations ------
# The ensemble runs every member through one copy of member 0, so members that differ in
# non-tensor state would silently all compute member 0's function (issue 11, item 1.1).


def test_leaky_relu_slopes_differ_is_refused_not_member_0s_slope_for_all() -> None:
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(0.01 if i == 0 else 0.5)) for i in range(3)
    ]
    before = snapshot(*members)
    pattern = (
        r"Ensemble: member 1 has submodule `1` \(LeakyReLU\) with `negative_slope` = 0\.5; "
        r"member 0 has `negative_slope` = 0\.01\. .*give `negative_slope` one value in every "
        r"member, or build one ensemble per value\."
    )
    with pytest.raises(ValueError, match=pattern):
        fe.Ensemble(members)
    with pytest.raises(ValueError, match=pattern.replace("Ensemble", "stack")):
        fe.stack(members)
    slopes = iter([0.01, 0.01, 0.5])
    with pytest.raises(ValueError, match=r"from_factory: member 2 has submodule `1` \(LeakyReLU\)"):
        fe.Ensemble.from_factory(
            lambda: nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(next(slopes))), 3
        )
    assert_trees_equal(snapshot(*members), before)
    # With one slope the ensemble is the loop.
    for m in members:
        m[1].negative_slope = 0.5
    x = torch.randn(5, 4)
    torch.testing.assert_close(fe.Ensemble(members)(x), torch.stack([m(x) for m in members]))


def _bn_flag_flipped(value: bool) -> nn.Module:
    bn = nn.BatchNorm1d(3)
    bn.track_running_stats = value  # buffers kept: only the flag differs
    return bn


# (build one member from a value, member 0's value, member 1's value, path, class, attribute)
ATTRIBUTE_CASES = {
    "leaky_relu": (lambda v: nn.LeakyReLU(v), 0.01, 0.2, "", "LeakyReLU", "negative_slope"),
    "bn_momentum": (
        lambda v: nn.BatchNorm1d(3, momentum=v),
        0.1,
        0.3,
        "",
        "BatchNorm1d",
        "momentum",
    ),
    "bn_eps": (lambda v: nn.BatchNorm2d(3, eps=v), 1e-5, 1e-3, "", "BatchNorm2d", "eps"),
    "bn_track_running_stats": (
        _bn_flag_flipped,
        True,
        False,
        "",
        "BatchNorm1d",
        "track_running_stats",
    ),
    "gelu": (lambda v: nn.GELU(approximate=v), "none", "tanh", "", "GELU", "approximate"),
    "dropout": (lambda v: nn.Sequential(nn.Dropout(v)), 0.1, 0.5, "0", "Dropout", "p"),
    "softmax": (lambda v: nn.Softmax(dim=v), 1, -1, "", "Softmax", "dim"),
    "conv_padding": (lambda v: nn.Conv2d(2, 2, 3, padding=v), 0, 1, "", "Conv2d", "padding"),
    "conv_stride": (lambda v: nn.Conv2d(2, 2, 3, stride=v), 1, 2, "", "Conv2d", "stride"),
    "conv_dilation": (lambda v: nn.Conv1d(2, 2, 3, dilation=v), 1, 2, "", "Conv1d", "dilation"),
    "conv_padding_mode": (
        lambda v: nn.Conv2d(2, 2, 3, padding=1, padding_mode=v),
        "zeros",
        "reflect",
        "",
        "Conv2d",
        "padding_mode",
    ),
    "embedding_padding_idx": (
        lambda v: nn.Embedding(5, 3, padding_idx=v),
        0,
        2,
        "",
        "Embedding",
        "padding_idx",
    ),
    "embedding_max_norm": (
        lambda v: nn.Embedding(5, 3, max_norm=v),
        None,
        1.0,
        "",
        "Embedding",
        "max_norm",
    ),
    "layer_norm_eps": (lambda v: nn.LayerNorm(3, eps=v), 1e-5, 1e-6, "", "LayerNorm", "eps"),
    "flatten": (lambda v: nn.Flatten(start_dim=v), 1, 0, "", "Flatten", "start_dim"),
    "mha_batch_first": (
        lambda v: nn.MultiheadAttention(4, 2, batch_first=v),
        False,
        True,
        "",
        "MultiheadAttention",
        "batch_first",
    ),
    "transformer_norm_first": (
        lambda v: nn.TransformerEncoderLayer(4, 2, 8, norm_first=v),
        False,
        True,
        "",
        "TransformerEncoderLayer",
        "norm_first",
    ),
    "nan_vs_number": (
        lambda v: nn.LeakyReLU(v),
        float("nan"),
        0.1,
        "",
        "LeakyReLU",
        "negative_slope",
    ),
    "signed_zero": (lambda v: nn.Hardtanh(v, 1.0), 0.0, -0.0, "", "Hardtanh", "min_val"),
}


@pytest.mark.parametrize("case", sorted(ATTRIBUTE_CASES))
def test_each_layer_attribute_difference_is_refused_naming_member_path_and_values(
    case: str,
) -> None:
    build, v0, v1, path, cls, attr = ATTRIBUTE_CASES[case]
    torch.manual_seed(0)
    members = [build(v0), build(v0), build(v1)]
    before = snapshot(*members)
    label = rf"submodule `{path}`" if path else "the root module"
    shown0, shown1 = (
        re.escape(repr(getattr(m, attr) if not path else getattr(m[0], attr)))
        for m in (members[0], members[2])
    )
    with pytest.raises(
        ValueError,
        match=rf"stack: member 2 has {label} \({cls}\) with `{attr}` = {shown1}; member 0 has "
        rf"`{attr}` = {shown0}\.",
    ):
        fe.stack(members)
    assert_trees_equal(snapshot(*members), before)
    # The same value in every member stacks.
    fe.stack([build(v1), build(v1)])


class Custom(nn.Module):
    """A user-defined module: its own attributes are part of what forward computes."""

    def __init__(self, scale: float = 2.0, mode: str = "sum") -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.scale = scale
        self.config = {"mode": mode, "limits": (0.0, float("nan"))}
        self.offsets = torch.tensor([1.0, float("nan"), 3.0])  # a plain tensor attribute
        self.table = np.array([1.0, 2.0])

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.scale + self.offsets.nan_to_num().sum()


def test_custom_module_attributes() -> None:
    torch.manual_seed(0)
    fe.stack([Custom(), Custom(), Custom()])  # equal values (NaN equals NaN) stack
    with pytest.raises(
        ValueError,
        match=r"member 1 has the root module \(Custom\) with `scale` = 3\.0; member 0 has "
        r"`scale` = 2\.0\.",
    ):
        fe.Ensemble([Custom(), Custom(scale=3.0)])
    with pytest.raises(ValueError, match=r"member 1 .* `config` = \{'mode': 'max'"):
        fe.stack([Custom(), Custom(mode="max")])
    other = Custom()
    other.offsets = torch.tensor([1.0, float("nan"), 4.0])
    with pytest.raises(
        ValueError,
        match=r"member 1 has the root module \(Custom\) with `offsets` = tensor\(\[1\.0, nan, "
        r"4\.0\].*register it with register_buffer",
    ):
        fe.stack([Custom(), other])
    other = Custom()
    other.table = np.array([1.0, 3.0])
    with pytest.raises(ValueError, match=r"member 1 .* `table` = array\(\[1\., 3\.\]\)"):
        fe.stack([Custom(), other])
    other = Custom()
    other.extra = 1
    with pytest.raises(
        ValueError, match=r"member 1 has the root module with attribute `extra`; member 0 has no"
    ):
        fe.stack([Custom(), other])
    with pytest.raises(ValueError, match=r"member 0 has the root module with attribute `extra`"):
        fe.stack([other, Custom()])
    other = Custom()
    other.fc.note = "tuned"  # on a submodule of a library class
    with pytest.raises(ValueError, match=r"member 1 has submodule `fc` with attribute `note`"):
        fe.stack([Custom(), other])


def _hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    return output * 2


def _other_hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    return output * 3


def test_hooks_on_one_member_or_different_hooks_are_refused() -> None:
    def members() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(lin(), nn.Tanh()) for _ in range(3)]

    ms = members()
    ms[2][0].register_forward_hook(_hook)
    with pytest.raises(
        ValueError,
        match=r"member 2 has 1 forward hook\(s\) on submodule `0`; member 0 has 0 \(expected 0 "
        r"as member 0, got 1\)\. Register the same forward hooks on every member",
    ):
        fe.Ensemble(ms)
    ms = members()
    ms[1].register_forward_pre_hook(lambda module, args: args)
    with pytest.raises(ValueError, match=r"member 1 has 1 forward pre-hook\(s\) on the root"):
        fe.stack(ms)
    ms = members()
    ms[0][1].register_full_backward_hook(lambda module, gin, gout: None)
    # Refused on member 0 itself: backward hooks do not run inside vmap
    # (tests/test_backward_hooks.py).
    with pytest.raises(ValueError, match=r"member 0 has a backward hook on submodule `1`"):
        fe.stack(ms)
    ms = members()
    ms[0].register_state_dict_post_hook(lambda *args: None)
    with pytest.raises(ValueError, match=r"member 1 has 0 state-dict hook\(s\)"):
        fe.stack(ms)
    ms = members()
    for m, h in zip(ms, (_hook, _hook, _other_hook), strict=True):
        m.register_forward_hook(h)
    with pytest.raises(
        ValueError,
        match=r"member 2 has forward hook 0 on the root module = function _other_hook .*; "
        r"member 0 has function _hook .*A hook must be the same function",
    ):
        fe.stack(ms)
    # The same code with different captured values is a different hook.
    ms = members()
    for i, m in enumerate(ms):
        factor = 1.0 + (i == 1)
        m.register_forward_hook(lambda module, args, out, factor=factor: out * factor)
    with pytest.raises(ValueError, match=r"member 1 has forward hook 0 .* defaults \(2\.0,\)"):
        fe.stack(ms)
    ms = members()
    for m in ms:
        m.register_forward_hook(_hook, with_kwargs=m is ms[1])
    with pytest.raises(
        ValueError,
        match=r"member 1 has forward hooks on the root module at positions \[0\] registered "
        r"with with_kwargs; member 0 at \[\] \(expected positions \[\] as member 0, got \[0\]\)\.",
    ):
        fe.stack(ms)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = lin(3, 3)
        self.fc.register_forward_hook(self.gate)  # a bound method of the member itself
        self.fc.register_forward_hook(lambda module, args, out: out + 1)  # same code

    def gate(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return output * torch.sigmoid(self.fc.weight.sum())

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


def test_identical_hooks_stack_and_run_per_member() -> None:
    torch.manual_seed(0)
    members = [Gated() for _ in range(3)]
    x = torch.randn(4, 3)
    torch.testing.assert_close(fe.Ensemble(members)(x), torch.stack([m(x) for m in members]))


def test_parametrization_on_one_member_or_different_ones_is_refused() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(lin(4, 4), nn.Tanh())
    wn = nn.Sequential(P.weight_norm(lin(4, 4)), nn.Tanh())
    with pytest.raises(
        ValueError,
        match=r"member 1 has parametrizations \(torch\.nn\.utils\.parametrize\) of `weight` on "
        r"submodule `0`; member 0 has none there\. .*register the same parametrizations",
    ):
        fe.stack([plain, wn])
    with pytest.raises(ValueError, match=r"member 0 has parametrizations .*member 2 has none"):
        fe.Ensemble([wn, copy.deepcopy(wn), plain])
    with pytest.raises(
        TypeError,
        match=r"member 1 has submodule `0.parametrizations.weight.0` of class _SpectralNorm; "
        r"member 0 has _WeightNorm",
    ):
        fe.stack([wn, nn.Sequential(P.spectral_norm(lin(4, 4)), nn.Tanh())])
    with pytest.raises(
        ValueError,
        match=r"member 1 has submodule `parametrizations.weight.0` \(_Orthogonal\) with "
        r"`orthogonal_map` = <_OrthMaps.cayley",
    ):
        fe.stack([P.orthogonal(lin(3, 3)), P.orthogonal(lin(3, 3), orthogonal_map="cayley")])
    # The same parametrization on every member stacks (equivalence: test_rewrites.py).
    fe.stack([wn, nn.Sequential(P.weight_norm(lin(4, 4)), nn.Tanh())])


def test_submodule_tree_differences_are_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(
        TypeError,
        match=r"member 1 has submodule `1` of class Tanh; member 0 has ReLU \(expected ReLU as "
        r"member 0, got Tanh\)\.",
    ):
        fe.stack([nn.Sequential(lin(), nn.ReLU()), nn.Sequential(lin(), nn.Tanh())])
    a, b = nn.Module(), nn.Module()
    a.x, a.y = nn.ReLU(), nn.Tanh()
    b.y, b.x = nn.Tanh(), nn.ReLU()
    with pytest.raises(
        ValueError,
        match=r"member 1 has the root module with child modules \['y', 'x'\]; member 0 has "
        r"\['x', 'y'\] \(expected \['x', 'y'\] as member 0, got \['y', 'x'\]\)\.",
    ):
        fe.stack([a, b])
    shared = lin(2, 2)
    with pytest.raises(
        ValueError,
        match=r"member 1 has submodule `1` as its own instance; member 0 has it as the same "
        r"instance as `0`",
    ):
        fe.stack([nn.Sequential(shared, shared), nn.Sequential(lin(2, 2), lin(2, 2))])


def _legacy_weight_norm(module: nn.Module) -> nn.Module:
    with pytest.warns(FutureWarning):
        return nn.utils.weight_norm(module)


@pytest.mark.parametrize(
    "legacy",
    [
        _legacy_weight_norm,
        nn.utils.spectral_norm,
        lambda m: prune.l1_unstructured(m, "weight", amount=0.5),
    ],
    ids=["weight_norm", "spectral_norm", "prune"],
)
def test_legacy_hook_based_reparametrizations_are_refused_with_what_to_use(legacy) -> None:
    torch.manual_seed(0)
    members = [legacy(lin(3, 3)) for _ in range(2)]
    # weight_norm and prune keep `weight` computed from parameters (requires grad): found
    # on member 0 already, so a one-member ensemble is refused as well.
    first = r"member 0 \(Linear\) holds a tensor that requires grad in `weight`"
    # spectral_norm's `weight` attribute starts as an alias of `weight_orig`'s memory.
    alias = r"member 0 \(Linear\) holds a tensor sharing memory with its parameter `weight_orig`"
    hint = (
        r".*use torch\.nn\.utils\.parametrizations\.weight_norm / spectral_norm instead, or "
        r"call prune\.remove"
    )
    for stacked in (members, members[:1]):
        with pytest.raises(
            ValueError, match=(alias if legacy is nn.utils.spectral_norm else first) + hint
        ):
            fe.stack(stacked)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_identical_members_still_stack(name: str) -> None:
    members = ZOO[name].members(3, train=True)
    fe.stack(members)
    fe.stack([copy.deepcopy(members[0]) for _ in range(3)])


# --- tied tensors: the same ties in every member; no tensor shared between members -----


def _tied(tie_to: int) -> nn.Module:
    """Linear-Tanh-Linear-Tanh-Linear with the last weight tied to layer ``tie_to``'s."""
    m = nn.Sequential(lin(4, 4), nn.Tanh(), lin(4, 4), nn.Tanh(), lin(4, 4))
    m[4].weight = m[tie_to].weight
    return m


class _TiedBuffers(nn.Module):
    def __init__(self, tie: str) -> None:
        super().__init__()
        for name in ("s0", "s1", "s2"):
            self.register_buffer(name, torch.ones(3))
        self.s2 = getattr(self, tie)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s0 + 2 * x * self.s1 + 3 * x * self.s2


@pytest.mark.parametrize("build", [fe.stack, fe.Ensemble])
def test_members_tied_differently_are_refused(build) -> None:
    members = [_tied(0), _tied(2), _tied(2)]
    before = snapshot(*members)
    with pytest.raises(
        ValueError,
        match=r"member 1 has parameter `4\.weight` as the same tensor as `2\.weight` \(tied\); "
        r"member 0 has it as the same tensor as `0\.weight` \(tied\)\. All members must "
        r"share one architecture: tie the same",
    ):
        build(members)
    assert_trees_equal(snapshot(*members), before)
    with pytest.raises(ValueError, match=r"member 1 has buffer `s2` as the same tensor as `s1`"):
        build([_TiedBuffers("s0"), _TiedBuffers("s1")])
    untied = nn.Sequential(lin(4, 4), nn.Tanh(), lin(4, 4), nn.Tanh(), lin(4, 4))
    with pytest.raises(ValueError, match=r"member 1 has extra parameters `4\.weight`"):
        build([_tied(0), untied])


def test_members_tied_differently_form_other_groups_of_a_hetero_ensemble() -> None:
    torch.manual_seed(0)
    members = [_tied(0), _tied(2), _tied(0)]
    hens = fe.HeteroEnsemble(copy.deepcopy(members))
    assert hens.group_members == ((0, 2), (1,))
    x = torch.randn(5, 4)
    torch.testing.assert_close(hens(x), torch.stack([m(x) for m in members]))


@pytest.mark.parametrize("build", [fe.stack, fe.Ensemble, fe.HeteroEnsemble])
def test_a_tensor_shared_between_members_is_refused(build) -> None:
    backbone = lin(4, 4)
    shared = [nn.Sequential(backbone, nn.Tanh(), lin(4, 2)) for _ in range(3)]
    message = r"member 1's parameter `0\.weight` is the same tensor as member 0's parameter"
    with pytest.raises(ValueError, match=message + r" `0\.weight`\. An ensemble holds its own"):
        build(shared)
    one = lin()
    with pytest.raises(ValueError, match=r"member 1's parameter `weight` is the same tensor"):
        build([one, one])
    buffer_owner = nn.BatchNorm1d(3)
    with pytest.raises(
        ValueError, match=r"member 2's parameter `weight` is the same tensor as member 1's"
    ):
        build([nn.BatchNorm1d(3), buffer_owner, buffer_owner])


class _Overlapping(nn.Module):
    """Two parameters viewing one tensor: the loop's updates to one change the other."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(8)
        self.a = nn.Parameter(base[:6])
        self.b = nn.Parameter(base[2:8])

    def forward(self, x: Tensor) -> Tensor:
        return x * self.a.sum() + self.b


class _RowBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("row0", self.linear.weight.data[0])  # a view of the weight

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) + self.row0


@pytest.mark.parametrize("build", [fe.stack, fe.Ensemble, fe.HeteroEnsemble])
def test_tensors_sharing_memory_are_refused(build) -> None:
    """Views of one tensor train as one memory in the loop; an ensemble would copy each
    apart (31.2 off the loop after 3 SGD steps), so they are refused, by name."""
    with pytest.raises(
        ValueError, match=r"member 0's parameter `b` shares memory with its parameter `a`"
    ):
        build([_Overlapping() for _ in range(2)])
    with pytest.raises(
        ValueError,
        match=r"member 0's buffer `row0` shares memory with its parameter `linear\.weight`",
    ):
        build([_RowBuffer() for _ in range(2)])
    base = torch.randn(2, 3)  # members whose weights view one tensor (disjoint rows)
    members = [nn.Linear(3, 1) for _ in range(2)]
    members[0].weight, members[1].weight = nn.Parameter(base[:1]), nn.Parameter(base[1:])
    build(members)  # no memory in common: accepted
    overlap = torch.randn(3, 3)
    members[0].weight, members[1].weight = nn.Parameter(overlap[:1]), nn.Parameter(overlap[:1])
    with pytest.raises(
        ValueError,
        match=r"member 1's parameter `weight` shares memory with member 0's parameter `weight`",
    ):
        build(members)
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight  # one tensor under two names: the tie is kept
    build([copy.deepcopy(tied) for _ in range(2)])


def test_a_factory_returning_one_module_is_refused() -> None:
    one = lin()
    with pytest.raises(ValueError, match=r"member 1's parameter `weight` is the same tensor"):
        fe.Ensemble.from_factory(lambda: one, num_members=3)


@pytest.mark.parametrize(
    ("make", "args", "hint"),
    [
        (lambda: nn.EmbeddingBag(10, 3), (torch.randint(0, 10, (4, 2)),), r"use nn\.Embedding"),
        (
            lambda: nn.Bilinear(3, 3, 2),
            (torch.randn(4, 3), torch.randn(4, 3)),
            r"torch\.einsum\('\.\.\.i,oij,\.\.\.j->\.\.\.o'",
        ),
    ],
)
def test_an_operator_without_a_batching_rule_gets_its_own_hint(make, args, hint) -> None:
    ens = fe.Ensemble([make() for _ in range(2)])
    with pytest.raises(RuntimeError, match=r"has no vmap batching rule.*" + hint):
        ens(*args)


def test_members_holding_generators_are_refused_with_a_reason() -> None:
    class WithGenerator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = lin()
            self.gen = torch.Generator().manual_seed(0)

        def forward(self, x: Tensor) -> Tensor:
            return self.linear(x) + torch.randn(2, generator=self.gen)

    with pytest.raises(ValueError, match=r"`gen` = a torch\.Generator of its own.*Keep generators"):
        fe.Ensemble([WithGenerator() for _ in range(2)])


@pytest.mark.parametrize("build", [fe.stack, fe.Ensemble])
def test_an_uninitialized_lazy_module_is_refused_with_what_to_do(build) -> None:
    with pytest.raises(ValueError, match=r"member 0 has `0\.weight` of .*uninitialized.*Run one"):
        build([nn.Sequential(nn.LazyLinear(2)) for _ in range(2)])
    members = [nn.Sequential(nn.LazyLinear(2)) for _ in range(2)]
    for m in members:
        m(torch.randn(1, 3))
    build(members)  # initialized by a forward pass: stacks


# --- values forward reads that the comparison once let through (each gave a member
# member 0's value, or another member's tensors, without a word) ----------------------


class _Holder(nn.Module):
    """A Linear and one extra attribute ``value`` that forward multiplies by ``read``."""

    def __init__(self, value: object, read) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l = lin(3, 2)
        self.value = value
        self.read = read

    def forward(self, x: Tensor) -> Tensor:
        return self.l(x) * self.read(self)


@dataclasses.dataclass
class _Scaled:
    scale: float = dataclasses.field(compare=False)  # its __eq__ skips it


class _Tagged(list):
    pass


def _tagged(scale: float) -> _Tagged:
    t = _Tagged([0])
    t.scale = scale
    return t


def _partial_with(extra: float):
    f = functools.partial(torch.mul, other=2.0)
    f.extra = extra
    return f


def _function_with(alpha: float):
    def act(x):
        return x * act.alpha

    act.alpha = alpha
    return act


class _Rebuilt:
    """Pickles from its constructor's argument only; `t` is runtime state beside it."""

    def __init__(self, steps: int, t: int = 0) -> None:
        self.steps, self.t = steps, t

    def __reduce__(self):
        return (_Rebuilt, (self.steps,))


def _cached_scale(value: float):
    @functools.lru_cache
    def scale() -> float:
        return value

    return scale


_DIFFERING_VALUES = {
    # name: (member 0's value, member 1's value, how forward reads a factor from it)
    "dict-key-bool-vs-int": (
        {True: 2.0},
        {1: 2.0},
        lambda m: float(type(next(iter(m.value))) is bool),
    ),
    "set-zero-sign": ({0.0}, {-0.0}, lambda m: math.atan2(next(iter(m.value)), -1.0)),
    "tensor-zero-sign": (
        torch.tensor(0.0),
        torch.tensor(-0.0),
        lambda m: math.atan2(m.value, -1.0),
    ),
    "ndarray-zero-sign": (np.zeros(1), -np.zeros(1), lambda m: math.atan2(m.value[0], -1.0)),
    "complex-zero-sign": (complex(-1, 0.0), complex(-1, -0.0), lambda m: cmath.phase(m.value)),
    "defaultdict-factory": (
        collections.defaultdict(functools.partial(float, 1.0)),
        collections.defaultdict(functools.partial(float, 2.0)),
        lambda m: m.value["unseen"],
    ),
    "list-subclass-attribute": (_tagged(1.0), _tagged(2.0), lambda m: m.value.scale),
    "partial-attribute": (_partial_with(1.0), _partial_with(2.0), lambda m: m.value.extra),
    "function-attribute": (_function_with(1.0), _function_with(3.0), lambda m: m.value(1.0)),
    "dataclass-compare-false": (_Scaled(1.0), _Scaled(2.0), lambda m: m.value.scale),
    "dataclass-zero-sign": (_Scaled(0.0), _Scaled(-0.0), lambda m: math.atan2(m.value.scale, -1)),
    # NumPy's Generator pickles through its bit generator, and its __getstate__ returns
    # None: two seeds compared alike, and every member drew from member 0's (0.26 off).
    "numpy-generator-seed": (
        np.random.default_rng(0),
        np.random.default_rng(1),
        lambda m: float(copy.deepcopy(m.value).random()),
    ),
    # An lru_cache wrapper reduces to its name, whatever function it wraps.
    "lru-cache-wrapper": (
        _cached_scale(1.0),
        _cached_scale(10.0),
        lambda m: m.value(),
    ),
    # Its reduction leaves `t` out: compared by its reduction, the members were alike.
    "reduce-leaves-out-state": (_Rebuilt(10, 0), _Rebuilt(10, 5), lambda m: m.value.t),
    "numpy-bit-generator-seed": (
        np.random.PCG64(0),
        np.random.PCG64(1),
        lambda m: float(copy.deepcopy(m.value).random_raw() % 7),
    ),
}


@pytest.mark.parametrize("case", sorted(_DIFFERING_VALUES))
def test_values_that_differ_only_strictly_are_refused(case: str) -> None:
    a, b, read = _DIFFERING_VALUES[case]
    members = [_Holder(a, read), _Holder(b, read)]
    x = torch.randn(4, 3)
    assert not torch.equal(members[0](x), members[1](x))  # forward tells them apart
    with pytest.raises(ValueError, match="member 1 has the root module \\(_Holder\\) with `value`"):
        fe.Ensemble(members)


def test_equal_numpy_scalars_are_the_same_value() -> None:
    read = lambda m: float(m.value)  # noqa: E731
    members = [_Holder(np.float32(0.5), read), _Holder(np.float32(0.5), read)]
    fe.Ensemble(members)
    with pytest.raises(ValueError, match=r"member 1 has the root module \(_Holder\) with `value`"):
        fe.Ensemble([_Holder(np.float32(0.5), read), _Holder(np.float64(0.5), read)])


def test_parameter_order_is_part_of_the_architecture() -> None:
    class Flat(nn.Module):
        def __init__(self, first: str) -> None:
            super().__init__()
            for name in (first, "b" if first == "a" else "a"):
                self.register_parameter(name, nn.Parameter(torch.randn(2)))

        def forward(self, x: Tensor) -> Tensor:
            return x * torch.cat(list(self.parameters()))[:2]  # flat-parameter style

    with pytest.raises(
        ValueError,
        match=r"member 1 has the root module with its parameters registered in the order "
        r"\['b', 'a'\]; member 0 has \['a', 'b'\] \(the same names",
    ):
        fe.Ensemble([Flat("a"), Flat("b")])


class _Watching(nn.Module):
    """Keeps its own weight in a list (for a penalty, a log): forward reads it there."""

    def __init__(self) -> None:
        super().__init__()
        self.l = lin(3, 2)
        self.watch = [self.l.weight]

    def forward(self, x: Tensor) -> Tensor:
        return self.l(x) * self.watch[0].sum()


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("make", [fe.Ensemble, fe.stack, fe.HeteroEnsemble])
def test_a_reference_to_the_members_own_tensor_outside_its_slots_is_refused(make, n) -> None:
    """In the one copy every member runs through, `watch[0]` reached the stacked
    [N, ...] weight: every member multiplied by the sum of all members' weights."""
    with pytest.raises(
        ValueError,
        match=r"member 0 \(_Watching\) holds its parameter `l.weight` in `watch\[0\]`, outside "
        r"the registered parameters and buffers",
    ):
        make([_Watching() for _ in range(n)])


def test_a_hook_capturing_the_members_own_tensor_is_refused() -> None:
    def member() -> nn.Module:
        m = lin(3, 2)
        weight = m.weight
        m.register_forward_hook(lambda mod, args, out: out * weight.sum())
        return m

    with pytest.raises(
        ValueError,
        match=r"holds its parameter `weight` in `forward hook 0 \(its captured variable weight\)`",
    ):
        fe.Ensemble([member() for _ in range(2)])


def test_a_hidden_trainable_module_or_tensor_is_refused() -> None:
    """A shared encoder kept in a list (out of parameters()): the loop trains it through
    every member; the ensemble ran a copy, and its gradient was lost."""
    encoder = lin(3, 3)

    class Head(nn.Module):
        def __init__(self, hidden: object) -> None:
            super().__init__()
            self.l = lin(3, 2)
            self.hidden = hidden

        def forward(self, x: Tensor) -> Tensor:
            return self.l(x)

    with pytest.raises(
        ValueError,
        match=r"member 0 \(Head\) holds a Linear module with trainable tensors in `hidden\[0\]`",
    ):
        fe.Ensemble([Head([encoder]) for _ in range(2)])
    scale = torch.ones(2, requires_grad=True)
    with pytest.raises(
        ValueError, match=r"holds a tensor that requires grad in `hidden\['scale'\]`"
    ):
        fe.stack([Head({"scale": scale}) for _ in range(2)])
    frozen = lin(3, 3).requires_grad_(False)  # a frozen one is a value: compared, copied
    fe.Ensemble([Head([frozen]) for _ in range(2)])


def test_a_member_holding_member_0s_submodule_is_refused() -> None:
    """Member 0 reads its layer through `peer`; so does member 1, but it holds member 0's
    layer there: the loop runs it through member 0's weights, the ensemble did through
    its own."""
    read = lambda m: m.peer[0].weight.sum()  # noqa: E731
    first, other = _Holder(1.0, read), _Holder(1.0, read)
    for m in (first, other):
        m.l.requires_grad_(False)  # frozen: a module a member may hold as a value
        m.l.weight.data.normal_()
    first.peer, other.peer = [first.l], [first.l]
    with pytest.raises(ValueError, match="member 1 has the root module \\(_Holder\\) with `peer`"):
        fe.Ensemble([first, other])


def _accepted_as_the_loop(members: list[nn.Module], x: Tensor) -> None:
    """The members build an ensemble, which computes what the loop computes."""
    want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(fe.Ensemble(members)(x), want, rtol=0, atol=1e-6)


def test_an_optimizer_kept_on_the_member_is_accepted() -> None:
    """An RL agent keeps its optimizer on the module: it holds the member's parameters
    for training, not for forward to read (the own-tensor check once refused it)."""

    class Agent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pi = lin(8, 2)
            self.optim = torch.optim.Adam(self.parameters(), lr=3e-4)

        def forward(self, x: Tensor) -> Tensor:
            return self.pi(x)

    _accepted_as_the_loop([Agent() for _ in range(3)], torch.randn(4, 8))


def test_sets_are_compared_without_matching_every_pair_of_elements() -> None:
    """Strict set comparison once compared every pair of elements (a 4000-word stop list
    took 16 s to build an ensemble of 4): now each element gets one strict key."""
    from funcensemble._structure.same_value import SameValue

    calls = []

    class Counting(SameValue):
        def __call__(self, a, b):
            calls.append(1)
            return super().__call__(a, b)

    words = {f"w{i}" for i in range(1000)}
    assert Counting({}, set())(set(words), set(words))
    assert len(calls) < 10  # not 1000 * 1000
    assert not Counting({}, set())({0.0, 1}, {-0.0, 1})
    assert not Counting({}, set())({1, 2}, {True, 2})


class _Slotted:
    __slots__ = ("held",)

    def __init__(self, held: object) -> None:
        self.held = held


class _Helper:
    def __init__(self, held: object) -> None:
        self.held = held

    def read(self) -> object:
        return self.held


def _nested(value: object, depth: int) -> object:
    for _ in range(depth):
        value = [value]
    return value


_HIDING_PLACES = {
    # name: (how a member hides its own weight, the path the message names)
    "slots": (lambda w: _Slotted(w), r"`hidden.held`"),
    "bound-method": (lambda w: _Helper(w).read, r"`hidden.__self__.held`"),
    "dict-key": (lambda w: {w: 1.0}, r"`hidden \(a key\)`"),
    "nested-12-deep": (lambda w: _nested(w, 12), r"`hidden(\[0\]){12}`"),
    "foreign-module": (lambda w: [_Stash(w)], r"`hidden\[0\].stash`"),
}


class _Stash(nn.Module):
    """A module of no parameters of its own, keeping a tensor as a plain attribute."""

    def __init__(self, held: object) -> None:
        super().__init__()
        self.stash = held


class _Hider(nn.Module):
    def __init__(self, hide) -> None:
        super().__init__()
        self.l = lin(3, 2)
        self.hidden = hide(self.l.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.l(x)


@pytest.mark.parametrize("place", sorted(_HIDING_PLACES))
def test_the_members_own_tensor_is_found_wherever_it_is_held(place) -> None:
    hide, path = _HIDING_PLACES[place]
    with pytest.raises(ValueError, match=r"holds its parameter `l.weight` in " + path):
        fe.Ensemble([_Hider(hide) for _ in range(2)])


def test_weak_references_to_the_members_own_modules_are_refused_and_others_kept() -> None:
    """A copy keeps a weak reference as it is: a child's weakref.ref(root) in the one
    copy still reached member 0's original root, and every member computed with its
    embedding. A weak reference to something outside the members is the user's object
    in the ensemble too, and works."""
    import weakref

    class Child(nn.Module):
        def __init__(self, root: nn.Module) -> None:
            super().__init__()
            self.l = lin(3, 3)
            self.root = weakref.ref(root)

        def forward(self, x: Tensor) -> Tensor:
            return self.root().emb(self.l(x))

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = lin(3, 2)
            self.child = Child(self)

        def forward(self, x: Tensor) -> Tensor:
            return self.child(x)

    with pytest.raises(
        ValueError,
        match=r"submodule `child` \(Child\) holds a weak reference to its own Root in `root`",
    ):
        fe.Ensemble([Root() for _ in range(2)])
    proxied = Root()
    object.__setattr__(proxied.child, "root", weakref.proxy(proxied))  # a proxy too
    with pytest.raises(ValueError, match=r"holds a weak reference to its own Root in `root`"):
        fe.Ensemble([proxied, Root()])

    scale = torch.ones(2, requires_grad=True)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = lin(3, 2)
            self.scale = weakref.ref(scale)

        def forward(self, x: Tensor) -> Tensor:
            return self.l(x) * self.scale()

    members = [Scaled() for _ in range(2)]
    x = torch.randn(4, 3)
    torch.stack([m(x) for m in members]).sum().backward()
    want = scale.grad.clone()
    scale.grad = None
    fe.Ensemble(members)(x).sum().backward()
    torch.testing.assert_close(scale.grad, want)


def _captures_in_hook() -> nn.Module:
    m = lin(3, 3)
    m.register_forward_hook(lambda mod, args, out: out * m.weight.sum())
    return m


def _captures_in_forward() -> nn.Module:
    m = nn.Module()
    m.lin = lin(3, 3)
    m.forward = lambda x: torch.tanh(m.lin(x))
    return m


def _captures_in_list() -> nn.Module:
    m = nn.Module()
    m.lin = lin(3, 3)
    step = m.lin.forward  # a bound method, itself fine, here reached through a closure
    m.steps = [lambda h: step(h) * 2]
    m.forward = types.MethodType(lambda self, x: self.steps[0](x), m)
    return m


def _captures_as_default() -> nn.Module:
    m = lin(3, 3)

    def hook(mod, args, m=m):
        return (args[0] * m.weight.mean(),)

    m.register_forward_pre_hook(hook)
    return m


def _captures_in_state_dict_hook() -> nn.Module:
    m = lin(3, 3)
    m.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: m.weight.sum())
    return m


_CAPTURES = {
    "state-dict hook": (
        _captures_in_state_dict_hook,
        r"`state-dict pre-hook 0 \(its captured variable m\)`.*state_dict\(\) and "
        r"load_state_dict\(\) would run it on member 0's original",
    ),
    "hook": (
        _captures_in_hook,
        r"`forward hook 0 \(its captured variable m\)`",
    ),
    "forward": (_captures_in_forward, r"`forward \(its captured variable m\)`"),
    "list": (_captures_in_list, r"`steps\[0\] \(its captured variable step\)\.__self__`"),
    "default": (_captures_as_default, r"`forward pre-hook 0 \(its default m\)`"),
}


@pytest.mark.parametrize("case", sorted(_CAPTURES))
def test_a_function_capturing_the_members_own_module_is_refused(case) -> None:
    """Copying a module copies no function: a hook, an instance forward or a lambda
    that captured the member's own module (not the module it is given) still reached
    member 0's original in the one copy every member runs through. The ensemble ran
    with no error: every member was scaled by member 0's weight, or an instance forward
    gave member 0's output for every member (1.8 off the loop), its gradients lost."""
    make, where = _CAPTURES[case]
    for build in (fe.Ensemble, fe.stack):
        with pytest.raises(ValueError, match=r"captures its own .* in " + where):
            build([make() for _ in range(3)])


def test_functions_reaching_the_module_through_their_arguments_compute_as_the_loop() -> None:
    """What the refusal above advises: the hook's module argument, and a bound method
    (which the copy rebinds), as a hook and as an instance forward."""

    def make() -> nn.Module:
        m = nn.Module()
        m.lin = lin(3, 3)
        m.lin.register_forward_hook(lambda mod, args, out: out * mod.weight.sum())
        m.forward = m.lin.forward
        return m

    torch.manual_seed(0)
    members = [make() for _ in range(3)]
    x = torch.randn(4, 3)
    want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(fe.Ensemble(members)(x), want)


def _wraps_forward(module: nn.Module) -> nn.Module:
    """accelerate's add_hook_to_module: forward becomes a partial over the module, whose
    function functools.wraps marks with the module's own forward (`__wrapped__`)."""
    module._old_forward = module.forward

    @functools.wraps(module._old_forward)
    def new_forward(module: nn.Module, *args: Any) -> Tensor:
        return module._old_forward(*args) * 2

    module.forward = functools.update_wrapper(
        functools.partial(new_forward, module), module._old_forward
    )
    return module


def _load_pre_hook(module: nn.Module) -> nn.Module:
    """torch's public register_load_state_dict_pre_hook, which holds the module weakly
    (its copy holds the copy)."""
    module.register_load_state_dict_pre_hook(lambda mod, *args: None)
    return module


def _quantization_prepared(module: nn.Module) -> nn.Module:
    """torch.ao's prepare keeps observer factories closing over the module in qconfig."""
    import torch.ao.quantization as quantization

    module.qconfig = quantization.default_qconfig
    return quantization.prepare(module, inplace=False)


# torch.ao's notes on its observers, and its deprecation (torch 2.10 and later).
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("wrap", [_wraps_forward, _load_pre_hook, _quantization_prepared])
def test_what_only_seems_to_capture_the_member_is_kept_and_computes_as_the_loop(wrap) -> None:
    """False refusals of the check above, found by its review: a functools.wraps record
    (__wrapped__, never called through), torch's wrapper of a hook given the module (a
    weak reference its copy swaps for the copy), and torch.ao's qconfig (read by
    prepare, not by forward)."""
    torch.manual_seed(0)
    members = [nn.Sequential(wrap(lin(4, 4)), nn.Tanh()) for _ in range(3)]
    x = torch.randn(5, 4)
    want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(fe.Ensemble(members)(x), want)


@pytest.mark.parametrize("how", ["registered", "proxy", "plain"])
def test_a_back_reference_registered_as_a_submodule_is_refused(how) -> None:
    """A child registering its root (directly, or as a weakref.proxy, which nn.Module
    registers as a module too) makes the module tree a cycle: the ensemble's call died
    with a RecursionError. It is refused at construction, naming the submodule and the
    fix; the fix (a plain reference torch does not register) computes as the loop."""
    import weakref

    class Child(nn.Module):
        def __init__(self, root: nn.Module) -> None:
            super().__init__()
            self.l = lin(3, 3)
            if how == "registered":
                self.root = root
            elif how == "proxy":
                self.root = weakref.proxy(root)
            else:
                object.__setattr__(self, "root", root)

        def forward(self, x: Tensor) -> Tensor:
            return self.root.out(self.l(x))

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = lin(3, 2)
            self.child = Child(self)

        def forward(self, x: Tensor) -> Tensor:
            return self.child(x)

    members = [Root() for _ in range(3)]
    x = torch.randn(4, 3)
    if how == "plain":
        torch.testing.assert_close(fe.Ensemble(members)(x), torch.stack([m(x) for m in members]))
        return
    proxy = (
        "a weakref.proxy, which nn.Module registers as a submodule, of " if how == "proxy" else ""
    )
    with pytest.raises(
        ValueError,
        match=rf"member 0's submodule `child.root` is {proxy}the root module, its own "
        r"ancestor, so the module tree has a cycle .* object.__setattr__\(self, 'root', module\)",
    ):
        fe.Ensemble(members)


def test_a_hook_handle_kept_on_the_member_is_the_same_value() -> None:
    """Feature-extraction code keeps the handle to remove its hook later: handle ids
    count up across modules, so members' handles were refused as different values."""

    def hook(module, args, out):
        return out * 2

    class Tapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = lin(3, 2)
            self.handle = self.l.register_forward_hook(hook)

        def forward(self, x: Tensor) -> Tensor:
            return self.l(x)

    _accepted_as_the_loop([Tapped() for _ in range(2)], torch.randn(4, 3))
    other = Tapped()
    other.l.register_forward_hook(hook)  # a second hook: its handle is the first of two
    with pytest.raises(ValueError, match=r"member 1 has the root module .* with `handle`"):
        fe.Ensemble([Tapped(), other])


# --- attributes set on the members' tensors ----------------------------------------


def _tagged_member(tag: object = True) -> nn.Module:
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    m[0].bias.no_decay = tag
    m[2].bias.no_decay = tag
    return m


def _no_decay(params) -> list[bool]:
    return [getattr(p, "no_decay", False) for p in params]


def test_attributes_on_the_members_tensors_are_carried_to_the_ensemble_and_back() -> None:
    """A tag set on a parameter (e.g. to build optimizer groups) was dropped by stacking:
    groups built from ens.parameters() treated those parameters unlike the loop's."""
    members = [_tagged_member() for _ in range(3)]
    ens = fe.Ensemble(members)
    assert _no_decay(ens.parameters()) == _no_decay(members[0].parameters())
    assert _no_decay(ens.member(1).parameters()) == _no_decay(members[1].parameters())
    fmodel, params, buffers = fe.stack(members)
    assert all(
        _no_decay(m.parameters()) == _no_decay(members[0].parameters())
        for m in fe.unstack(fmodel, params, buffers)
    )
    grouped = [p for p in ens.parameters() if getattr(p, "no_decay", False)]
    assert [p.shape for p in grouped] == [(3, 4), (3, 2)]


def test_members_whose_tensors_differ_in_an_attribute_are_refused() -> None:
    with pytest.raises(ValueError, match=r"member 1 has parameter `0\.bias` with `no_decay` = 0"):
        fe.Ensemble([_tagged_member(1), _tagged_member(0)])
    untagged = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"member 0 has parameter `0\.bias` with the attribute"):
        fe.Ensemble([_tagged_member(), untagged])


def test_a_forward_reading_an_attribute_of_a_parameter_reads_the_members() -> None:
    """Inside the call forward saw plain stacked tensors: a direct read raised a bare
    AttributeError, and getattr with a default got the default (1.54 off the loop)."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(3, 2).double()
            self.l.weight.scale = 0.5

        def forward(self, x: Tensor) -> Tensor:
            return self.l(x) * self.l.weight.scale * getattr(self.l.bias, "shift", 1.0)

    torch.manual_seed(0)
    members = [Scaled() for _ in range(3)]
    for m in members:
        m.l.bias.shift = 3.0
    x = torch.randn(4, 3, dtype=torch.float64)
    want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(fe.Ensemble(members)(x), want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(fe.Ensemble(members, chunk_size=2)(x), want, rtol=1e-12, atol=1e-14)
    fmodel, params, buffers = fe.stack(members)
    torch.testing.assert_close(fe.vmap(fmodel)(params, buffers, x), want, rtol=1e-12, atol=1e-14)
    assert not hasattr(params["l.weight"], "scale")  # the caller's tensors are left alone
    ens = fe.Ensemble(members)
    ens(x)
    for p in ens.stacked.parameters():  # tagged after the first call: read at every call
        p.scale = 2.0
    for m in members:
        m.l.weight.scale = 2.0
    want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(ens(x), want, rtol=1e-12, atol=1e-14)
    one = {k: v[0] for k, v in params.items()}  # one member's slice, called directly
    with pytest.raises(
        ValueError, match=r"forward read `scale`, an attribute set on the parameter `l\.weight`"
    ):
        fmodel(one, {}, x)


class _ReadsATag(nn.Module):
    def __init__(self, *, tagged: bool) -> None:
        super().__init__()
        self.l = nn.Linear(3, 2).double()
        self.norm = nn.LayerNorm(2).double()  # off the MLP fast path: forward runs
        if tagged:
            self.l.weight.scale = 0.5

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.l(x)) * getattr(self.l.weight, "scale", 1.0)


_COMPILED_TAGS_SCRIPT = """
import sys
import torch
sys.path.insert(0, "tests")
from test_architecture import _ReadsATag
import funcensemble as fe
from funcensemble import _torch_compat

def close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)

x = torch.randn(4, 3, dtype=torch.float64)
for tagged in (False, True):
    torch.manual_seed(0)
    members = [_ReadsATag(tagged=tagged) for _ in range(3)]
    want = torch.stack([m(x) for m in members])
    ens = fe.Ensemble(members)
    fmodel, params, buffers = fe.stack(members)
    torch._dynamo.reset()
    close(torch.compile(ens, backend="eager")(x), want)
    close(torch.compile(fe.vmap(fmodel), backend="eager")(params, buffers, x), want)
    torch._dynamo.reset()
    whole = torch.compile(ens, backend="eager", fullgraph=True)
    try:
        got = whole(x)
    except Exception as refused:
        assert tagged, refused
        said = "forward may read the Python attributes set on the members' parameters"
        assert said in str(refused) or not _torch_compat._DISABLE_SAYS, refused
        print("refused")
    else:
        assert not tagged
        close(got, want)
        print("compiled")
    # torch.export: non-strict tracing sees the tags; strict tracing is Dynamo's.
    close(torch.export.export(ens, (x,), strict=False).module()(x), want)
    try:
        close(torch.export.export(ens, (x,), strict=True).module()(x), want)
    except Exception as refused:
        assert tagged, refused
# Whether a call has tags is settled when it compiles (compile.md).
torch._dynamo.reset()
members = [_ReadsATag(tagged=False) for _ in range(3)]
want = torch.stack([m(x) for m in members])
ens = fe.Ensemble(members)
compiled = torch.compile(ens, backend="eager")
compiled(x)
for p in ens.stacked.parameters():
    p.scale = 0.5
close(compiled(x), want)
close(ens(x), want * 0.5)
print("settled")
# Non-strict export traces fake tensors: the tags are read from the real ones, as they
# are when it traces (set, changed or deleted after the last eager call).
ens = fe.Ensemble([_ReadsATag(tagged=False) for _ in range(3)])
want = torch.stack([m(x) for m in ens.unstack()])
for scale in (0.5, 0.25, None):
    for p in ens.stacked.parameters():
        if scale is None:
            del p.scale
        else:
            p.scale = scale
    factor = 1.0 if scale is None else scale
    close(torch.export.export(ens, (x,), strict=False).module()(x), want * factor)
print("exported")
"""


def test_under_compile_a_forward_reading_a_tag_runs_eagerly_or_is_refused() -> None:
    """torch.compile cannot show forward a tensor's attributes: getattr with a default
    got the default, 0.61 off the loop. The ensemble's call now runs eagerly (right
    values) and fullgraph=True refuses it; models without tags compile as before. In a
    clean interpreter: the test run's jaxtyping wrappers break graphs themselves."""
    skip_unless_dynamo_traces_optree()
    done = subprocess.run(
        [sys.executable, "-c", _COMPILED_TAGS_SCRIPT],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["compiled", "refused", "settled", "exported"]


def test_prelu_members_may_differ_in_the_slope_they_started_from() -> None:
    """PReLU's `init` is read by reset_parameters only (forward reads the weight): members
    built with different values were refused, with the advice to build one per value."""
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(3, 4), nn.PReLU(init=0.1 * (i + 1))).double() for i in range(3)
    ]
    ens = fe.Ensemble(copy.deepcopy(members))
    x = torch.randn(5, 3, dtype=torch.float64)
    want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(ens(x), want, rtol=1e-12, atol=1e-14)


class _Draws(nn.Module):
    def __init__(self, source: object, draw) -> None:
        super().__init__()
        self.l = lin(3, 2)
        self.source = source
        self.draw = draw

    def forward(self, x: Tensor) -> Tensor:
        return self.l(x) * float(self.draw(self.source))


@pytest.mark.parametrize(
    ("make", "draw", "match"),
    [
        (lambda: random.Random(0), lambda r: r.random(), r"holds the same Random as member 0"),
        (
            lambda: np.random.default_rng(0),
            lambda g: g.random(),
            r"holds the same Generator as member 0",
        ),
        (lambda: iter(range(100)), next, r"holds the same range_iterator as member 0"),
    ],
    ids=["random.Random", "numpy-Generator", "iterator"],
)
def test_members_sharing_one_generator_or_iterator_are_refused(make, draw, match) -> None:
    """The loop's members draw from a shared generator in turn, each its own values; the
    ensemble's call draws once for all (0.48 off the loop), without a word."""
    shared = make()
    with pytest.raises(ValueError, match=match):
        fe.Ensemble([_Draws(shared, draw) for _ in range(3)])


def test_members_iterating_over_one_shared_source_are_refused() -> None:
    """Each member's own map over one shared iterator: they reduce alike (the source is
    the same object), so they compared equal, and the ensemble drew once (1.98 off)."""
    shared = iter(range(1, 100))
    with pytest.raises(ValueError, match=r"member 1 has the root module \(_Draws\) with `source`"):
        fe.Ensemble([_Draws(map(float, shared), next) for _ in range(3)])


def test_marks_torch_sets_on_tensors_are_not_the_members_tags() -> None:
    """torch.compile of an optimizer's step marks its parameters (_dynamo_static_input_type):
    a member trained that way was refused against fresh ones, and the marks were copied."""
    members = [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(3)]
    for p in members[0].parameters():
        p._dynamo_static_input_type = "unguarded"
    ens = fe.Ensemble(members)
    assert all(not vars(p) for p in ens.parameters())


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
@pytest.mark.parametrize("which", [0, 1])
def test_a_gradient_hook_on_a_members_tensor_is_refused(kind, which) -> None:
    # The loop's hook (a per-parameter clip) acts on that member's gradient; the
    # ensemble's stacked copy would never run it (13.1 off the loop's clipped gradient).
    members = [lin(4, 3) for _ in range(3)]
    hook = (lambda g: g.clamp(-0.01, 0.01)) if kind == "register_hook" else (lambda p: None)
    getattr(members[which].weight, kind)(hook)
    match = rf"member {which}'s tensor `weight` \(Linear\) has a gradient hook"
    with pytest.raises(ValueError, match=match):
        fe.Ensemble(members)
    with pytest.raises(ValueError, match=match):
        fe.stack(members)


class _AliasNet(nn.Module):
    def __init__(self, alias) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.w = alias(self)

    def forward(self, x):
        return self.lin(x) + x @ self.w.T


@pytest.mark.parametrize(
    ("alias", "noun", "name"),
    [
        (lambda m: m.lin.weight.data, "parameter", "lin.weight"),
        (lambda m: m.lin.weight.detach(), "parameter", "lin.weight"),
        (lambda m: m.lin.weight.detach()[:, :4], "parameter", "lin.weight"),
        (lambda m: m.scale.view(1, 4).expand(4, 4), "buffer", "scale"),
        (lambda m: torch.from_numpy(m.lin.weight.detach().numpy()), "parameter", "lin.weight"),
    ],
    ids=["data", "detach", "view", "buffer-view", "through-numpy"],
)
def test_an_attribute_aliasing_a_members_own_tensor_is_refused(alias, noun, name) -> None:
    # The loop's alias follows its parameter as it trains; the ensemble's copy of it
    # would stay member 0's initial values (216 off the loop after two SGD steps).
    torch.manual_seed(0)
    members = [_AliasNet(alias) for _ in range(2)]
    match = rf"member 0 \(_AliasNet\) holds a tensor sharing memory with its {noun} `{name}` in `w`"
    for stacked in (members, members[:1]):
        with pytest.raises(ValueError, match=match):
            fe.Ensemble(stacked)


class _NumpyAliasNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias_np = self.lin.bias.detach()[1:].numpy()  # a view, at an offset

    def forward(self, x):
        return self.lin(x) + torch.from_numpy(self.bias_np).sum()


def test_a_numpy_view_of_a_members_own_tensor_is_refused() -> None:
    # Copied as a constant, it stayed member 0's initial values (34.4 off the loop
    # after two SGD steps, the biases starting equal).
    members = [_NumpyAliasNet() for _ in range(2)]
    match = r"holds an array sharing memory with its parameter `lin.bias` in `bias_np`"
    with pytest.raises(ValueError, match=match):
        fe.Ensemble(members)


class _WindowNet(nn.Module):
    """Keeps a history and a window on it (a view) as two attributes; forward writes
    through the window and reads the whole history."""

    def __init__(self, window: Callable[[np.ndarray], Any]) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.hist = np.zeros(4)
        self.head = window(self.hist)

    def forward(self, x):
        self.hist[:1] += 1 if isinstance(self.head, torch.Tensor) else 0
        if isinstance(self.head, np.ndarray):
            self.head += 1
        return self.lin(x) * float(self.hist.sum())


@pytest.mark.parametrize(
    "window, other",
    [
        (lambda a: a[:1], "head"),
        (lambda a: [a[1:3]], r"head\[0\]"),
        (lambda a: {"w": a.reshape(2, 2).T}, r"head\['w'\]"),
        (lambda a: torch.from_numpy(a), "head"),
    ],
    ids=["view", "view-in-list", "transposed-in-dict", "from_numpy"],
)
def test_numpy_memory_held_under_two_names_is_refused(window, other) -> None:
    # Found by an audit: copying the member copied the array and its view on their own,
    # so a write through the view no longer reached the array (1.2 to 3.7 off the loop
    # after three calls).
    members = [_WindowNet(window) for _ in range(3)]
    match = rf"member 0 \(_WindowNet\) holds NumPy memory under two names, `hist` and `{other}`"
    with pytest.raises(ValueError, match=match):
        fe.Ensemble(members)
    # In two submodules: each named from the member's root.
    nested = []
    for _ in range(3):
        root = nn.Sequential(_WindowNet(lambda a: a), _WindowNet(lambda a: a))
        root[1].hist = window(root[0].hist)
        nested.append(root)
    match = r"member 0 \(Sequential\) holds NumPy memory under two names, `0.hist` and `1.hist"
    with pytest.raises(ValueError, match=match):
        fe.Ensemble(nested)


class _TwoNames(nn.Module):
    def __init__(self, first: np.ndarray, second: np.ndarray) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.first, self.second = first, second

    def forward(self, x):
        self.first += 1
        return self.lin(x) * float(self.first.sum() + 10 * self.second.sum())


def test_numpy_arrays_held_once_or_interleaved_still_stack() -> None:
    # One array under two names is one object in the copy too; views that share no
    # element (evens and odds) need no link. Both compute as the loop.
    def once():
        a = np.zeros(4)
        return _TwoNames(a, a)

    def interleaved():
        a = np.zeros(4)
        return _TwoNames(a[::2], a[1::2])

    torch.manual_seed(0)
    for make in (once, interleaved):
        members = [make() for _ in range(3)]
        loop = [make() for _ in range(3)]
        for m, twin in zip(members, loop, strict=True):
            twin.load_state_dict(m.state_dict())
        ens = fe.Ensemble(members)
        x = torch.randn(5, 3)
        for _ in range(3):
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]))


class _ReadOnlyTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.table = np.arange(4.0)
        self.table.flags.writeable = False
        self.tail = self.table[1:]

    def forward(self, x):
        return self.lin(x) * float(self.table.sum() + self.tail[0])


def test_a_read_only_numpy_table_and_a_view_of_it_still_stack() -> None:
    # Nothing can write through either name, so the copy's two arrays stay alike.
    torch.manual_seed(0)
    members = [_ReadOnlyTable() for _ in range(3)]
    ens = fe.Ensemble(members)
    x = torch.randn(5, 3)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


def test_a_constant_attribute_of_its_own_memory_still_stacks() -> None:
    torch.manual_seed(0)
    members = [_AliasNet(lambda m: torch.eye(4)) for _ in range(3)]
    ens = fe.Ensemble(members)
    x = torch.randn(5, 4)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))


class _Plain(torch.Tensor):
    pass


class _Clipped(torch.Tensor):
    """Every op with this tensor clips its result to [-0.1, 0.1]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return out.clamp(-0.1, 0.1) if isinstance(out, torch.Tensor) else out


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("slot", ["buffer", "parameter"])
def test_a_tensor_subclass_in_a_member_is_refused(slot, which) -> None:
    # Stacked into a plain tensor, the subclass's behaviour was dropped (2.92 off the loop).
    members = [lin(4, 4) for _ in range(3)]
    target = members[which]
    if slot == "buffer":
        target.register_buffer("scale", torch.ones(4).as_subclass(_Clipped))
        name = "scale"
    else:
        target.weight = nn.Parameter(target.weight.detach().as_subclass(_Plain))
        name = "weight"
    kind = "_Clipped" if slot == "buffer" else "_Plain"
    match = rf"member {which}'s tensor `{name}` \(Linear\) is a {kind}, a subclass of torch.Tensor"
    with pytest.raises(TypeError, match=match):
        fe.Ensemble(members)


class _Temperature:
    def __init__(self, value: float) -> None:
        self.value = value


class _Tempered(nn.Module):
    def __init__(self, temperature: _Temperature) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.temperature = temperature

    def forward(self, x):
        return (self.lin(x) / self.temperature.value).softmax(-1)


def test_an_object_every_member_holds_is_held_by_the_ensemble_too() -> None:
    # It was deep-copied at build: annealing it afterwards reached the loop's members
    # but not the ensemble (0.51 off).
    torch.manual_seed(0)
    shared = _Temperature(1.0)
    loop = [_Tempered(shared) for _ in range(3)]
    ens = fe.Ensemble(loop)
    fmodel, params, buffers = fe.stack(loop)
    made = fe.Ensemble.from_factory(lambda: _Tempered(shared), num_members=3, seed=0)
    x = torch.randn(5, 4)
    shared.value = 0.1
    want = torch.stack([m(x) for m in loop])
    torch.testing.assert_close(ens(x), want)
    torch.testing.assert_close(fe.vmap(fmodel)(params, buffers, x), want)
    torch.testing.assert_close(ens.member(1)(x), want[1])
    torch.testing.assert_close(ens.select([2, 0])(x), want[[2, 0]])
    assert made.stacked.temperature is shared


def test_objects_each_member_holds_on_its_own_are_copied() -> None:
    # Equal but distinct: a change to member 0's own object after building must not
    # reach the other members through the ensemble's one copy.
    torch.manual_seed(0)
    members = [_Tempered(_Temperature(1.0)) for _ in range(3)]
    ens = fe.Ensemble(members)
    members[0].temperature.value = 0.1
    assert ens.stacked.temperature.value == 1.0
    single = fe.Ensemble(members[:1])  # one member: its own object is every member's
    members[0].temperature.value = 0.5
    assert single.stacked.temperature is members[0].temperature


class _TemperedList(nn.Module):
    def __init__(self, temperatures: dict) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.settings = {"temperatures": [temperatures["t"]], "scale": 2.0}

    def forward(self, x):
        return self.lin(x) / self.settings["temperatures"][0].value


def test_an_object_every_member_holds_in_a_container_is_held_by_the_ensemble_too() -> None:
    torch.manual_seed(0)
    shared = _Temperature(1.0)
    loop = [_TemperedList({"t": shared}) for _ in range(3)]
    ens = fe.Ensemble(loop)
    shared.value = 0.1
    x = torch.randn(5, 4)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]))
    assert ens.stacked.settings is not loop[0].settings  # the containers are copies


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_ensemble_keeps_the_object_its_members_hold_as_one(how) -> None:
    """Deep-copied or unpickled, the ensemble's members still hold one object, as in
    copy.deepcopy of the members' list: each member and select got its own copy."""
    torch.manual_seed(0)
    ens = fe.Ensemble(_shared_tempered(3))
    fmodel = fe.stack(_shared_tempered(3))[0]
    if how == "deepcopy":
        copied, copied_fmodel = copy.deepcopy(ens), copy.deepcopy(fmodel)
    else:
        buffer = io.BytesIO()
        torch.save((ens, fmodel), buffer)
        buffer.seek(0)
        copied, copied_fmodel = torch.load(buffer, weights_only=False)
    picked = copied.select([0, 1])
    members = copied.unstack()
    assert picked.stacked.temperature is copied.stacked.temperature
    assert all(m.temperature is copied.stacked.temperature for m in members)
    assert copied.stacked.temperature is not ens.stacked.temperature
    copied.stacked.temperature.value = 0.1
    x = torch.randn(5, 4)
    torch.testing.assert_close(picked(x), copied(x)[:2])
    torch.testing.assert_close(members[2](x), copied(x)[2])
    # fe.stack's function: its members, unstacked, hold the copy's one object.
    _, params, buffers = fe.stack(_shared_tempered(3))
    back = fe.unstack(copied_fmodel, params, buffers)
    assert back[0].temperature is back[1].temperature is copied_fmodel.skeleton.temperature


def _shared_tempered(n: int) -> list[nn.Module]:
    temperature = _Temperature(1.0)
    return [_Tempered(temperature) for _ in range(n)]


def test_concat_keeps_only_the_objects_the_added_members_hold_too() -> None:
    # The grown ensemble gave the added members this ensemble's object, although they
    # hold their own (equal) one: annealing it changed them too (8.1 off the loop).
    torch.manual_seed(0)
    first, second = _Temperature(1.0), _Temperature(1.0)
    ens = fe.Ensemble([_Tempered(first) for _ in range(2)])
    grown = ens.concat([_Tempered(second) for _ in range(2)])
    assert grown.stacked.temperature is not first and grown.stacked.temperature.value == 1.0
    same = ens.concat([_Tempered(first)])
    assert same.stacked.temperature is first
    assert ens.concat(fe.Ensemble([_Tempered(first)])).stacked.temperature is first


def test_shared_objects_in_namedtuples_and_ordered_dicts_are_held_too() -> None:
    import collections

    pair = collections.namedtuple("Pair", "temperature other")

    class Net(nn.Module):
        def __init__(self, t):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.settings = collections.OrderedDict(pair=pair(t, 1))

        def forward(self, x):
            return self.lin(x) / self.settings["pair"].temperature.value

    torch.manual_seed(0)
    shared = _Temperature(1.0)
    loop = [Net(shared) for _ in range(3)]
    ens = fe.Ensemble(loop)
    shared.value = 0.1
    x = torch.randn(5, 4)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]))


# (importing torch._dynamo warns that torch.jit.script_method is deprecated)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "how", ["Module.compile()", "torch.compile", "torch.compile of its forward"]
)
@pytest.mark.parametrize("build", ["Ensemble", "stack", "HeteroEnsemble"])
def test_compiled_members_are_refused_with_what_to_do(how, build) -> None:
    """A member compiled on its own (in place, or wrapped by torch.compile) was refused
    with a message about a captured tensor or a differing attribute; the ensemble never
    runs a member's compiled call, so it says to compile the ensemble instead."""
    members = [nn.Sequential(nn.Linear(3, 4), nn.Tanh()) for _ in range(2)]
    if how == "torch.compile":
        members[1] = torch.compile(members[1])
    elif how == "torch.compile of its forward":
        members[1][0].forward = torch.compile(members[1][0].forward)
    else:
        members[1][0].compile()
    make = {"Ensemble": fe.Ensemble, "stack": fe.stack, "HeteroEnsemble": fe.HeteroEnsemble}
    with pytest.raises(ValueError, match=rf"member 1 has .* compiled with {re.escape(how)} "):
        make[build](members)


@pytest.mark.parametrize("inner", ["Ensemble", "HeteroEnsemble"])
@pytest.mark.parametrize("build", ["Ensemble", "stack", "HeteroEnsemble"])
def test_an_ensemble_inside_a_member_is_refused_in_plain_words(inner, build):
    """It was refused for a weak reference "in `fmodel._tensors['0.weight']`", with
    advice to hold a plain reference that torch does not register."""

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            modules = [nn.Linear(2, 3) for _ in range(2)]
            self.ens = getattr(fe, inner)(modules)

        def forward(self, x):
            return self.ens(x).mean(0)

    with pytest.raises(
        TypeError, match=rf"member 0 has an fe\.{inner} at submodule `ens`.*nn\.ModuleList"
    ):
        getattr(fe, build)([Heads(), Heads()])
    with pytest.raises(TypeError, match=r"member 0 is an fe\.Ensemble .*ens\.concat"):
        fe.Ensemble([fe.Ensemble([nn.Linear(2, 3)]) for _ in range(2)])


def test_a_class_holding_a_parametrizations_dict_of_its_own_is_compared_as_itself() -> None:
    """Two classes differing in forward, both keeping a ModuleDict named
    `parametrizations`, were taken for parametrize's subclasses of one base: member 1
    ran member 0's forward with no error (13.5 off the loop)."""

    class Base(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin(3, 2)
            self.parametrizations = nn.ModuleDict()

    class A(Base):
        def forward(self, x: Tensor) -> Tensor:
            return self.lin(x)

    class B(Base):
        def forward(self, x: Tensor) -> Tensor:
            return self.lin(x) * 10

    with pytest.raises(TypeError, match=r"member 1 is a \S*B; member 0 is a \S*A "):
        fe.Ensemble([A(), B(), A()])


def test_values_in_slots_are_refused() -> None:
    """A module class with __slots__: the slot was neither compared nor copied
    (nn.Module.__getstate__ keeps __dict__), so forward's getattr(self, 'scale', 1.0)
    gave 1.0 for every member with no error (scales 2, 5, 2: 6.0 off the loop)."""

    class Scaled(nn.Module):
        __slots__ = ("scale",)

        def __init__(self, scale: float) -> None:
            super().__init__()
            self.lin = lin(3, 2)
            self.scale = scale

        def forward(self, x: Tensor) -> Tensor:
            return self.lin(x) * getattr(self, "scale", 1.0)

    for build in (fe.Ensemble, fe.stack):
        with pytest.raises(
            TypeError,
            match=r"member 0 has the root module \(Scaled\) with values in __slots__ \(`scale`",
        ):
            build([Scaled(s) for s in (2.0, 5.0, 2.0)])


def test_an_attribute_copy_cannot_copy_is_named() -> None:
    """Identical members holding a torch.finfo were refused with deepcopy's bare
    "cannot pickle 'torch.finfo' object"."""

    class Clamped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(lin(3, 2))
            self.body[0].finfo = torch.finfo(torch.float32)

        def forward(self, x: Tensor) -> Tensor:
            return self.body(x)

    for build in (fe.Ensemble, fe.stack):
        with pytest.raises(
            TypeError,
            match=r"member 0's `finfo` of submodule `body.0` \(Linear\) could not be copied "
            r"\(copy.deepcopy raised TypeError: .*finfo",
        ):
            build([Clamped() for _ in range(2)])
    with pytest.raises(TypeError, match=r"^Ensemble.from_factory: member 0's `finfo`"):
        fe.Ensemble.from_factory(Clamped, num_members=2)
