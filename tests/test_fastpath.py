"""The direct baddbmm path for plain MLPs equals the vmap path and the loop."""

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import funcensemble as fe
from funcensemble._kernels import fastpath as _fastpath

TOL = {"rtol": 1e-12, "atol": 1e-12}

ACTIVATIONS = [
    nn.Tanh(),
    nn.ReLU(),
    nn.Sigmoid(),
    nn.SiLU(),
    nn.Mish(),
    nn.GELU(approximate="tanh"),
    nn.GELU(),
    nn.LeakyReLU(0.2),
    nn.ELU(0.5),
    nn.Softplus(2.0, 10.0),
    nn.Identity(),
]


def mlp(act: nn.Module, bias: bool = True) -> nn.Module:
    return nn.Sequential(
        nn.Linear(5, 7, bias=bias),
        act,
        nn.Sequential(nn.Linear(7, 6), nn.Dropout(0.0)),
        act,
        nn.Linear(6, 3, bias=bias),
    ).double()


@pytest.fixture
def spy(monkeypatch):
    """Counts calls that the fast path answered."""
    calls = []
    original = _fastpath.run

    def counting(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_fastpath, "run", counting)
    return calls


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("per_member", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_fast_path_matches_loop_outputs_and_grads(act, bias, per_member, n, spy):
    torch.manual_seed(0)
    modules = [mlp(act, bias) for _ in range(n)]
    ens = fe.Ensemble(modules)
    x = torch.randn(*((n,) if per_member else ()), 2, 4, 5, dtype=torch.float64)
    out = ens(x, in_dims=0 if per_member else None)
    assert spy == [True]
    ref = torch.stack([m(x[i] if per_member else x) for i, m in enumerate(modules)])
    torch.testing.assert_close(out, ref, **TOL)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    for name, p in ens.stacked_params().items():
        expected = torch.stack([dict(m.named_parameters())[name].grad for m in modules])
        torch.testing.assert_close(p.grad, expected, **TOL)


def test_fast_path_equals_general_vmap_path(spy, monkeypatch):
    torch.manual_seed(1)
    fmodel, params, buffers = fe.stack([mlp(nn.Tanh()) for _ in range(4)])
    x = torch.randn(16, 5, dtype=torch.float64)
    xs = torch.randn(16, 4, 5, dtype=torch.float64)  # member axis in dim 1
    fast = fe.vmap(fmodel)(params, buffers, x)
    fast_chunked = fe.vmap(fmodel, chunk_size=3)(params, buffers, x)
    fast_dim1 = fe.vmap(fmodel, in_dims=1)(params, buffers, xs)
    assert len(spy) == 4 and all(spy)  # direct call, two chunks inside vmap, direct call
    monkeypatch.setattr(_fastpath, "plan", lambda skeleton: None)
    general = fe.vmap(fmodel)(params, buffers, x)
    torch.testing.assert_close(fast, general, **TOL)
    torch.testing.assert_close(fast_chunked, general, **TOL)
    torch.testing.assert_close(fast_dim1, fe.vmap(fmodel, in_dims=1)(params, buffers, xs), **TOL)


class MyLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1


@pytest.mark.parametrize(
    "case",
    [
        "subclass",
        "hook",
        "train_dropout",
        "other_layer",
        "kwargs",
        "two_args",
        "chunked",
        "repeated_linear",
    ],
)
def test_general_path_when_fast_path_does_not_apply(case, spy):
    torch.manual_seed(2)

    def make():
        if case == "subclass":
            return nn.Sequential(MyLinear(5, 3), nn.Tanh())
        if case == "train_dropout":
            return nn.Sequential(nn.Linear(5, 3), nn.Dropout(0.5))
        if case == "other_layer":
            return nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3))
        if case == "repeated_linear":
            shared = nn.Linear(5, 5)
            return nn.Sequential(shared, nn.Tanh(), shared)
        return nn.Sequential(nn.Linear(5, 3), nn.Tanh())

    modules = [make().double().train() for _ in range(3)]
    ens = fe.Ensemble(modules, chunk_size=2 if case == "chunked" else None)
    seen = []
    if case == "hook":
        ens.stacked[0].register_forward_hook(lambda *a: seen.append(1))
    x = torch.randn(4, 5, dtype=torch.float64)
    if case == "kwargs":
        fmodel, params, buffers = fe.stack(modules)
        out = fe.vmap(lambda p, b, x, *, scale: fmodel(p, b, x) * scale)(
            params, buffers, x, scale=2.0
        )
        ref = torch.stack([m(x) * 2.0 for m in modules])
    elif case == "two_args":
        fmodel, params, buffers = fe.stack(modules)
        out = fe.vmap(lambda p, b, x, y: fmodel(p, b, x) + y)(params, buffers, x, x[:, :3])
        ref = torch.stack([m(x) + x[:, :3] for m in modules])
    else:
        out = ens(x)
        ref = None if case == "train_dropout" else torch.stack([m(x) for m in modules])
    if case not in ("chunked", "kwargs", "two_args", "repeated_linear"):
        # (Chunks, and fmodel called inside a vmapped lambda, still run the stacked
        # kernels, through vmap: what must hold there is equality with the loop.)
        assert not any(spy)
    if case == "repeated_linear":
        # The module face reads each layer's own tensors: a Linear used twice is one
        # weight used twice, as in the loop. (fmodel's name-keyed path refuses it:
        # "2.weight" is not a parameter name; see the test below.)
        assert spy == [True]
    if ref is not None:
        torch.testing.assert_close(out, ref, **TOL)
    if case == "hook":
        assert seen == [1]
    if case == "train_dropout":
        # Dropout masks differ across members (vmap randomness="different").
        assert not torch.equal(out[0] == 0, out[1] == 0)


