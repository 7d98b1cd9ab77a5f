"""fe.vmap: outputs, buffer updates, gradients, randomness, in_dims, chunking, nesting.

Every result is compared, in float64, with a plain Python loop over ordinary modules.
"""

import copy
import time
import traceback
from collections import OrderedDict
from typing import Any

import pytest
import torch
from helpers import (
    ATOL,
    RTOL,
    ZOO,
    assert_trees_close,
    assert_trees_equal,
    clone_modules,
    loop_outputs,
    stacked_state,
)
from torch import Tensor, nn

import funcensemble as fe

MODES = ["train", "eval", "eval_no_grad"]


def _grad_context(mode: str):
    return torch.no_grad() if mode == "eval_no_grad" else torch.enable_grad()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_outputs_and_buffers_match_loop(name: str, n: int, mode: str) -> None:
    zoo = ZOO[name]
    modules = zoo.members(n, train=mode == "train")
    reference = clone_modules(modules)
    fmodel, params, buffers = fe.stack(modules)
    x = zoo.input()
    with _grad_context(mode):
        out = fe.vmap(fmodel)(params, buffers, x)
        expected = loop_outputs(reference, x)
        out_again = fe.vmap(fmodel)(params, buffers, x)  # a second step sees the updates
        expected_again = loop_outputs(reference, x)
    assert out.shape[0] == n
    assert_trees_close(out, expected, rtol=RTOL, atol=ATOL)
    assert_trees_close(out_again, expected_again, rtol=RTOL, atol=ATOL)
    # Train mode updates BatchNorm statistics and counters per member exactly as the
    # loop does; eval mode leaves them alone.
    _, expected_buffers = stacked_state(reference)
    assert_trees_close(buffers, expected_buffers, rtol=RTOL, atol=ATOL)
    if mode != "train":
        assert_trees_equal(buffers, stacked_state(modules)[1])
    elif buffers:  # the comparison above is not vacuous: the statistics did move
        assert any(not torch.equal(buffers[k], v) for k, v in stacked_state(modules)[1].items())


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_func_grad_matches_per_module_autograd(name: str, n: int, mode: str) -> None:
    zoo = ZOO[name]
    modules = zoo.members(n, train=mode == "train")
    reference = clone_modules(modules)
    fmodel, params, buffers = fe.stack(modules)
    x = zoo.input()

    def one_member_loss(p: dict, b: dict, x: Tensor) -> Tensor:
        return (fmodel(p, b, x) ** 2).mean()

    grads = fe.vmap(torch.func.grad(one_member_loss))(params, buffers, x)

    expected = []
    for module in reference:
        named = dict(module.named_parameters())
        g = torch.autograd.grad((module(x) ** 2).mean(), list(named.values()))
        expected.append(dict(zip(named, g, strict=True)))
    expected_grads = {k: torch.stack([e[k] for e in expected]) for k in expected[0]}
    assert_trees_close(grads, expected_grads, rtol=RTOL, atol=ATOL)
    # grad inside vmap still updates train-mode statistics per member, like the loop.
    assert_trees_close(buffers, stacked_state(reference)[1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_autograd_backward_through_vmap(name: str) -> None:
    zoo = ZOO[name]
    modules = zoo.members(3, train=True)
    reference = clone_modules(modules)
    fmodel, params, buffers = fe.stack(modules)
    x = zoo.input()
    fe.vmap(fmodel)(params, buffers, x).pow(2).sum().backward()
    for module in reference:
        module(x).pow(2).sum().backward()
    expected = {
        k: torch.stack([dict(m.named_parameters())[k].grad for m in reference]) for k in params
    }
    assert_trees_close({k: p.grad for k, p in params.items()}, expected, rtol=RTOL, atol=ATOL)


# --- randomness ------------------------------------------------------------------------


def _dropout_members(n: int) -> tuple[fe.FunctionalModule, dict, dict]:
    """``n`` identical members, so any difference between outputs is the dropout mask."""
    torch.manual_seed(0)
    one = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Dropout(0.5)).double()
    with torch.no_grad():
        one[0].bias.fill_(1.0)  # every unit positive before dropout: zeros are the mask
    return fe.stack([copy.deepcopy(one) for _ in range(n)])


def test_dropout_masks_differ_across_members_by_default() -> None:
    fmodel, params, buffers = _dropout_members(4)
    out = fe.vmap(fmodel)(params, buffers, torch.zeros(8, 4, dtype=torch.float64))
    masks = out == 0
    assert 0.3 < masks.double().mean() < 0.7
    for i in range(1, 4):
        assert not torch.equal(masks[0], masks[i])


def test_dropout_mask_shared_with_randomness_same() -> None:
    fmodel, params, buffers = _dropout_members(4)
    out = fe.vmap(fmodel, randomness="same")(
        params, buffers, torch.zeros(8, 4, dtype=torch.float64)
    )
    assert (out == 0).any()
    for i in range(1, 4):
        assert torch.equal(out[0], out[i])


@pytest.mark.parametrize("chunk_size", [1, 2])
def test_randomness_holds_across_chunks(chunk_size: int) -> None:
    fmodel, params, buffers = _dropout_members(5)
    x = torch.zeros(8, 4, dtype=torch.float64)
    same = fe.vmap(fmodel, randomness="same", chunk_size=chunk_size)(params, buffers, x)
    different = fe.vmap(fmodel, chunk_size=chunk_size)(params, buffers, x)
    for i in range(1, 5):
        assert torch.equal(same[0], same[i])
        assert not torch.equal(different[0] == 0, different[i] == 0)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_dropout_reproducible_under_manual_seed(randomness: str) -> None:
    fmodel, params, buffers = _dropout_members(3)
    x = torch.randn(8, 4, dtype=torch.float64)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(fe.vmap(fmodel, randomness=randomness)(params, buffers, x))
    torch.manual_seed(124)
    other = fe.vmap(fmodel, randomness=randomness)(params, buffers, x)
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], other)


