"""The one-member MLP call whose torch.func rules run the stacked MLP ops, run eagerly.

Under torch.compile, ``fmodel`` called per member (in ``fe.value_and_grad``) is
``_mlp_member_op.member_mlp``; tests/compile_check.py (``functional_mlp``) checks that a
compiled step reaches the stacked ops and equals the loop. Here its rules run eagerly
under ``torch.func`` against the loop: outputs and gradients, float64 and float32.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import funcensemble as fe
from funcensemble._kernels import fastpath as _fastpath
from funcensemble._kernels import mlp_member_op as _mlp_member_op
from funcensemble._kernels import mlp_op as _mlp_op

N = 4
TOL = {torch.float64: {"rtol": 1e-12, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}
CASES = [
    ((nn.Tanh(),), True),
    ((nn.ReLU(), nn.Sigmoid()), False),
    ((nn.Identity(), nn.Dropout(0.0)), True),
    ((), True),
]


def members(acts: tuple[nn.Module, ...], bias: bool, dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)

    def make() -> nn.Module:
        layers: list[nn.Module] = [nn.Linear(5, 7, bias=bias)]
        for act in acts:
            layers += [act, nn.Linear(7, 7, bias=bias)]
        return nn.Sequential(*layers, nn.Linear(7, 3)).to(dtype)

    return [make() for _ in range(N)]


def member_fn(fmodel):
    """``fmodel`` for one member, as ``member_mlp`` (what a compiled call runs)."""
    weights, biases, acts = _mlp_op.layers(_fastpath.plan(fmodel.skeleton))

    def call(p, x):
        out = _mlp_member_op.member_mlp(
            x.reshape(-1, x.shape[-1]),
            [p[w] for w in weights],
            [p[b] for b in biases if b is not None],
            [b is not None for b in biases],
            acts,
        )
        return out.view(*x.shape[:-1], out.shape[-1])

    return call


@pytest.mark.parametrize(("acts", "bias"), CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("rows", [6, 0])
def test_vmap_of_grad_matches_the_loop(acts, bias, dtype, shared, rows):
    """vmap(grad_and_value) (fe.value_and_grad's compiled route): losses, parameter
    gradients, and each member's own input gradient, shared or per-member input."""
    modules = members(acts, bias, dtype)
    fmodel, params, _ = fe.stack(modules)
    call = member_fn(fmodel)
    x = torch.randn(*(() if shared else (N,)), rows, 5, dtype=dtype)
    y = torch.randn(N, rows, 3, dtype=dtype)

    def loss(p, x, y):
        return F.mse_loss(call(p, x), y, reduction="sum")

    x_dim = None if shared else 0
    grads, losses = torch.func.vmap(
        torch.func.grad_and_value(loss, argnums=(0, 1)), in_dims=(0, x_dim, 0)
    )(params, x, y)
    for i, m in enumerate(modules):
        xi = (x if shared else x[i]).clone().requires_grad_()
        want = F.mse_loss(m(xi), y[i], reduction="sum")
        want_grads = torch.autograd.grad(want, [xi, *m.parameters()], allow_unused=True)
        torch.testing.assert_close(losses[i], want.detach(), **TOL[dtype])
        torch.testing.assert_close(grads[1][i], want_grads[0], **TOL[dtype])
        for (name, _), g in zip(m.named_parameters(), want_grads[1:], strict=True):
            torch.testing.assert_close(grads[0][name][i], g, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backward_through_vmap_and_one_member_call_match_the_loop(dtype):
    """Plain autograd through vmap(member_mlp) (fe.vmap of a loss, then backward), and
    member_mlp on one member's tensors outside any transform."""
    modules = members((nn.Tanh(),), True, dtype)
    fmodel, params, _ = fe.stack(modules)
    call = member_fn(fmodel)
    x = torch.randn(N, 2, 6, 5, dtype=dtype, requires_grad=True)  # lead dims (2, 6)
    out = torch.func.vmap(call)(params, x)
    want = torch.stack([m(x[i]) for i, m in enumerate(modules)])
    torch.testing.assert_close(out, want, **TOL[dtype])
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *params.values()], g)
    ref = torch.autograd.grad(want, [x, *[p for m in modules for p in m.parameters()]], g)
    torch.testing.assert_close(got[0], ref[0], **TOL[dtype])
    per_member = len(params)
    for k, got_k in enumerate(got[1:]):
        want_k = torch.stack(ref[1 + k :: per_member])
        torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    one = {k: v[1].detach().requires_grad_() for k, v in params.items()}
    xs = x[1].detach()
    out1 = call(one, xs)
    torch.testing.assert_close(out1, modules[1](xs), **TOL[dtype])
    got1 = torch.autograd.grad(out1.sum(), list(one.values()))
    ref1 = torch.autograd.grad(modules[1](xs).sum(), list(modules[1].parameters()))
    for a, b in zip(got1, ref1, strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_second_derivatives_are_refused():
    modules = members((nn.Tanh(),), True, torch.float64)
    fmodel, params, _ = fe.stack(modules)
    call = member_fn(fmodel)
    one = {k: v[0].detach() for k, v in params.items()}
    x = torch.randn(6, 5, dtype=torch.float64)

    def loss(p):
        return call(p, x).pow(2).sum()

    with pytest.raises(RuntimeError, match="second derivatives through a plain MLP"):
        torch.func.grad(lambda p: torch.func.grad(loss)(p)["0.weight"].sum())(one)