def test_plan_recognises_only_plain_mlps():
    assert _fastpath.plan(nn.Linear(2, 3)) is not None
    assert _fastpath.plan(nn.Sequential(nn.Tanh())) is None  # no Linear at all
    assert _fastpath.plan(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))) is None


IN_PLACE_CHAINS = {
    # (activations between two Linears, whether the loop's backward runs)
    "tanh_then_relu_": ([nn.Tanh(), nn.ReLU(inplace=True)], False),
    "relu__then_relu_": ([nn.ReLU(inplace=True), nn.ReLU(inplace=True)], False),
    "sigmoid_then_elu_": ([nn.Sigmoid(), nn.ELU(inplace=True)], False),
    "leaky_relu__negative_slope": ([nn.LeakyReLU(-0.5, inplace=True)], False),
    "elu__negative_alpha": ([nn.ELU(-1.0, inplace=True)], False),
    "relu_": ([nn.ReLU(inplace=True)], True),
    "leaky_relu__zero_slope": ([nn.LeakyReLU(0.0, inplace=True)], True),
    "elu__zero_alpha": ([nn.ELU(0.0, inplace=True)], True),
    "silu_": ([nn.SiLU(inplace=True)], True),
    "mish_": ([nn.Mish(inplace=True)], True),
}


@pytest.mark.parametrize("chain", IN_PLACE_CHAINS)
@pytest.mark.parametrize("face", ["ensemble", "value_and_grad"])
def test_in_place_activations_fail_or_run_as_in_the_loop(chain, face):
    # The fast path computes activations out of place: an in-place one whose backward
    # the loop refuses (it overwrote what the op before it saved, or torch has no
    # in-place backward for its argument) must fail here too, not train.
    acts, loop_runs = IN_PLACE_CHAINS[chain]
    torch.manual_seed(0)
    modules = [
        nn.Sequential(nn.Linear(3, 4), *copy.deepcopy(acts), nn.Linear(4, 2)).double()
        for _ in range(2)
    ]
    x = torch.randn(5, 3, dtype=torch.float64)
    loop = copy.deepcopy(modules)
    if not loop_runs:
        with pytest.raises(RuntimeError, match=r"in-?place"):
            torch.stack([m(x) for m in loop]).sum().backward()
    else:
        torch.stack([m(x) for m in loop]).sum().backward()
        expected = torch.stack([m[0].weight.grad for m in loop])

    if face == "ensemble":
        ens = fe.Ensemble(copy.deepcopy(modules))

        def gradient():
            ens(x).sum().backward()
            return ens.stacked[0].weight.grad

    else:
        fmodel, params, buffers = fe.stack(copy.deepcopy(modules))
        value_and_grad = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())

        def gradient():
            return value_and_grad(params, buffers, x)[1]["0.weight"]

    if not loop_runs:
        with pytest.raises(RuntimeError, match=r"in-?place"):
            gradient()
    else:
        torch.testing.assert_close(gradient(), expected, **TOL)