def test_same_randomness_on_per_member_values_says_what_to_do() -> None:
    """torch.bernoulli of a layer's output under randomness="same" got torch's "please
    file an issue with functorch", naming neither the cause nor a way out."""

    class Stochastic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 4)

        def forward(self, x: Tensor) -> Tensor:
            return torch.bernoulli(torch.sigmoid(self.lin(x)))

    ens = fe.Ensemble([Stochastic() for _ in range(3)], randomness="same")
    with pytest.raises(RuntimeError, match=r"samples from a tensor that differs between the "):
        ens(torch.randn(2, 3))


@pytest.mark.parametrize("nested", [False, True])
def test_randomness_error_gives_own_message(nested: bool) -> None:
    fmodel, params, buffers = _dropout_members(2)
    x = torch.randn(8, 4, dtype=torch.float64)
    mapped = fe.vmap(fmodel, randomness="error")
    call = (
        (lambda: torch.func.grad(lambda p: mapped(p, buffers, x).sum())(params))
        if nested
        else (lambda: mapped(params, buffers, x))
    )
    with pytest.raises(RuntimeError, match=r"randomness='error'.*'different'.*'same'") as info:
        call()
    # torch's own wording appears nowhere, not even in the chained traceback; the
    # traceback still reaches the Dropout call.
    shown = "".join(traceback.format_exception(info.value))
    assert "error mode" not in shown and "randomness flags" not in shown
    assert "in forward" in shown and "dropout" in shown
    assert str(info.value).startswith("vmap: the model draws random numbers")
    # Without randomness, "error" is harmless.
    with torch.no_grad():
        fmodel.skeleton.eval()
        out = mapped(params, buffers, x)
    assert out.shape == (2, 8, 64)


# --- per-member inputs, kwargs, pytrees ------------------------------------------------


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor, y: Tensor, *, scale: Tensor | float = 1.0) -> Tensor:
        return (self.a(x) + self.b(y)) * scale


class DictInDictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, inputs: dict) -> dict:
        h = self.a(inputs["x"]) + self.b(inputs["pair"][1])
        return {"h": h, "stats": (h.mean(), h.std()), "raw": [inputs["pair"][0] * 2]}


def _members(cls: type, n: int) -> list[nn.Module]:
    torch.manual_seed(n)
    return [cls().double() for _ in range(n)]


