"""Run by tests/test_compile.py in a fresh interpreter.

The test run wraps every funcensemble function in jaxtyping+beartype checkers, which
Dynamo cannot trace; users compile the plain library, as this script does.
"""

import copy
import sys

import optree
import torch
from torch import nn
from torch.nn import functional as F

import funcensemble as fe


def make_members(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    # No bias before BatchNorm: its gradient is pure round-off, which Adam's
    # normalisation amplifies, so compiled and eager could not be compared there.
    return [
        nn.Sequential(nn.Linear(4, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))
        for _ in range(n)
    ]


def functional_training_step() -> None:
    fmodel, params, buffers = fe.stack(make_members(3))
    opt = fe.optim.adam(lr=1e-2, weight_decay=1e-3)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    def train_step(params, buffers, state, x, y):
        losses, grads, buffers = fe.value_and_grad(loss_fn)(params, buffers, x, y)
        updates, state = opt.update(grads, state, params)
        return fe.optim.apply_updates(params, updates), buffers, state, losses

    compiled = torch.compile(train_step, fullgraph=True)
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    eager = (params, buffers, opt.init(params))
    comp = (
        {k: v.detach().clone() for k, v in params.items()},
        {k: v.clone() for k, v in buffers.items()},
        opt.init(params),
    )
    for _ in range(3):
        *eager, eager_losses = train_step(*eager, x, y)
        *comp, comp_losses = compiled(*comp, x, y)
        torch.testing.assert_close(comp_losses, eager_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(comp[:2], eager[:2], strict=True):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert comp[1]["1.num_batches_tracked"].tolist() == [3, 3, 3]


def in_place_training_step() -> None:
    """compile.md's step (fe.stack's own outputs, update_ inside the graph), with
    per-member hyperparameters (the page itself runs one lr)."""
    modules = make_members(3)
    opt = fe.optim.adamw(lr=torch.tensor([1e-2, 3e-3, 1e-3]), betas=(0.9, 0.999))
    fmodel, params, buffers = fe.stack(copy.deepcopy(modules))
    _, ref_params, ref_buffers = fe.stack(copy.deepcopy(modules))

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    def train_step(params, buffers, state, x, y):
        losses, grads, buffers = fe.value_and_grad(loss_fn)(params, buffers, x, y)
        state = opt.update_(grads, state, params)
        return buffers, state, losses

    compiled = torch.compile(train_step, fullgraph=True)
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    state, ref_state = opt.init(params), opt.init(ref_params)
    for _ in range(3):
        buffers, state, losses = compiled(params, buffers, state, x, y)
        ref_buffers, ref_state, ref_losses = train_step(ref_params, ref_buffers, ref_state, x, y)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for got, want in ((params, ref_params), (buffers, ref_buffers), (state, ref_state)):
        for g, w in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert all(p.requires_grad and p.is_leaf for p in params.values())  # stack's flags kept


def pure_step_refused() -> None:
    """apply_updates under fullgraph compile on parameters that require grad: a clear error."""
    _, params, _ = fe.stack(make_members(3))
    updates = {k: torch.ones_like(v) for k, v in params.items()}
    before = {k: v.detach().clone() for k, v in params.items()}
    try:
        torch.compile(fe.optim.apply_updates, fullgraph=True)(params, updates)
    except Exception as error:  # Dynamo wraps the library's RuntimeError
        message = str(error)
    else:
        raise AssertionError("apply_updates compiled on parameters that require grad ran")
    assert "apply_updates: cannot return new parameters that require grad" in message, message
    assert "opt.update_(grads, state, params)" in message, message
    for k, v in before.items():
        assert torch.equal(params[k], v)


def module_face_training_step() -> None:
    modules = make_members(3)
    ens = fe.Ensemble(copy.deepcopy(modules))
    ref = fe.Ensemble(copy.deepcopy(modules))
    compiled = torch.compile(ens, fullgraph=True)
    opt = torch.optim.Adam(ens.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    for _ in range(3):
        for model, o in ((compiled, opt), (ref, ref_opt)):
            o.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            o.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ens.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def mlp_training_step() -> None:
    """A plain MLP compiles into funcensemble's opaque MLP ops (see _mlp_op)."""
    torch.manual_seed(0)

    def make() -> nn.Module:
        return nn.Sequential(
            nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8, bias=False), nn.ReLU(), nn.Linear(8, 2)
        )

    modules = [make() for _ in range(3)]
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(str(gm.graph))
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    for in_dims in (None, 0):
        ens = fe.Ensemble(copy.deepcopy(modules))
        ref = fe.Ensemble(copy.deepcopy(modules))
        opt = torch.optim.Adam(ens.parameters(), lr=1e-2, foreach=True)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
        x = torch.randn(*((3,) if in_dims == 0 else ()), 32, 4, requires_grad=True)
        y = torch.randn(3, 32, 2)

        def step(model, o, x=x, y=y, in_dims=in_dims):
            o.zero_grad()
            out = model(x, in_dims=in_dims)
            ((out - y).pow(2).mean() + out.pow(2).mean()).backward()
            o.step()
            return out.detach()

        compiled = torch.compile(ens, fullgraph=True, backend=recording)
        for _ in range(3):
            x.grad = None
            got = step(compiled, opt)
            gx = x.grad.clone()
            x.grad = None
            want = step(ref, ref_opt)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(ens.state_dict()[k], v, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            infer = torch.compile(ens, fullgraph=True, backend=recording)
            torch.testing.assert_close(infer(x, in_dims=in_dims), ens(x, in_dims=in_dims))
    assert graphs and all("mlp_forward" in g for g in graphs), graphs


def frozen_gradients() -> None:
    """Frozen parameters get None compiled as eagerly; the others the same gradients."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)) for _ in range(3)]
    for m in members:
        m[0].requires_grad_(False)
    fmodel, params, buffers = fe.stack(members)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    def grads_of(params, buffers, x, y):
        return fe.value_and_grad(loss_fn, (None, 0))(params, buffers, x, y)[1]

    x, y = torch.randn(32, 4), torch.randn(3, 32, 2)
    eager = grads_of(params, buffers, x, y)
    compiled = torch.compile(grads_of, fullgraph=True)(params, buffers, x, y)
    assert eager["0.weight"] is None and eager["0.bias"] is None
    assert compiled.keys() == eager.keys()
    for k, g in eager.items():
        if g is None:
            assert compiled[k] is None, k
        else:
            torch.testing.assert_close(compiled[k], g, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    faces = {
        "frozen": frozen_gradients,
        "functional": functional_training_step,
        "in_place": in_place_training_step,
        "pure_refused": pure_step_refused,
        "module": module_face_training_step,
        "mlp": mlp_training_step,
    }
    faces[sys.argv[1]]()
    print("OK")