@pytest.mark.parametrize("per_member", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_fast_path_inside_value_and_grad_matches_general_path(
    per_member, chunk_size, spy, monkeypatch
):
    """fmodel called inside fe.vmap (here: in a loss) also takes the stacked kernels."""
    torch.manual_seed(3)
    n = 3
    fmodel, params, buffers = fe.stack([mlp(nn.Tanh()) for _ in range(n)])
    xs = torch.randn(*((n,) if per_member else ()), 8, 5, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)

    def loss_fn(p, b, x, y):
        return torch.nn.functional.mse_loss(fmodel(p, b, x), y)

    step = fe.value_and_grad(loss_fn, (0 if per_member else None, None), chunk_size=chunk_size)
    losses, grads, _ = step(params, buffers, xs, y)
    assert spy and all(spy)
    monkeypatch.setattr(_fastpath, "plan", lambda skeleton: None)
    ref_losses, ref_grads, _ = step(params, buffers, xs, y)
    torch.testing.assert_close(losses, ref_losses, **TOL)
    for k in params:
        torch.testing.assert_close(grads[k], ref_grads[k], **TOL)


def test_no_batched_fast_path_under_other_transforms(spy):
    torch.manual_seed(4)
    fmodel, params, _ = fe.stack([mlp(nn.Tanh()) for _ in range(2)])
    x = torch.randn(4, 5, dtype=torch.float64)
    one = {k: v[0] for k, v in params.items()}
    # torch.func.grad of one member, then vmap over inputs: params are not batched.
    g = torch.func.vmap(torch.func.grad(lambda p, x: fmodel(p, {}, x).sum()), (None, 0))(one, x)
    assert not any(spy)
    ref = torch.func.vmap(
        torch.func.grad(lambda p, x: torch.func.functional_call(fmodel.skeleton, p, (x,)).sum()),
        (None, 0),
    )(one, x)
    for k in one:
        torch.testing.assert_close(g[k], ref[k], **TOL)


def test_linear_used_twice_gradients_match_loop(spy):
    torch.manual_seed(3)

    def make():
        shared = nn.Linear(5, 5)
        return nn.Sequential(shared, nn.Tanh(), shared).double()

    modules = [make() for _ in range(3)]
    ens = fe.Ensemble(modules)
    x = torch.randn(4, 5, dtype=torch.float64)
    ens(x).pow(2).sum().backward()
    sum(m(x).pow(2).sum() for m in modules).backward()
    assert spy == [True]
    for name, p in ens.stacked.named_parameters():
        ref = torch.stack([dict(m.named_parameters())[name].grad for m in modules])
        torch.testing.assert_close(p.grad, ref, **TOL)
    fmodel, params, buffers = fe.stack(modules)
    out = fe.vmap(fmodel)(params, buffers, x)
    assert spy == [True]  # refused before running: "2.weight" is not a parameter name
    torch.testing.assert_close(out, torch.stack([m(x) for m in modules]), **TOL)


@pytest.mark.parametrize("n", [1, 3])
def test_in_place_activations_keep_double_backward(n):
    # Tanh/ReLU/Sigmoid run in place on the layer's fresh output; second-order
    # gradients (e.g. a gradient penalty) must still equal the loop's.
    torch.manual_seed(4)
    modules = [mlp(nn.Tanh()) for _ in range(n)]
    ens = fe.Ensemble(modules)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(ens(x).sum(), x, create_graph=True)
    gx.pow(2).sum().backward()
    x_ref = x.detach().requires_grad_()
    (gx_ref,) = torch.autograd.grad(sum(m(x_ref).sum() for m in modules), x_ref, create_graph=True)
    gx_ref.pow(2).sum().backward()
    torch.testing.assert_close(gx, gx_ref, **TOL)
    for name, p in ens.stacked_params().items():
        grads = [dict(m.named_parameters())[name].grad for m in modules]
        if grads[0] is None:  # the last bias does not enter d(out)/dx
            assert p.grad is None and name == "4.bias"
            continue
        torch.testing.assert_close(p.grad, torch.stack(grads), **TOL)


# (shape of x, in_dims): an empty shared batch, an empty batch with a lead dim, and
# an empty batch per member.
EMPTY = [((0, 5), None), ((0, 2, 5), None), ((2, 0, 5), None), ((3, 0, 5), 0)]


@pytest.mark.parametrize(("shape", "in_dims"), EMPTY, ids=str)
def test_empty_batch_matches_loop(shape, in_dims, spy):
    """No rows: the loop's empty outputs, and zero gradients (what autograd gives)."""
    torch.manual_seed(0)
    modules = [mlp(nn.Tanh()) for _ in range(3)]
    x = torch.randn(*shape, dtype=torch.float64)
    ref = torch.stack([m(x if in_dims is None else x[i]) for i, m in enumerate(modules)])
    ref.sum().backward()
    ens = fe.Ensemble(modules)
    out = ens(x, in_dims=in_dims)
    assert out.shape == ref.shape
    out.sum().backward()
    fmodel, params, buffers = fe.stack(modules)
    mapped = fe.vmap(fmodel, in_dims)(params, buffers, x)
    losses, grads, _ = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum(), in_dims)(
        params, buffers, x
    )
    assert spy == [True, True, True]
    assert mapped.shape == ref.shape
    assert torch.equal(losses, torch.zeros(3, dtype=torch.float64))
    for name, p in ens.stacked_params().items():
        expected = torch.stack([dict(m.named_parameters())[name].grad for m in modules])
        assert torch.equal(expected, torch.zeros_like(expected))
        assert torch.equal(p.grad, expected) and torch.equal(grads[name], expected)