@pytest.mark.parametrize("n", [1, 3])
def test_per_member_inputs_in_dims_zero(n: int) -> None:
    modules = _members(TwoInputs, n)
    fmodel, params, buffers = fe.stack(modules)
    xs = torch.randn(n, 5, 3, dtype=torch.float64)
    ys = torch.randn(n, 5, 4, dtype=torch.float64)
    out = fe.vmap(fmodel, in_dims=0)(params, buffers, xs, ys)
    expected = torch.stack([m(x, y) for m, x, y in zip(modules, xs, ys, strict=True)])
    assert_trees_close(out, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n", [1, 3])
def test_per_arg_in_dims_tuple_and_shared_kwargs(n: int) -> None:
    modules = _members(TwoInputs, n)
    fmodel, params, buffers = fe.stack(modules)
    x = torch.randn(5, 3, dtype=torch.float64)  # shared
    ys = torch.randn(5, n, 4, dtype=torch.float64)  # per member along dim 1
    scale = torch.tensor(0.5, dtype=torch.float64)
    out = fe.vmap(fmodel, in_dims=(None, 1))(params, buffers, x, ys, scale=scale)
    expected = torch.stack([m(x, ys[:, i], scale=scale) for i, m in enumerate(modules)])
    assert_trees_close(out, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n", [1, 3])
def test_pytree_inputs_with_nested_in_dims_and_pytree_outputs(n: int) -> None:
    modules = _members(DictInDictOut, n)
    fmodel, params, buffers = fe.stack(modules)
    x = torch.randn(n, 5, 3, dtype=torch.float64)
    raw = torch.randn(7, dtype=torch.float64)
    y = torch.randn(5, 4, dtype=torch.float64)
    inputs = {"x": x, "pair": (raw, y)}
    out = fe.vmap(fmodel, in_dims=({"x": 0, "pair": (None, None)},))(params, buffers, inputs)
    expected = loop_outputs_per_member(modules, x, raw, y)
    assert_trees_close(out, expected, rtol=RTOL, atol=ATOL)
    assert isinstance(out["stats"], tuple) and isinstance(out["raw"], list)


def loop_outputs_per_member(modules: list, x: Tensor, raw: Tensor, y: Tensor) -> dict:
    outs = [m({"x": x[i], "pair": (raw, y)}) for i, m in enumerate(modules)]
    return {
        "h": torch.stack([o["h"] for o in outs]),
        "stats": tuple(torch.stack([o["stats"][j] for o in outs]) for j in range(2)),
        "raw": [torch.stack([o["raw"][0] for o in outs])],
    }


# --- chunking --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 9])
def test_chunk_size_matches_unchunked_including_batchnorm_updates(chunk_size: int) -> None:
    zoo = ZOO["cnn"]
    modules = zoo.members(5, train=True)
    reference = clone_modules(modules)
    fmodel, params, buffers = fe.stack(modules)
    _, params_whole, buffers_whole = fe.stack(clone_modules(modules))
    x = zoo.input()
    for _ in range(2):
        chunked = fe.vmap(fmodel, chunk_size=chunk_size)(params, buffers, x)
        whole = fe.vmap(fmodel)(params_whole, buffers_whole, x)
        expected = loop_outputs(reference, x)
        assert_trees_close(chunked, whole, rtol=RTOL, atol=ATOL)
        assert_trees_close(chunked, expected, rtol=RTOL, atol=ATOL)
    assert_trees_close(buffers, buffers_whole, rtol=RTOL, atol=ATOL)
    assert_trees_close(buffers, stacked_state(reference)[1], rtol=RTOL, atol=ATOL)
    assert int(buffers["1.num_batches_tracked"][0]) == 2


def test_chunk_size_with_per_member_inputs_and_grad() -> None:
    modules = _members(TwoInputs, 5)
    fmodel, params, buffers = fe.stack(modules)
    xs = torch.randn(5, 6, 3, dtype=torch.float64)
    ys = torch.randn(5, 6, 4, dtype=torch.float64)

    def loss(p: dict, b: dict, x: Tensor, y: Tensor) -> Tensor:
        return fmodel(p, b, x, y).pow(2).sum()

    chunked = fe.vmap(torch.func.grad(loss), in_dims=0, chunk_size=2)(params, buffers, xs, ys)
    whole = fe.vmap(torch.func.grad(loss), in_dims=0)(params, buffers, xs, ys)
    assert_trees_close(chunked, whole, rtol=RTOL, atol=ATOL)


# --- nested transforms -----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
def test_func_grad_of_function_calling_vmap(n: int) -> None:
    zoo = ZOO["mlp"]
    modules = zoo.members(n, train=True)
    fmodel, params, buffers = fe.stack(modules)
    x = zoo.input()
    weights = torch.arange(1, n + 1, dtype=torch.float64)

    def total_loss(p: dict) -> Tensor:
        out = fe.vmap(fmodel)(p, buffers, x)  # [n, batch, out]
        return (out.pow(2).mean(dim=(1, 2)) * weights).sum()

    grads = torch.func.grad(total_loss)(params)
    expected = []
    for w, module in zip(weights, modules, strict=True):
        named = dict(module.named_parameters())
        g = torch.autograd.grad(module(x).pow(2).mean() * w, list(named.values()))
        expected.append(dict(zip(named, g, strict=True)))
    expected_grads = {k: torch.stack([e[k] for e in expected]) for k in params}
    assert_trees_close(grads, expected_grads, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n", [1, 3])
def test_jacrev_of_vmap_wrt_input_and_params(n: int) -> None:
    zoo = ZOO["scalar_param"]
    modules = zoo.members(n, train=False)
    fmodel, params, buffers = fe.stack(modules)
    x = zoo.input()[:3]

    jac_x = torch.func.jacrev(lambda x: fe.vmap(fmodel)(params, buffers, x))(x)
    expected_x = torch.stack(
        [torch.autograd.functional.jacobian(m, x) for m in modules]
    )  # [n, batch, out, batch, in]
    assert_trees_close(jac_x, expected_x, rtol=RTOL, atol=ATOL)

    jac_p = torch.func.jacrev(lambda p: fe.vmap(fmodel)(p, buffers, x))(params)
    for k, j in jac_p.items():
        assert j.shape == (n, 3, 3, *params[k].shape)
        for i, module in enumerate(modules):
            base = {name: t.detach() for name, t in module.named_parameters()}

            def one(t: Tensor, module: nn.Module = module, k: str = k, base: dict = base):
                return torch.func.functional_call(module, {**base, k: t}, (x,))

            expected = torch.autograd.functional.jacobian(one, base[k])
            # Member i's outputs depend only on member i's slice of the stacked tensor.
            assert_trees_close(j[i][:, :, i], expected, rtol=RTOL, atol=ATOL)
            others = [m for m in range(n) if m != i]
            assert torch.all(j[i][:, :, others] == 0)


class _Residual(nn.Module):
    """Not a plain MLP (BatchNorm, a custom forward): the general vmap path."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 10), nn.BatchNorm1d(10), nn.Linear(10, 2))
        self.head = nn.Linear(3, 1)  # fed the body's 2 features: a broken architecture

    def forward(self, x: Tensor, *, use_head: bool = False) -> Tensor:
        out = self.body(x)
        return self.head(out) if use_head else out


@pytest.mark.parametrize("in_dims", [None, 0])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_wrong_input_width_on_the_general_path_names_the_layer(in_dims, chunk_size) -> None:
    members = [_Residual().double() for _ in range(3)]
    fmodel, params, buffers = fe.stack(members)
    before = {k: v.clone() for k, v in buffers.items()}
    x = torch.randn(*((3,) if in_dims == 0 else ()), 20, 3, dtype=torch.float64)
    expected = (
        r": layer `body.0` \(Linear, weight `body.0.weight` of shape \(10, 4\) per "
        r"member\) expects 4 input features \(expected an input of shape \(\.\.\., 4\), "
        r"got \(\.\.\., 3\)\)\. Pass inputs whose last dim is 4\."
    )
    with pytest.raises(ValueError, match="vmap" + expected):
        fe.vmap(fmodel, in_dims, chunk_size=chunk_size)(params, buffers, x)
    with pytest.raises(ValueError, match="Ensemble" + expected):
        fe.Ensemble(members, chunk_size=chunk_size)(x, in_dims=in_dims)
    assert_trees_equal(buffers, before)  # the BatchNorm statistics did not move
    good = torch.randn(*((3,) if in_dims == 0 else ()), 20, 4, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"layer `head` .* expects 3 input features, but is given 2"
    ):
        fe.vmap(fmodel, in_dims)(params, buffers, good, use_head=True)


def test_other_failures_keep_their_own_error() -> None:
    """The layer search only rewords a wrong Linear width."""
    fmodel, params, buffers = fe.stack([_Residual() for _ in range(2)])
    with pytest.raises(RuntimeError, match="expected scalar type Double but found Float"):
        fe.vmap(fmodel)(params, buffers, torch.randn(8, 4, dtype=torch.float64))


def test_a_buffer_of_another_member_shape_is_refused_before_it_runs() -> None:
    """Refused by name before the member runs (torch's own message was BatchNorm's)."""
    fmodel, params, buffers = fe.stack([_Residual() for _ in range(2)])
    with pytest.raises(
        ValueError,
        match=r"vmap: buffers\['body.1.running_mean'\] has one member's shape \(5,\), but "
        r"the members were built with \(10,\)",
    ):
        fe.vmap(fmodel)(
            params, {**buffers, "body.1.running_mean": torch.zeros(2, 5)}, torch.randn(8, 4)
        )


@pytest.mark.parametrize("argument", ["params", "buffers"])
def test_params_or_buffers_not_a_dict_is_a_type_error(argument) -> None:
    fmodel, params, buffers = fe.stack([nn.Linear(3, 2) for _ in range(2)])
    state = {"params": params, "buffers": buffers}
    state[argument] = list(state[argument].values())
    with pytest.raises(TypeError, match=rf"vmap: {argument} must be a dict .* got list"):
        fe.vmap(fmodel)(state["params"], state["buffers"], torch.randn(5, 3))
    with pytest.raises(
        TypeError, match=r"vmap: params\['weight'\] is a list, not a tensor \(expected a tensor"
    ):
        fe.vmap(fmodel)({**params, "weight": [1.0]}, buffers, torch.randn(5, 3))


def test_wrong_width_reaching_a_later_linear_names_it() -> None:
    """A Linear fed by another layer, not by the input: the message says so."""
    members = [nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(18, 1)) for _ in range(2)]
    fmodel, params, buffers = fe.stack(members)
    with pytest.raises(
        ValueError, match=r"vmap: layer `2` .* expects 18 input features, but is given 24"
    ):
        fe.vmap(fmodel)(params, buffers, torch.randn(5, 2, 10))
    assert fe.vmap(fmodel)(params, buffers, torch.randn(5, 2, 8)).shape == (2, 5, 1)


def test_dict_in_dims_pair_by_key_not_by_position():
    # torch.func.vmap pairs a dict in_dims with the argument's keys by position; a dict
    # given in another key order must still map the leaf it names (as the loop does).
    a, b = torch.randn(3, 2, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    fmodel, params, buffers = fe.stack([torch.nn.Linear(2, 1).double() for _ in range(3)])

    def f(p, bufs, d):
        return fmodel(p, bufs, d["a"] + d["b"])

    out = fe.vmap(f, in_dims=({"a": 0, "b": None},))(params, buffers, {"b": b, "a": a})
    members = fe.unstack(fmodel, params, buffers)
    expected = torch.stack([m(a[i] + b) for i, m in enumerate(members)])
    torch.testing.assert_close(out, expected.detach())


@pytest.mark.parametrize("ordered", ["in_dims", "argument", "both"])
def test_ordered_dict_in_dims_pair_by_key_not_by_position(ordered: str) -> None:
    # An OrderedDict flattens in insertion order, a dict in sorted key order: an in_dims
    # entry of one kind for an argument of the other used to be paired by position,
    # silently swapping the per-member and the shared input.
    n = 4
    x = torch.randn(n, 5, 3, dtype=torch.float64)  # per member
    shift = torch.randn(5, 3, dtype=torch.float64)  # shared
    members = [_KeyedInputs().double() for _ in range(n)]
    expected = torch.stack([m({"x": x[i], "shift": shift}) for i, m in enumerate(members)])
    dims = {"x": 0, "shift": None}
    arg = {"shift": shift, "x": x}
    if ordered in ("in_dims", "both"):
        dims = OrderedDict(x=0, shift=None)  # x first; a dict flattens shift first
    if ordered in ("argument", "both"):
        arg = OrderedDict(x=x, shift=shift) if ordered == "argument" else OrderedDict(arg)
    # Float64 rounding only (the batched matmul may sum in another order than the
    # loop's on some CPUs: 4e-16 seen on an Intel Xeon); swapped inputs are O(1) off.
    tol = {"rtol": 1e-12, "atol": 1e-14}
    ens = fe.Ensemble(members)
    torch.testing.assert_close(ens(arg, in_dims=(dims,)), expected.detach(), **tol)
    fmodel, params, buffers = fe.stack(members)
    out = fe.vmap(fmodel, in_dims=(dims,))(params, buffers, arg)
    torch.testing.assert_close(out, expected.detach(), **tol)


class _KeyedInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.linear(batch["x"]) + batch["shift"]


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_leaf_arguments_take_the_same_route_as_pytree_arguments(randomness: str) -> None:
    # Arguments that are all leaves (tensors, numbers, strings, None) go to vmap's steps
    # directly; the same call with its arguments in one tuple goes through
    # torch.func.vmap's pytree walk. Outputs, draws and gradients agree bit for bit.
    fmodel, params, buffers = _dropout_members(3)
    x = torch.randn(8, 4, dtype=torch.float64)
    ys = torch.randn(8, 3, 64, dtype=torch.float64)  # per member along dim 1
    weight = torch.tensor(0.5, dtype=torch.float64)

    def flat(p, b, x, y, scale, name, nothing, weight):
        assert (name, nothing) == ("loss", None)
        out = fmodel(p, b, x) * scale
        return (out - y).pow(2).mean() * weight, out

    def packed(p, b, args, weight):
        return flat(p, b, *args, weight=weight)

    def run(how: str) -> tuple:
        torch.manual_seed(5)
        if how == "flat":
            f = fe.vmap(flat, in_dims=(None, -2, None, None, None), randomness=randomness)
            return f(params, buffers, x, ys, 2.0, "loss", None, weight=weight)
        f = fe.vmap(packed, in_dims=((None, 1, None, None, None),), randomness=randomness)
        return f(params, buffers, (x, ys, 2.0, "loss", None), weight=weight)

    assert_trees_equal(run("flat"), run("packed"))

    def grads(how: str) -> dict:
        torch.manual_seed(5)
        value_and_grad = fe.value_and_grad(
            flat if how == "flat" else packed,
            in_dims=(None, 1, None, None, None)
            if how == "flat"
            else ((None, 1, None, None, None),),
            has_aux=True,
            randomness=randomness,
        )
        args = (x, ys, 2.0, "loss", None) if how == "flat" else ((x, ys, 2.0, "loss", None),)
        return value_and_grad(params, buffers, *args, weight=weight)

    assert_trees_equal(grads("flat"), grads("packed"))


class _Counted(nn.Module):
    """Off the fast path (a LayerNorm), counting its calls if ``counting``."""

    def __init__(self, counting: bool) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 1)
        self.counting, self.calls = counting, 0
        # Read only; a chunked call puts it back (cleared, then filled) between chunks.
        self.settings = {"scale": 2.0, **{f"unused{i}": i for i in range(50)}}

    def forward(self, x: Tensor) -> Tensor:
        self.calls += self.counting
        return self.b(torch.tanh(self.norm(self.a(x)))) * self.settings.get("scale", 1.0)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_calls_from_several_threads_compute_each_call_from_its_own_tensors(chunk_size):
    """The docstring says calls from several threads at once are safe. Off the fast path
    every call swapped its tensors into the one skeleton (functional_call), so threads
    ran with each other's parameters: some outputs silently wrong (0.39 off at a scale
    of 2.4), gradients None, or raw errors. An Ensemble read its stacked tensors while
    another thread's call had swapped its own into the module (raw errors), and chunked
    calls put a dict attribute back between chunks while another thread's call read it
    (494 of 800 outputs wrong, the dict left empty). (Chunked calls whose forward
    changes the module's attributes are the documented exception: no counter there.)"""
    import sys
    import threading

    torch.manual_seed(0)
    members = [_Counted(chunk_size is None) for _ in range(4)]
    fmodel, params, buffers = fe.stack(members)
    ens = fe.Ensemble(members, chunk_size=chunk_size)
    scaled = [{k: v.detach() * (1 + 0.5 * j) for k, v in params.items()} for j in range(4)]
    x = torch.randn(64, 6)
    forward = fe.vmap(fmodel, chunk_size=chunk_size)
    grads = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).pow(2).mean(), chunk_size=chunk_size)
    want = [(forward(p, buffers, x), grads(p, buffers, x)[1]) for p in scaled]
    want_ens = ens(x)
    wrong: list[str] = []

    def work(j: int) -> None:
        for _ in range(25):
            try:
                out, (_, got, _) = forward(scaled[j], buffers, x), grads(scaled[j], buffers, x)
                if not torch.equal(out, want[j][0]) or any(
                    got[k] is None or not torch.equal(got[k], want[j][1][k]) for k in got
                ):
                    wrong.append(f"thread {j}: another result")
                if not torch.equal(ens(x), want_ens):
                    wrong.append(f"thread {j}: another Ensemble output")
            except Exception as error:  # any error is a failure here
                wrong.append(f"thread {j}: {type(error).__name__}: {error}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # hand the GIL over often: a race shows at once
    try:
        threads = [threading.Thread(target=work, args=(j,)) for j in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, wrong[:3]
    # Each call counted once, as each member of the loop counts its calls.
    assert fmodel.skeleton.calls == (4 * 2 + 4 * 25 * 2 if chunk_size is None else 0)
    assert fmodel.skeleton.settings == members[0].settings


class _Handshake(nn.Module):
    """Off the fast path; mid-forward, lets a reader thread go and waits a little."""

    inside: Any = None  # (a class attribute: member(i) copies the module's own)

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm = nn.Linear(3, 5), nn.LayerNorm(5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.a(x))
        if self.inside is not None:
            self.inside.set()
            time.sleep(0.3)  # the reader runs now, unless it waits for this call
        return h


@pytest.mark.parametrize(
    "read",
    ["parameters", "state_dict", "len", "member", "EnsembleOptimizer", "torch.optim"],
)
def test_reading_an_ensemble_while_another_thread_calls_it_sees_its_own_tensors(read):
    """A call swaps its own (batched) tensors into the ensemble's module for its
    length: a reader in another thread saw them (an optimizer built then held them and
    never trained the ensemble; len() gave a layer's width). The readers wait."""

    torch.manual_seed(0)
    ens = fe.Ensemble([_Handshake() for _ in range(3)])
    readers = {
        "parameters": lambda: [tuple(p.shape) for p in ens.parameters()],
        "state_dict": lambda: [tuple(t.shape) for t in ens.state_dict().values()],
        "len": lambda: [(len(ens),)],
        "member": lambda: [tuple(p.shape) for p in ens.member(1).parameters()],
        "EnsembleOptimizer": lambda: [
            tuple(p.shape)
            for p in fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(0.1)).params.values()
        ],
        "torch.optim": lambda: [
            tuple(p.shape) for p in torch.optim.SGD(ens.parameters(), 0.1).param_groups[0]["params"]
        ],
    }
    want = readers[read]()
    assert _read_during_call(ens, readers[read]) == want


def _read_during_call(model: nn.Module, read: Any) -> Any:
    """What ``read()`` returns in another thread while ``model`` (of ``_Handshake``
    members) runs a call, started in the middle of its forward."""
    import threading

    _Handshake.inside = inside = threading.Event()
    seen: list[Any] = []

    def reader() -> None:
        inside.wait(30)
        seen.append(read())

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        with torch.no_grad():
            model(torch.randn(4, 3))
    finally:
        _Handshake.inside = None
    thread.join(30)
    assert inside.is_set() and len(seen) == 1
    return seen[0]


def test_a_loss_waiting_on_a_thread_that_calls_another_ensemble_does_not_deadlock():
    """A chunked loss getting a teacher's prediction from a worker thread: while the
    lock was one for all ensembles and held across a chunked call's chunks, the worker
    waited for it and the loss for the worker."""
    import concurrent.futures

    torch.manual_seed(0)
    fmodel, params, buffers = fe.stack([_Counted(False) for _ in range(4)])
    teacher = fe.Ensemble([_Counted(False) for _ in range(2)])
    x = torch.randn(5, 6)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:

        def loss(p, b, x):
            taught = pool.submit(lambda: teacher(x).mean().detach()).result(timeout=30)
            return fmodel(p, b, x).pow(2).mean() + taught

        whole = fe.value_and_grad(loss)(params, buffers, x)[0]
        chunked = fe.value_and_grad(loss, chunk_size=2)(params, buffers, x)[0]
    torch.testing.assert_close(chunked, whole)


def test_stacked_tensors_with_no_members():
    """fe.vmap and fe.value_and_grad refuse them (test_bad_inputs); unstack gives no
    modules, and torch.func.vmap over an MLP's fmodel what it gives for any module
    (the MLP fast path divided by zero)."""
    fmodel, params, buffers = fe.stack(
        [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(3)]
    )
    empty = {k: v[:0] for k, v in params.items()}
    assert fe.unstack(fmodel, empty, buffers) == []
    out = torch.func.vmap(fmodel, in_dims=(0, 0, None))(empty, buffers, torch.randn(5, 3))
    assert out.shape == (0, 5, 2)
