"""The opaque MLP ops used under torch.compile equal the loop (run eagerly here).

tests/compile_check.py (``mlp``) checks that a compiled Ensemble calls them and that
compiled training equals eager training.
"""

import pytest
import torch
from torch import nn

import funcensemble as fe
from funcensemble._kernels import fastpath as _fastpath
from funcensemble._kernels import mlp_op as _mlp_op

TOL = {"rtol": 1e-12, "atol": 1e-12}


def members(acts: tuple[nn.Module, ...], bias: bool, n: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)

    def make() -> nn.Module:
        layers: list[nn.Module] = [nn.Linear(5, 7, bias=bias)]
        for act in acts:
            layers += [act, nn.Linear(7, 7, bias=bias)]
        return nn.Sequential(*layers, nn.Linear(7, 3)).double()

    return [make() for _ in range(n)]


def op_args(fmodel, params, x):
    weights, biases, acts = _mlp_op.layers(_fastpath.plan(fmodel.skeleton))
    return (
        x,
        [params[w] for w in weights],
        [params[b] for b in biases if b is not None],
        [b is not None for b in biases],
        acts,
    )


CASES = [
    ((nn.Tanh(),), True),
    ((nn.ReLU(), nn.Sigmoid()), False),
    ((nn.Identity(), nn.Dropout(0.0)), True),
    ((), True),
]


@pytest.mark.parametrize(("acts", "bias"), CASES)
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("rows", [6, 0])  # 0: an empty batch gives empty outputs, zero grads
def test_op_matches_the_loop_outputs_and_gradients(acts, bias, shared, rows):
    modules = members(acts, bias)
    fmodel, params, _ = fe.stack(modules)
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    x = torch.randn(*(() if shared else (4,)), rows, 5, dtype=torch.float64, requires_grad=True)
    out = _mlp_op.mlp_forward(*op_args(fmodel, params, x))[0]
    ref = torch.stack([m(x if shared else x[i]) for i, m in enumerate(modules)])
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *params.values()], g)
    want_x = torch.autograd.grad(ref, x, g, retain_graph=True)[0]
    torch.testing.assert_close(got[0], want_x, **TOL)
    for (name, _), grad in zip(params.items(), got[1:], strict=True):
        per_member = [dict(m.named_parameters())[name] for m in modules]
        want = torch.autograd.grad(ref, per_member, g, retain_graph=True)
        torch.testing.assert_close(grad, torch.stack(want), **TOL)


@pytest.mark.parametrize(("acts", "bias"), CASES[:2])
def test_op_schema_fake_tensors_and_autograd_registration(acts, bias):
    fmodel, params, _ = fe.stack(members(acts, bias))
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    for x in (torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 6, 5, dtype=torch.float64)):
        torch.library.opcheck(_mlp_op.mlp_forward, op_args(fmodel, params, x))


def test_layers_accepts_only_output_differentiable_activations():
    def chain(*modules):
        return _fastpath.plan(nn.Sequential(*modules))

    assert _mlp_op.layers(chain(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))) == (
        ["0.weight", "2.weight"],
        ["0.bias", "2.bias"],
        [_mlp_op.TANH, _mlp_op.NONE],
    )
    assert _mlp_op.layers(chain(nn.Linear(2, 3), nn.GELU(), nn.Linear(3, 1))) is None
    assert _mlp_op.layers(chain(nn.Linear(2, 3), nn.Tanh(), nn.ReLU())) is None  # two in a row
    assert _mlp_op.layers(chain(nn.Tanh(), nn.Linear(2, 3))) is None  # before any Linear


def test_eager_calls_never_use_the_op(monkeypatch):
    # Eagerly the plain kernels are as fast and keep double backward: the op is only
    # for torch.compile.
    def fail(*args, **kwargs):
        raise AssertionError("the op ran eagerly")

    monkeypatch.setattr(_mlp_op, "mlp_forward", fail)
    ens = fe.Ensemble(members((nn.Tanh(),), True))
    ens(torch.randn(6, 5, dtype=torch.float64)).sum().backward()