@pytest.mark.parametrize("in_dims", [None, 0])
def test_wrong_input_width_names_the_input_and_the_layer(in_dims, spy):
    """Not the internal GEMM's shapes: which layer, expected and got width."""
    fmodel, params, buffers = fe.stack([mlp(nn.Tanh()) for _ in range(3)])
    ens = fe.Ensemble([mlp(nn.Tanh()) for _ in range(3)])
    x = torch.randn(*((3,) if in_dims == 0 else ()), 20, 4, dtype=torch.float64)
    expected = (
        r"layer `0` \(Linear, weight `0.weight` of shape \(7, 5\) per member\) expects 5 "
        r"input features \(expected an input of shape \(\.\.\., 5\), got \(\.\.\., 4\)\)"
    )
    with pytest.raises(ValueError, match="vmap: " + expected):
        fe.vmap(fmodel, in_dims)(params, buffers, x)
    with pytest.raises(ValueError, match="Ensemble: " + expected):
        ens(x, in_dims=in_dims)
    with pytest.raises(ValueError, match="value_and_grad: " + expected):  # the batched call
        fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum(), in_dims)(params, buffers, x)
    assert spy == []  # refused before the chain ran


def test_wrong_width_inside_the_architecture_is_named():
    """A member whose own Linear widths do not chain (its module alone fails too)."""
    torch.manual_seed(0)
    bad = [nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(6, 3)) for _ in range(2)]
    with pytest.raises(RuntimeError):
        bad[0](torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"layer `2` .* expects 6 input features, but is given 7"):
        fe.Ensemble(bad)(torch.randn(4, 5))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("lead", [(16,), (2, 8), (0,)], ids=str)
def test_shared_input_gradients_match_loop(dtype, lead, spy):
    # With autograd on, a shared input runs its first layer on a row-major copy of
    # x (the fast orientation for dW and dx): the input's own gradient (as an actor's
    # action gets it through a critic) and the weights' must equal the loop's, and x
    # itself must be left as it was.
    torch.manual_seed(5)
    modules = [
        nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 1)).to(dtype) for _ in range(3)
    ]
    ens = fe.Ensemble(modules)
    x = torch.randn(*lead, 4, dtype=dtype, requires_grad=True)
    before = x.detach().clone()
    out = ens(x)
    weights = torch.randn(out.shape, dtype=dtype)
    (out * weights).sum().backward()
    x_ref = x.detach().requires_grad_()
    ref = torch.stack([m(x_ref) for m in modules])
    (ref * weights).sum().backward()
    tol = TOL if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    for name, p in ens.stacked_params().items():
        expected = torch.stack([dict(m.named_parameters())[name].grad for m in modules])
        torch.testing.assert_close(p.grad, expected, **tol)
    assert torch.equal(x.detach(), before)
    with torch.no_grad():  # inference runs on the transposed view: the loop's values
        torch.testing.assert_close(ens(x), ref.detach(), **tol)
    assert spy == [True, True]


def _scaled_forward(self, x):
    return nn.functional.linear(x, self.weight, self.bias) * 2.0


