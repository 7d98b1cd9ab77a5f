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


# (torch 2.14's opcheck reads .grad of a non-leaf tensor inside its own AOT check, which
# warns; not our op's doing)
@pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor is being accessed:UserWarning"
)
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


# (torch 2.14's opcheck reads .grad of a non-leaf tensor inside its own AOT check, which
# warns; not our op's doing)
@pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor is being accessed:UserWarning"
)
def test_op_outputs_use_kept_buffers_only_when_nothing_holds_them():
    # Hidden layers of 4 x 64 x 128 doubles (256 KiB): large enough for the kept buffers,
    # which spare the compiled step a page fault per 4 KiB of every fresh output.
    torch.manual_seed(0)
    modules = [
        nn.Sequential(
            nn.Linear(5, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)
        ).double()
        for _ in range(4)
    ]
    fmodel, params, _ = fe.stack(modules)
    params = {k: v.detach().requires_grad_() for k, v in params.items()}

    def step(x):
        outs = _mlp_op.mlp_forward(*op_args(fmodel, params, x))
        grads = torch.autograd.grad(outs[0], list(params.values()), torch.ones_like(outs[0]))
        return outs, grads

    def reference(x):
        ref = torch.stack([m(x) for m in modules])
        per_member = [[dict(m.named_parameters())[k] for m in modules] for k in params]
        found = torch.autograd.grad(ref, [p for ps in per_member for p in ps], torch.ones_like(ref))
        return ref, [torch.stack(found[i * 4 : i * 4 + 4]) for i in range(len(params))]

    x1, x2 = torch.randn(128, 5, dtype=torch.float64), torch.randn(128, 5, dtype=torch.float64)
    outs1, grads1 = step(x1)
    kept = [t.clone() for t in (*outs1, *grads1)]
    outs2, grads2 = step(x2)  # the first call's results are all still held
    for held, copy in zip((*outs1, *grads1), kept, strict=True):
        torch.testing.assert_close(held, copy, rtol=0, atol=0)  # nothing overwritten
    for got, want in ((outs1[0], reference(x1)[0]), (outs2[0], reference(x2)[0])):
        torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(grads2, reference(x2)[1], strict=True):
        torch.testing.assert_close(got, want, **TOL)
    ptrs = {t.data_ptr() for t in (*outs1[1:], *outs2[1:])}
    assert len(ptrs) == 4  # two hidden layers per call, none shared between the calls
    hidden1 = {t.data_ptr() for t in outs1[1:]}
    del outs1, grads1
    outs3, _ = step(x1)
    assert {t.data_ptr() for t in outs3[1:]} == hidden1  # released: the kept buffers return
    torch.testing.assert_close(outs3[0], reference(x1)[0], **TOL)
    torch.library.opcheck(_mlp_op.mlp_forward, op_args(fmodel, params, x2))