@pytest.mark.parametrize("rows", [6, 600])  # plain ops, and the kept-buffer layers
def test_a_forward_set_on_the_instance_is_honoured(rows):
    """``layer.forward = ...`` (accelerate's hooks, ad-hoc patches) replaces the class's
    forward for the loop, so the MLP fast path, which knows only the class's, steps aside."""
    import types

    torch.manual_seed(0)
    members = []
    for _ in range(4):
        m = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3)).double()
        m[0].forward = types.MethodType(_scaled_forward, m[0])
        members.append(m)
    assert _fastpath.plan(members[0]) is None
    x = torch.randn(rows, 16, dtype=torch.float64)
    y = torch.randn(rows, 3, dtype=torch.float64)
    want = torch.stack([m(x) for m in members])
    ens = fe.Ensemble(members)
    torch.testing.assert_close(ens(x), want, rtol=1e-12, atol=1e-12)
    fmodel, params, buffers = fe.stack(members)
    torch.testing.assert_close(fe.vmap(fmodel)(params, buffers, x), want, rtol=1e-12, atol=1e-12)
    losses, grads, _ = fe.value_and_grad(
        lambda p, b, x, y: nn.functional.mse_loss(fmodel(p, b, x), y)
    )(params, buffers, x, y)
    for i, m in enumerate(members):
        m.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        torch.testing.assert_close(losses[i], loss.detach(), rtol=1e-12, atol=1e-12)
        for k, p in m.named_parameters():
            torch.testing.assert_close(grads[k][i], p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rows", [6, 600])  # plain ops, and where kept buffers would run
def test_autocast_runs_the_mlp_as_the_loop_does(rows, spy):
    """Under ``torch.autocast`` the MLP's layers run in the autocast dtype, bit for bit
    the loop's, whatever the size (the out= kept buffers would not be cast), on the
    fast path: funcensemble's own autocast mode is not a user's mode (value_and_grad
    took the general path under it)."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3)) for _ in range(4)]
    x = torch.randn(rows, 16)
    fmodel, params, buffers = fe.stack(members)
    ens = fe.Ensemble(members)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.stack([m(x) for m in members])
        for out in (ens(x), fe.vmap(fmodel)(params, buffers, x)):
            assert out.dtype == want.dtype == torch.bfloat16
            torch.testing.assert_close(out, want, rtol=0, atol=0)
        fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).float().pow(2).mean())(params, buffers, x)
    assert spy == [True, True, True]


def test_autocast_outside_the_mlp_chain_computes_in_the_autocast_dtype():
    """Beyond the MLP chain, a Linear with a bias under vmap would run in float32 (torch's
    batching rule runs below autocast): its operands are cast as autocast casts the loop's,
    so results have the loop's dtype and agree to its rounding."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)) for _ in range(3)]
    x = torch.randn(5, 6)
    fmodel, params, buffers = fe.stack(members)
    ens = fe.Ensemble(members)
    tol = {"rtol": 2e-2, "atol": 2e-2}  # two bfloat16 roundings
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.stack([m(x) for m in members])
        for out in (ens(x), fe.vmap(fmodel)(params, buffers, x)):
            assert out.dtype == want.dtype == torch.bfloat16
            torch.testing.assert_close(out.float(), want.float(), **tol)
        _, grads, _ = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).float().pow(2).mean())(
            params, buffers, x
        )
        for i, m in enumerate(members):
            m.zero_grad()
            m(x).float().pow(2).mean().backward()
            for k, p in m.named_parameters():
                assert grads[k].dtype == p.grad.dtype == torch.float32
                torch.testing.assert_close(grads[k][i], p.grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_an_input_of_another_dtype_names_the_input_and_the_layer(dtype):
    members = [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(2)]
    x = torch.ones(5, 3, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    message = rf"the input's dtype is {name}, but layer `0` \(Linear\) has float32 weights"
    with pytest.raises(RuntimeError, match="Ensemble: " + message):
        fe.Ensemble(members)(x)
    fmodel, params, buffers = fe.stack(members)
    with pytest.raises(RuntimeError, match="vmap: " + message):
        fe.vmap(fmodel)(params, buffers, x)
    with pytest.raises(RuntimeError, match="value_and_grad: " + message):
        fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())(params, buffers, x)
    with pytest.raises(RuntimeError, match="dtype"):  # the loop refuses it too
        members[0](x)


@pytest.mark.parametrize("fan_in", [16, 300])
@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
def test_autocast_gradients_of_the_mlp_against_the_loop(per_member, fan_in):
    """Shared input: outputs bit for bit the loop's, with grad and without, and
    gradients too at 16 inputs (at 300, a few of the first layer's weight gradients
    round otherwise: the matmul sums over the 600 rows in another order). Per-member
    inputs: outputs bit for bit, weight gradients to one rounding of bfloat16 (one
    batched matmul for all members' weight gradients)."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(fan_in, 64), nn.Tanh(), nn.Linear(64, 3)) for _ in range(4)]
    loop = copy.deepcopy(members)
    x = torch.randn(*((4,) if per_member else ()), 600, fan_in)
    ens = fe.Ensemble(members)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ens(x, in_dims=0 if per_member else None)
        with torch.no_grad():
            inferred = ens(x, in_dims=0 if per_member else None)
        want = torch.stack([m(x[i] if per_member else x) for i, m in enumerate(loop)])
    # Found by an audit: at 300 inputs the shared input, made row-major for the
    # backward's speed, gave the first layer's bfloat16 matmul another summation
    # order: 13 outputs of 153,600 off by a rounding, and other than without grad.
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(inferred, want, rtol=0, atol=0)
    out.float().square().mean((1, 2)).sum().backward()
    want.float().square().mean((1, 2)).sum().backward()
    for name, p in ens.stacked_params().items():
        got = p.grad
        expected = torch.stack([m.get_parameter(name).grad for m in loop])
        exact = {"rtol": 0, "atol": 0}
        one_rounding = {"rtol": 2**-7, "atol": 2**-7 * expected.abs().max().item()}
        exactly = not per_member and (fan_in == 16 or name != "0.weight")
        torch.testing.assert_close(got, expected, **(exact if exactly else one_rounding))


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64])
@pytest.mark.parametrize("act", [nn.Identity, nn.Tanh])
def test_complex_members_get_the_loops_gradients(dtype, act):
    """The fast path's backward transposed without conjugating: complex members' weight
    gradients were up to 10x their size off the loop (outputs right) once the layers
    were large enough for the kept-buffer kernels. Complex members take the general
    path, whose gradients are autograd's."""
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(8, 64), act(), nn.Linear(64, 64), act(), nn.Linear(64, 2)).to(dtype)
        for _ in range(3)
    ]
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(copy.deepcopy(members))
    x = torch.randn(600, 8, dtype=dtype)
    torch.stack([m(x) for m in loop]).abs().square().sum().backward()
    ens(x).abs().square().sum().backward()
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))
    _, grads, _ = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).abs().square().sum())(
        params, buffers, x
    )
    tol = 1e-12 if dtype == torch.complex128 else 2e-6
    for name, p in ens.stacked.named_parameters():
        want = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
        scale = want.abs().max()
        assert (p.grad - want).abs().max() <= tol * scale, name
        assert (grads[name] - want).abs().max() <= tol * scale, name


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_linear_without_input_features_runs_as_the_loop():
    """Linear(0, k) returns its bias in the loop; the fast path's reshape of the
    zero-width input raised torch's 'cannot reshape tensor of 0 elements'."""
    members = [nn.Sequential(nn.Linear(0, 5), nn.ReLU(), nn.Linear(5, 3)) for _ in range(3)]
    x = torch.randn(7, 0)
    want = torch.stack([m(x) for m in members])
    fmodel, params, buffers = fe.stack(members)
    assert torch.equal(fe.Ensemble(members)(x), want)
    assert torch.equal(fe.vmap(fmodel)(params, buffers, x), want)


class _LinearPlusOne(torch.overrides.TorchFunctionMode):
    """A user's function mode changing what an op computes (as fake quantization does)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + 1 if func is torch.nn.functional.linear else out


class _TanhTimesTwo(TorchDispatchMode):
    """A user's dispatch mode changing what an aten op computes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.ops.aten.tanh.default else out


@pytest.mark.parametrize("mode", [_LinearPlusOne, _TanhTimesTwo])
@pytest.mark.parametrize("face", ["ensemble", "vmap", "value_and_grad"])
def test_a_users_mode_sees_what_the_members_modules_call(mode, face, spy):
    """The fast path ran addmm/baddbmm/tanh_ on the stacked weights, which a user's
    mode keyed on F.linear or aten.tanh never saw: 2.11 and 0.65 off the loop under
    the mode, no error. A mode defined outside torch sends the call to the general
    path, where it sees each member's own ops; torch's own modes do not."""
    torch.manual_seed(0)
    modules = [mlp(nn.Tanh()) for _ in range(3)]
    x = torch.randn(4, 5, dtype=torch.float64)
    fmodel, params, buffers = fe.stack(copy.deepcopy(modules))
    ens = fe.Ensemble(copy.deepcopy(modules))
    loss = lambda p, b, x: fmodel(p, b, x).pow(2).mean()  # noqa: E731
    with mode():
        want = torch.stack([m(x) for m in modules])
        if face == "ensemble":
            got = ens(x)
        elif face == "vmap":
            got = fe.vmap(fmodel)(params, buffers, x)
        else:
            _, grads, _ = fe.value_and_grad(loss)(params, buffers, x)
            for m in modules:
                m(x).pow(2).mean().backward()
    assert spy and not any(spy)
    if face != "value_and_grad":
        torch.testing.assert_close(got, want, **TOL)
        return
    for name, g in grads.items():
        expected = torch.stack([dict(m.named_parameters())[name].grad for m in modules])
        torch.testing.assert_close(g, expected, **TOL)


def test_torch_own_modes_keep_the_fast_path(spy):
    ens = fe.Ensemble([mlp(nn.Tanh()) for _ in range(2)])
    with torch.device("cpu"):  # a function mode of torch's own
        ens(torch.randn(4, 5, dtype=torch.float64))
    assert spy == [True]


@pytest.mark.parametrize("wraps", [False, True])
def test_a_wrapper_of_module_call_is_honoured(monkeypatch, spy, wraps):
    """A class-wide wrapper of nn.Module.__call__ (a profiler's, a logger's) was
    bypassed by the fast path, which calls no module (0.65 off the loop); one dressed
    with functools.wraps (torch's module name, torch's qualname) too."""
    original = nn.Module.__call__

    def call(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return out * 2 if isinstance(self, nn.Tanh) else out

    if wraps:
        call = functools.wraps(original)(call)

    torch.manual_seed(0)
    modules = [mlp(nn.Tanh()) for _ in range(3)]
    ens = fe.Ensemble(copy.deepcopy(modules))
    x = torch.randn(4, 5, dtype=torch.float64)
    monkeypatch.setattr(nn.Module, "__call__", call)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in modules]), **TOL)
    assert not any(spy)


_PATCHED_BEFORE_IMPORT = """
import copy, torch
from torch import nn
nn.Tanh.forward = lambda self, x: torch.tanh(x) * 2  # before funcensemble is imported
import funcensemble as fe
torch.manual_seed(0)
members = [nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double() for _ in range(3)]
x = torch.randn(5, 4, dtype=torch.float64)
got = fe.Ensemble(copy.deepcopy(members))(x)
torch.testing.assert_close(got, torch.stack([m(x) for m in members]), rtol=1e-12, atol=1e-12)
print("ok")
"""


def test_a_forward_replaced_before_import_is_called():
    """The fast path took the forward each class had when funcensemble was imported for
    torch's own: a patch made before the import was skipped (0.65 off the loop)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _PATCHED_BEFORE_IMPORT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.parametrize(
    "act", [nn.Tanh(), nn.ReLU(), nn.GELU(), nn.Softplus(2.0, 10.0)], ids=lambda m: type(m).__name__
)
# (torch loads its forward-AD decompositions with the deprecated torch.jit.script, which
# warns with a DeprecationWarning up to 2.13 and a FutureWarning from 2.14)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("face", ["ensemble", "vmap"])
def test_forward_mode_tangents_equal_the_loop(act, face):
    """torch.func.jvp over the input and forward-AD duals of the parameters give each
    member's own tangent (the forward-mode rules of the fast path's ops)."""
    torch.manual_seed(0)
    modules = [mlp(act) for _ in range(3)]
    x, t = torch.randn(2, 4, 5, dtype=torch.float64), torch.randn(2, 4, 5, dtype=torch.float64)
    fmodel, params, buffers = fe.stack(copy.deepcopy(modules))
    ens = fe.Ensemble(copy.deepcopy(modules))
    call = ens if face == "ensemble" else (lambda x: fe.vmap(fmodel)(params, buffers, x))
    out, tangent = torch.func.jvp(call, (x,), (t,))
    for i, m in enumerate(modules):
        want, want_tangent = torch.func.jvp(m, (x,), (t,))
        torch.testing.assert_close(out[i], want, **TOL)
        torch.testing.assert_close(tangent[i], want_tangent, **TOL)
    # The parameters' tangents: one direction per parameter, as duals.
    directions = {k: torch.randn_like(v) for k, v in params.items()}
    with torch.autograd.forward_ad.dual_level():
        duals = {
            k: torch.autograd.forward_ad.make_dual(v, directions[k]) for k, v in params.items()
        }
        got = torch.autograd.forward_ad.unpack_dual(fe.vmap(fmodel)(duals, buffers, x)).tangent
    for i, m in enumerate(modules):
        one = {k: v[i] for k, v in params.items()}
        _, want_tangent = torch.func.jvp(
            lambda p, m=m: torch.func.functional_call(m, p, (x,)),
            (one,),
            ({k: d[i] for k, d in directions.items()},),
        )
        torch.testing.assert_close(got[i], want_tangent, **TOL)


@pytest.mark.parametrize(
    ("where", "name", "replacement"),
    [
        (torch.nn.functional, "linear", lambda x, w, b=None: torch.addmm(b, x, w.t()) + 1),
        (torch, "tanh", lambda x: x.clamp(-0.5, 0.5)),
    ],
)
def test_a_replaced_function_the_members_forwards_call_is_called(
    monkeypatch, spy, where, name, replacement
):
    """The loop's Linear.forward looks F.linear up at each call (Tanh.forward,
    torch.tanh): one replaced changed what the loop computes, not what the fast
    path computed (2.10 off)."""
    torch.manual_seed(0)
    modules = [mlp(nn.Tanh()) for _ in range(3)]
    ens = fe.Ensemble(copy.deepcopy(modules))
    x = torch.randn(4, 5, dtype=torch.float64)
    monkeypatch.setattr(where, name, replacement)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in modules]), **TOL)
    assert not any(spy)


def test_torch_own_tracers_keep_the_fast_path(spy):
    """torch.export wraps nn.Module.__call__ with torch's own code while it traces: the
    fast path stays (a check of the wrapper's identity sent it to the general path,
    whose exported graph held vmap's internals)."""
    ens = fe.Ensemble([mlp(nn.Tanh()) for _ in range(2)])
    x = torch.randn(4, 5, dtype=torch.float64)
    program = torch.export.export(ens, (x,), strict=False)  # (strict is Dynamo)
    targets = [str(node.target) for node in program.graph.nodes]
    assert any("mlp_forward" in t for t in targets), targets
    assert not any("add_batch_dim" in t for t in targets), targets
    torch.testing.assert_close(program.module()(x), ens(x), **TOL)


@pytest.mark.parametrize("face", ["ensemble", "vmap", "value_and_grad"])
def test_frozen_parameters_made_under_inference_mode_run_as_the_loop(face):
    """Frozen (requires_grad=False) inference tensors record nothing: a frozen feature
    extractor built under inference_mode runs in another model's training step, as
    the loop's does; only those autograd would record are refused."""
    torch.manual_seed(0)
    with torch.inference_mode():
        modules = [mlp(nn.Tanh()) for _ in range(3)]
        ens = fe.Ensemble(copy.deepcopy(modules))
        fmodel, params, buffers = fe.stack(copy.deepcopy(modules))
    ens.requires_grad_(False)
    params = {
        k: v.requires_grad_(False) if face == "vmap" or k.startswith("0.") else v
        for k, v in params.items()
    }
    x = torch.randn(4, 5, dtype=torch.float64)
    with torch.no_grad():
        want = torch.stack([m(x) for m in modules])
    if face == "ensemble":
        torch.testing.assert_close(ens(x), want, **TOL)
    elif face == "vmap":
        torch.testing.assert_close(fe.vmap(fmodel)(params, buffers, x), want, **TOL)
    else:  # the first layer frozen, the rest trainable: refused, naming a trainable one
        with pytest.raises(RuntimeError, match=r"parameter `2\.0\.weight` is an inference tensor"):
            fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())(params, buffers, x)


def test_a_replaced_function_the_layers_do_not_call_keeps_the_fast_path(monkeypatch, spy):
    """Any of the thirteen functions replaced (F.mish, say) switched the fast path off
    for every MLP, even one without a Mish (8.8 ms a step against 2.4 ms), and for good
    once one had been replaced before funcensemble's import."""
    original = torch.nn.functional.mish
    monkeypatch.setattr(torch.nn.functional, "mish", lambda x, inplace=False: original(x) + 1)
    torch.manual_seed(0)
    modules = [mlp(nn.Tanh()) for _ in range(2)]
    x = torch.randn(4, 5, dtype=torch.float64)
    torch.testing.assert_close(fe.Ensemble(modules)(x), torch.stack([m(x) for m in modules]), **TOL)
    assert spy == [True]
