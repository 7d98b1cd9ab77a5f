"""Run by tests/test_compile.py in a fresh interpreter.

The test run wraps funcensemble's public functions in jaxtyping+beartype checkers, which
Dynamo cannot trace; users compile the plain library, as this script does.
"""

import copy
import sys
from collections import OrderedDict
from collections.abc import Callable

import optree
import torch
from torch import nn
from torch.nn import functional as F

import funcensemble as fe

# torch 2.14 changed what a compiled call does where 2.13 stopped (docs/how-to/versions.md):
# Dynamo runs a frame eagerly when the code it traces raises, and carries forward-mode
# tangents through the MLP ops; each check below says which.
TORCH_2_14 = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


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
        # compile.md: compiled, the gradients are outside any autograd graph, as eagerly.
        assert compiled[k] is None or (
            not compiled[k].requires_grad and compiled[k].grad_fn is None
        )
    unused_parameter_gradients()


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def unused_parameter_gradients() -> None:
    """compile.md: a parameter the loss does not use gets None eagerly and a zero
    gradient compiled (torch.func.grad's); the losses come back outside any graph."""
    fmodel, params, buffers = fe.stack([_WithUnused() for _ in range(3)])

    def value_and_grads(params, buffers, x):
        return fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).pow(2).mean())(params, buffers, x)

    x = torch.randn(8, 4)
    eager_losses, eager, _ = value_and_grads(params, buffers, x)
    losses, compiled, _ = torch.compile(value_and_grads, fullgraph=True)(params, buffers, x)
    assert eager["unused.weight"] is None and eager["unused.bias"] is None
    assert torch.equal(compiled["unused.weight"], torch.zeros(3, 2, 4))
    assert torch.equal(compiled["unused.bias"], torch.zeros(3, 2))
    torch.testing.assert_close(compiled["used.weight"], eager["used.weight"])
    torch.testing.assert_close(losses, eager_losses)
    assert not losses.requires_grad and losses.grad_fn is None


def recording_backend(graphs: list[str]):
    """inductor, recording each graph it compiles (after AOTAutograd: aten and our ops)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, *args, **kwargs):
        graphs.append(str(gm.graph))
        return compile_fx_inner(gm, *args, **kwargs)

    return lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=inner)


def mlp_members(n: int, dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(
            nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8, bias=False), nn.ReLU(), nn.Linear(8, 2)
        ).to(dtype)
        for _ in range(n)
    ]


def functional_mlp_training_step() -> None:
    """compile.md's recipe on a plain MLP reaches the stacked MLP ops (forward and
    backward) and equals the loop with torch.optim.Adam: losses, parameters and Adam
    state after several steps, float64 and float32, shared and per-member targets."""
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        for in_dims in ((None, 0), None):
            _functional_mlp_case(dtype, tol, in_dims)


def _functional_mlp_case(dtype: torch.dtype, tol: float, in_dims: tuple | None) -> None:
    n, steps = 3, 4
    modules = mlp_members(n, dtype)
    loop = copy.deepcopy(modules)
    loop_opt = torch.optim.Adam([p for m in loop for p in m.parameters()], lr=1e-2, foreach=True)
    fmodel, params, buffers = fe.stack(modules)
    opt = fe.optim.adam(lr=1e-2)
    state = opt.init(params)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    def train_step(params, buffers, state, x, y):
        losses, grads, buffers = fe.value_and_grad(loss_fn, in_dims)(params, buffers, x, y)
        state = opt.update_(grads, state, params)
        return buffers, state, losses

    graphs: list[str] = []
    compiled = torch.compile(train_step, fullgraph=True, backend=recording_backend(graphs))
    x = torch.randn(32, 4, dtype=dtype)
    y = torch.randn(*((n,) if in_dims else ()), 32, 2, dtype=dtype)
    for _ in range(steps):
        buffers, state, losses = compiled(params, buffers, state, x, y)
        loop_opt.zero_grad()
        want = torch.stack([F.mse_loss(m(x), y[i] if in_dims else y) for i, m in enumerate(loop)])
        want.sum().backward()
        loop_opt.step()
        torch.testing.assert_close(losses, want.detach(), rtol=tol, atol=tol)
    assert len(graphs) == 1, len(graphs)  # one graph: no graph break anywhere
    assert "funcensemble.mlp_forward" in graphs[0], graphs[0]
    assert "funcensemble.mlp_backward" in graphs[0], graphs[0]
    adam = state[0]  # mu, nu, count: torch.optim's exp_avg, exp_avg_sq, step
    for name, value in params.items():
        want_p = torch.stack([m.get_parameter(name) for m in loop]).detach()
        torch.testing.assert_close(value.detach(), want_p, rtol=tol, atol=tol)
        for got_s, field in ((adam.mu, "exp_avg"), (adam.nu, "exp_avg_sq")):
            want_s = torch.stack([loop_opt.state[m.get_parameter(name)][field] for m in loop])
            torch.testing.assert_close(got_s[name], want_s, rtol=tol, atol=tol)
        assert float(adam.count[name]) == steps
    assert all(p.requires_grad and p.is_leaf for p in params.values())


def functional_mlp_vmap() -> None:
    """fe.vmap of a loss on a plain MLP under compile reaches the stacked ops, and a
    backward through the compiled forward equals the loop's (per-member inputs too)."""
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        _functional_mlp_vmap_case(dtype, tol)
    # fe.vmap(fmodel) built inside the compiled function (found by an audit:
    # functools.wraps read the FunctionalModule's missing __name__, whose AttributeError
    # Dynamo could not trace under fullgraph).
    members = mlp_members(3, torch.float64)
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))
    x = torch.randn(5, 4, dtype=torch.float64)
    run = torch.compile(lambda p, b, x: fe.vmap(fmodel)(p, b, x), fullgraph=True, backend="eager")
    want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(run(params, buffers, x), want, rtol=1e-10, atol=1e-10)


def _functional_mlp_vmap_case(dtype: torch.dtype, tol: float) -> None:
    n = 3
    modules = mlp_members(n, dtype)
    loop = copy.deepcopy(modules)
    fmodel, params, buffers = fe.stack(modules)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    graphs: list[str] = []
    losses_of = torch.compile(
        fe.vmap(loss_fn, in_dims=(0, 0)), fullgraph=True, backend=recording_backend(graphs)
    )
    x = torch.randn(n, 32, 4, dtype=dtype, requires_grad=True)
    y = torch.randn(n, 32, 2, dtype=dtype)
    losses = losses_of(params, buffers, x, y)
    losses.sum().backward()
    want = torch.stack([F.mse_loss(m(x[i]), y[i]) for i, m in enumerate(loop)])
    torch.testing.assert_close(losses, want, rtol=tol, atol=tol)
    x_grad = x.grad.clone()
    x.grad = None
    want.sum().backward()
    torch.testing.assert_close(x_grad, x.grad, rtol=tol, atol=tol)
    for name, value in params.items():
        want_g = torch.stack([m.get_parameter(name).grad for m in loop])
        torch.testing.assert_close(value.grad, want_g, rtol=tol, atol=tol)
    assert any("funcensemble.mlp_forward" in g for g in graphs), graphs
    assert any("funcensemble.mlp_backward" in g for g in graphs), graphs


def nested_vmap() -> None:
    """A torch.func.vmap around fe.value_and_grad (over data sets), and a torch.func.grad
    around fe.vmap, compiled, equal eager: the stacked MLP ops' own vmap rules fold the
    outer batch into the members, and their autograd runs under torch.func.grad."""
    n = 3
    fmodel, params, buffers = fe.stack(mlp_members(n, torch.float64))

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    def per_data_set(xs, ys):
        def one(x, y):
            losses, grads, _ = fe.value_and_grad(loss_fn, (None, 0))(params, buffers, x, y)
            return losses, grads

        return torch.func.vmap(one)(xs, ys)

    xs, ys = (
        torch.randn(2, 16, 4, dtype=torch.float64),
        torch.randn(2, n, 16, 2, dtype=torch.float64),
    )
    graphs: list[str] = []
    got = torch.compile(per_data_set, fullgraph=True, backend=recording_backend(graphs))(xs, ys)
    want = per_data_set(xs, ys)
    for g, w in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    assert any("funcensemble.mlp_backward" in g for g in graphs), graphs
    # And torch.func.grad around fe.vmap (grad outside, the vmap inside).
    x, y = xs[0], ys[0]

    def grads_of(p):
        return torch.func.grad(
            lambda p: fe.vmap(loss_fn, in_dims=(None, 0))(p, buffers, x, y).sum()
        )(p)

    plain = {k: v.detach() for k, v in params.items()}
    got = torch.compile(grads_of, fullgraph=True)(plain)
    for k, g in grads_of(plain).items():
        torch.testing.assert_close(got[k], g, rtol=1e-10, atol=1e-10)


def randomness_limits() -> None:
    """compile.md: randomness="same" with chunk_size stops under fullgraph (torch cannot
    trace get_rng_state) and runs without it, every member drawing the same mask;
    randomness="error" stops with torch's own wording."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)) for _ in range(4)]
    for m in members:
        with torch.no_grad():
            m[2].weight.fill_(1.0)
            m[2].bias.zero_()
            m[0].weight.copy_(members[0][0].weight)
            m[0].bias.copy_(members[0][0].bias)
    fmodel, params, buffers = fe.stack(members)
    same = fe.vmap(fmodel, randomness="same", chunk_size=2)
    x = torch.randn(5, 4)
    try:
        torch.compile(same, fullgraph=True)(params, buffers, x)
    except Exception as error:
        assert type(error).__name__ == "Unsupported", type(error)
    else:
        raise AssertionError("randomness='same' with chunk_size compiled with fullgraph")
    torch._dynamo.reset()
    out = torch.compile(same)(params, buffers, x)
    for i in range(1, 4):  # identical members and one mask: identical outputs
        assert torch.equal(out[i], out[0])
    torch._dynamo.reset()
    error_mode = fe.vmap(fmodel, randomness="error")
    try:
        torch.compile(error_mode, fullgraph=True)(params, buffers, x)
    except Exception as error:
        # 2.14: Dynamo's Unsupported, carrying the eager mode's message (it traces our
        # check's raise); 2.13 and older: torch's own wording, from inside tracing.
        says = "draws random numbers" if TORCH_2_14 else "randomness error mode"
        assert says in str(error), str(error)[-2000:]
        assert not TORCH_2_14 or type(error).__name__ == "Unsupported", type(error)
    else:
        raise AssertionError("randomness='error' with Dropout compiled")
    if TORCH_2_14:  # without fullgraph, Dynamo runs the call eagerly, which refuses it
        torch._dynamo.reset()
        try:
            torch.compile(error_mode)(params, buffers, x)
        except RuntimeError as error:
            assert "draws random numbers" in str(error), str(error)[-2000:]
        else:
            raise AssertionError("randomness='error' with Dropout ran compiled")


def second_derivatives() -> None:
    """compile.md: a gradient of a gradient through the compiled MLP ops stops with a
    RuntimeError naming them (torch 2.14: Dynamo runs it eagerly instead, the loop's
    values, and stops under fullgraph with Unsupported carrying that message);
    torch.func.hessian stops under fullgraph (Dynamo's Unsupported) and, without
    fullgraph, runs as eager code does."""
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double() for _ in range(2)
    ]
    fmodel, params, buffers = fe.stack(members)
    params = {k: v.detach() for k, v in params.items()}
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)

    def total(p):
        return fe.vmap(lambda q, b: F.mse_loss(fmodel(q, b, x), y))(p, buffers).sum()

    def grad_of_grad(p):
        return torch.func.grad(lambda q: torch.func.grad(total)(q)["0.weight"].sum())(p)

    def hessian(p):
        return torch.func.hessian(total)(p)["0.weight"]["0.weight"]

    if TORCH_2_14:
        # Dynamo runs the call eagerly where tracing meets the refusal: the loop's values.
        got = torch.compile(grad_of_grad)(params)
        want = _grad_of_grad_of_the_loop(members, x, y)
        for k in want:
            torch.testing.assert_close(got[k], want[k])
        torch._dynamo.reset()
        try:
            torch.compile(grad_of_grad, fullgraph=True)(params)
        except Exception as error:
            assert type(error).__name__ == "Unsupported", type(error)
            assert "second derivatives through a plain MLP" in str(error), str(error)[-2000:]
        else:
            raise AssertionError("a gradient of a gradient through the MLP ops compiled whole")
    else:
        try:
            torch.compile(grad_of_grad)(params)
        except RuntimeError as error:
            assert "second derivatives through a plain MLP" in str(error), str(error)[-2000:]
        else:
            raise AssertionError("a compiled gradient of a gradient through the MLP ops ran")
    torch._dynamo.reset()
    try:
        torch.compile(hessian, fullgraph=True)(params)
    except Exception as error:
        assert type(error).__name__ == "Unsupported", type(error)
    else:
        raise AssertionError("torch.func.hessian compiled with fullgraph")
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(hessian)(params), hessian(params))


def _grad_of_grad_of_the_loop(
    members: list[nn.Module], x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    """second_derivatives' grad_of_grad, member by member: the gradient of the sum of
    the first layer's weight gradient, stacked."""
    per_member = []
    for m in copy.deepcopy(members):
        loss = F.mse_loss(m(x), y)
        (g,) = torch.autograd.grad(loss, m[0].weight, create_graph=True)
        names = [k for k, _ in m.named_parameters()]
        grads = torch.autograd.grad(g.sum(), [p for _, p in m.named_parameters()])
        per_member.append(dict(zip(names, grads, strict=True)))
    return {k: torch.stack([g[k] for g in per_member]) for k in per_member[0]}


def forward_mode() -> None:
    """compile.md: eagerly each member's tangent comes back. Compiled, on torch 2.14 too,
    for both faces; on 2.13 and older a compiled fe.vmap given a dual tensor returns its
    output without a tangent (as torch's own compiled vmap of functional_call does), and
    the compiled module face stops asking for a jvp."""
    import torch.autograd.forward_ad as fwad

    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double() for _ in range(2)
    ]
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))
    params = {k: v.detach() for k, v in params.items()}
    x, v = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    compiled = torch.compile(lambda p, x: fe.vmap(fmodel)(p, buffers, x))
    ens = fe.Ensemble(copy.deepcopy(members))
    with fwad.dual_level():
        got = fwad.unpack_dual(compiled(params, fwad.make_dual(x, v)))
        eager = fwad.unpack_dual(fe.vmap(fmodel)(params, buffers, fwad.make_dual(x, v)))
        want = torch.stack([fwad.unpack_dual(m(fwad.make_dual(x, v))).tangent for m in members])
        torch.testing.assert_close(eager.tangent, want)
        if TORCH_2_14:  # each member's tangent, compiled, on both faces
            torch.testing.assert_close(got.tangent, want)
            torch.testing.assert_close(got.primal, eager.primal)
            module = fwad.unpack_dual(torch.compile(ens)(fwad.make_dual(x, v)))
            torch.testing.assert_close(module.tangent, want)
            torch.testing.assert_close(module.primal, eager.primal)
            return
        assert got.tangent is None, "a compiled call now carries the tangent: update compile.md"
        try:
            torch.compile(ens)(fwad.make_dual(x, v))
        except Exception as error:
            assert "jvp" in str(error), str(error)[-2000:]
        else:
            raise AssertionError("the compiled module face ran on a dual tensor")


def user_mode() -> None:
    """speed.md: under torch.compile a torch function mode of the user's does not see
    the members' F.linear (the compiled MLP op runs in its place): the compiled call
    computes what it computes without the mode; eagerly the mode sees each member's."""

    class PlusOne(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out + 1 if func is F.linear else out

    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double() for _ in range(3)
    ]
    ens = fe.Ensemble(copy.deepcopy(members))
    x = torch.randn(5, 3, dtype=torch.float64)
    plain = ens(x)
    compiled = torch.compile(ens, backend="eager")
    with PlusOne():
        want = torch.stack([m(x) for m in members])
        torch.testing.assert_close(ens(x), want)  # eagerly: the general path
        got = compiled(x)
    assert (want - plain).abs().max() > 0.5
    torch.testing.assert_close(got, plain)
    # compile.md: a replaced function is not run as the loop runs it, compiled, for an
    # ensemble as for one plain module compiled by torch.
    layer_norm = F.layer_norm
    F.layer_norm = lambda *a, **k: layer_norm(*a, **k) + 1.0
    try:
        norms = [nn.Sequential(nn.LayerNorm(4)).double() for _ in range(2)]
        x = torch.randn(3, 4, dtype=torch.float64)
        want = torch.stack([m(x) for m in norms])
        torch.testing.assert_close(fe.Ensemble(copy.deepcopy(norms))(x), want)  # eagerly
        ours = torch.compile(fe.Ensemble(copy.deepcopy(norms)), backend="aot_eager")(x)
        alone = torch.compile(copy.deepcopy(norms[0]), backend="aot_eager")(x)
        assert (alone - want[0]).abs().max() > 0.5
        assert (ours - want).abs().max() > 0.5
    finally:
        F.layer_norm = layer_norm


def partition() -> None:
    """compile.md's in-place step with param groups: fe.optim.partition of AdamW groups
    (its rollback copies, which Dynamo cannot trace, are left out of the graph)."""
    modules = make_members(3)
    opt = fe.optim.chain(
        fe.optim.clip_by_global_norm(0.5),
        fe.optim.partition(
            {
                "decay": fe.optim.adamw(lr=torch.tensor([1e-2, 3e-3, 1e-3]), weight_decay=0.1),
                "no_decay": fe.optim.adam(lr=1e-2),
            },
            lambda name: "no_decay" if name.endswith("bias") else "decay",
        ),
    )
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


def polyak() -> None:
    """polyak_update_ compiled with fullgraph=True equals eager, with a float tau and
    with a [N] tensor of tau passed to the compiled step (its range check runs inside
    the graph: a tau out of range raises before the update, where reading its values
    stopped fullgraph)."""
    torch.manual_seed(0)
    online = {"w": torch.randn(4, 3, 2), "b": torch.randn(4, 2)}
    for tau in (0.1, 0.5):
        eager = {k: torch.zeros_like(v) for k, v in online.items()}
        compiled = {k: torch.zeros_like(v) for k, v in online.items()}
        step = torch.compile(
            lambda t, o, tau=tau: fe.optim.polyak_update_(t, o, tau), fullgraph=True
        )
        for _ in range(3):
            fe.optim.polyak_update_(eager, online, tau)
            step(compiled, online)
        for k in online:
            torch.testing.assert_close(compiled[k], eager[k], rtol=1e-6, atol=1e-7)
        assert compiled["w"].abs().sum() > 0
    torch._dynamo.reset()
    step = torch.compile(lambda t, o, tau: fe.optim.polyak_update_(t, o, tau), fullgraph=True)
    for tau in (torch.tensor([0.1, 0.2, 0.3, 1.0]),):
        eager = {k: torch.zeros_like(v) for k, v in online.items()}
        compiled = {k: torch.zeros_like(v) for k, v in online.items()}
        for _ in range(3):
            fe.optim.polyak_update_(eager, online, tau)
            step(compiled, online, tau)
        for k in online:
            torch.testing.assert_close(compiled[k], eager[k], rtol=1e-6, atol=1e-7)
        before = {k: v.clone() for k, v in compiled.items()}
        for bad in (tau.clone().fill_(1.5), torch.tensor([0.1, float("nan"), 0.3, 1.0])):
            try:
                step(compiled, online, bad)
            except RuntimeError as error:
                assert "polyak_update_: Invalid tau: expected 0 <= tau <= 1" in str(error), error
            else:
                raise AssertionError(f"a compiled polyak_update_ took tau={bad}")
            for k in online:
                assert torch.equal(compiled[k], before[k]), k


class _RunningMean(nn.Module):
    """buffers.md's member whose forward re-assigns a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("avg", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.avg = 0.9 * self.avg + 0.1 * y.detach().mean(0)
        return y - self.avg


def rebound_buffer() -> None:
    """A buffer the forward re-assigns lands in its member's slice when compiled, as
    eagerly (it stayed as it was: 0.05 off the loop), with fullgraph=True too; one
    re-assigned with another shape is refused, as eagerly."""
    torch.manual_seed(0)
    members = [_RunningMean().double() for _ in range(3)]
    x = torch.randn(16, 4, dtype=torch.float64)
    loop = copy.deepcopy(members)
    for m in loop:
        m(x)
    want = torch.stack([m.avg for m in loop])
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))
    step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).pow(2).mean())
    _, _, new = torch.compile(step, backend="aot_eager", fullgraph=True)(params, buffers, x)
    torch.testing.assert_close(new["avg"], want, rtol=0, atol=1e-15)
    ens = fe.Ensemble(copy.deepcopy(members))
    torch.compile(ens, backend="aot_eager")(x)
    torch.testing.assert_close(ens.stacked_buffers()["avg"], want, rtol=0, atol=1e-15)

    class Reshaped(_RunningMean):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.avg = self.lin(x).detach()  # [16, 2] for a [2] buffer
            return self.avg

    fmodel, params, buffers = fe.stack([Reshaped() for _ in range(3)])
    step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())
    try:
        torch.compile(step, backend="aot_eager")(params, buffers, x.float())
    except ValueError as error:
        assert "re-assigned the buffer `avg` with shape (16, 2)" in str(error), error
    else:
        raise AssertionError("a compiled step took a buffer re-assigned with another shape")
    assert torch.equal(buffers["avg"], torch.zeros(3, 2))


def wrong_shape() -> None:
    """One member's [4] bias assigned to ens.stacked (N = 4) is refused compiled as
    eagerly, on the general path and the MLP one (compiled, it ran sliced to one
    number per member: 0.94 off the loop)."""
    _refused_compiled(lambda: nn.LayerNorm(32))
    _refused_compiled(nn.Tanh)


def _refused_compiled(mid: Callable[[], nn.Module]) -> None:
    ens = fe.Ensemble([nn.Sequential(nn.Linear(8, 32), mid(), nn.Linear(32, 4)) for _ in range(4)])
    ens.stacked[2].bias = nn.Parameter(torch.randn(4))
    x = torch.randn(5, 8)
    params, buffers = ens.stacked_params(), ens.stacked_buffers()
    step = fe.value_and_grad(lambda p, b, x: ens.fmodel(p, b, x).sum())
    for call in (
        lambda: torch.compile(ens, backend="aot_eager")(x),
        lambda: torch.compile(step, backend="aot_eager")(params, buffers, x),
    ):
        torch._dynamo.reset()
        try:
            call()
        except ValueError as error:
            assert "2.bias" in str(error), error
        else:
            raise AssertionError("a compiled call took a bias of one member's shape")


def cumulative_batch_norm() -> None:
    """compile.md: BatchNorm(momentum=None) in train mode compiles with a graph break at
    the layer's float() of its count, matching the loop (members counting alike and
    differently, the module face and value_and_grad); fullgraph=True stops in tracing."""

    def make() -> list[nn.Module]:
        torch.manual_seed(0)
        members = [
            nn.Sequential(
                nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 2)
            ).double()
            for _ in range(3)
        ]
        return members

    x = torch.randn(5, 4, dtype=torch.float64)
    for differ in (False, True):
        members = make()
        if differ:
            members[0](x)  # member 0 has counted one batch more
        loop = copy.deepcopy(members)
        torch._dynamo.reset()
        ens = fe.Ensemble(copy.deepcopy(members))
        compiled = torch.compile(ens, backend="aot_eager")
        for _ in range(3):
            out = compiled(x)
            want = torch.stack([m(x) for m in loop])
            torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        for name, stacked in ens.stacked_buffers().items():
            per_member = torch.stack([dict(m.named_buffers())[name] for m in loop])
            torch.testing.assert_close(stacked, per_member, rtol=0, atol=1e-12)

        torch._dynamo.reset()
        try:
            torch.compile(fe.Ensemble(copy.deepcopy(members)), backend="aot_eager", fullgraph=True)(
                x
            )
        except Exception as error:  # Dynamo's own error classes differ between versions
            assert "torch._dynamo" in type(error).__module__, type(error)
        else:
            raise AssertionError("fullgraph=True traced BatchNorm(momentum=None)'s count")

        fmodel, params, buffers = fe.stack(copy.deepcopy(members))
        step = fe.value_and_grad(lambda p, b, x, f=fmodel: f(p, b, x).pow(2).mean())
        if differ:  # compiled, the gradients come from torch.func.grad: refused
            before = {k: v.clone() for k, v in buffers.items()}
            try:
                torch.compile(step, backend="aot_eager")(params, buffers, x)
            except RuntimeError as error:
                assert "different num_batches_tracked ([2, 1, 1])" in str(error), error
                assert "a compiled fe.value_and_grad" in str(error), error
            else:
                raise AssertionError("compiled value_and_grad took members counting apart")
            for k, v in before.items():
                assert torch.equal(buffers[k], v), k
            continue
        _, grads, new = torch.compile(step, backend="aot_eager")(params, buffers, x)
        _, eager_grads, eager_new = step(params, buffers, x)
        for k in grads:
            torch.testing.assert_close(grads[k], eager_grads[k], rtol=0, atol=1e-12)
        for k in new:
            torch.testing.assert_close(new[k], eager_new[k], rtol=0, atol=1e-12)


class _DoublesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.lin(x)


class _DoublesItsInputThenBreaks(_DoublesItsInput):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        torch._dynamo.graph_break()
        return self.lin(x)


class _DoublesItsDictInput(_DoublesItsInput):
    def forward(self, d: dict) -> torch.Tensor:  # type: ignore[override]
        return super().forward(d["x"])


def _refused_unchanged(
    fn: Callable[..., object],
    args: tuple,
    x: torch.Tensor,
    also: str = "",
    *,
    before: bool = True,
    **options: object,
) -> None:
    """``torch.compile(fn, **options)(*args)`` raises naming the shared input (or saying
    ``also``), and, ``before``, while tracing: ``x`` is as it was."""
    x0 = x.clone()
    torch._dynamo.reset()
    try:
        torch.compile(fn, **options)(*args)
    except Exception as error:  # Dynamo hands ours on inside an error of its own
        said = f"{error} {error.__cause__}"
        ours = (
            "Refused while torch.compile or torch.export traced the call"
            if before
            else "shared by all"
        )
        assert ours in said or (also and also in said), said
        if before and ours in said:  # compile.md: inside Dynamo's error, ours first
            assert type(error).__name__ == "InternalTorchDynamoError", type(error)
            assert str(error).startswith("ValueError: "), said
    else:
        raise AssertionError("a compiled call changed a shared input in place and ran")
    if before:
        assert torch.equal(x, x0), "refused while tracing, yet the input changed"


def shared_input_in_place() -> None:
    """compile.md, inputs.md: a forward that changes a shared input in place is refused
    under torch.compile too: while tracing (the fake tensors' version counters), before
    the input changes, for every face, with and without fullgraph; with a graph break
    inside the forward, by the eager check around the eagerly run call (after the
    change, as eagerly). Never the one call's result, which differs from the loop's
    (where members change it in turn). torch 2.14 runs a compiled value_and_grad's
    forward where 2.13's torch.func.grad refused it ("would mutate a captured Tensor"),
    and returned the one call's result before this check."""
    torch.manual_seed(0)
    members = [_DoublesItsInput().double() for _ in range(3)]
    x0 = torch.randn(5, 4, dtype=torch.float64)
    ens = fe.Ensemble(copy.deepcopy(members))
    try:
        ens(x0.clone())
    except ValueError as error:
        assert "modified its positional argument 0, an input shared" in str(error), error
    else:
        raise AssertionError("eagerly, an in-place shared input ran")
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))
    loss = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())
    chunked = fe.vmap(fmodel, chunk_size=2)
    dict_fmodel, dict_params, dict_buffers = fe.stack(
        [_DoublesItsDictInput().double() for _ in range(3)]
    )
    # 2.13 and older: torch.func.grad refuses it first, while tracing too.
    grad_says = "would mutate a captured Tensor"
    for fullgraph in (False, True):
        for backend in ("aot_eager", "inductor"):
            x = x0.clone()
            options = {"backend": backend, "fullgraph": fullgraph}
            _refused_unchanged(ens, (x,), x, **options)
            also = grad_says if fullgraph or not TORCH_2_14 else ""
            _refused_unchanged(loss, (params, buffers, x), x, also, **options)
        options = {"backend": "aot_eager", "fullgraph": fullgraph}
        _refused_unchanged(chunked, (params, buffers, x), x, **options)
        dict_args = (dict_params, dict_buffers, {"x": x})
        _refused_unchanged(fe.vmap(dict_fmodel), dict_args, x, **options)
    # Inside a torch.func.vmap of the caller's own (over seeds): the counter read is the
    # plain tensor's, which an in-place op through the wrapper moves.
    xs = torch.randn(2, 5, 4, dtype=torch.float64)
    over_seeds = torch.func.vmap(lambda xx: fe.vmap(fmodel)(params, buffers, xx))
    # (2.13 and older run it eagerly, at a graph break of their own: refused after.)
    _refused_unchanged(over_seeds, (xs,), xs, before=TORCH_2_14, backend="aot_eager")
    try:  # eagerly too, after the change
        over_seeds(xs.clone())
    except ValueError as error:
        assert "an input shared by all members" in str(error), error
    else:
        raise AssertionError("a vmap over seeds changed a shared input and ran")
    # A graph break inside the forward: Dynamo runs the mapped call eagerly (it cannot
    # resume inside it), and the eager check refuses it once the input has changed.
    breaking = [_DoublesItsInputThenBreaks().double() for _ in range(3)]
    fmodel, params, buffers = fe.stack(copy.deepcopy(breaking))
    loss = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())
    for call in (
        lambda x: torch.compile(fe.Ensemble(copy.deepcopy(breaking)), backend="aot_eager")(x),
        lambda x: torch.compile(fe.vmap(fmodel), backend="aot_eager")(params, buffers, x),
        lambda x: torch.compile(loss, backend="aot_eager")(params, buffers, x),
    ):
        torch._dynamo.reset()
        x = x0.clone()
        try:
            call(x)
        except Exception as error:
            said = f"{error} {error.__cause__}"
            assert "an input shared by all members" in said or grad_says in said, said
        else:
            raise AssertionError("a compiled call with a graph break changed a shared input")


class _Logs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.log: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.log.append(out)
        return out


def container_under_compile() -> None:
    """buffers.md: the container check does not run compiled; a forward keeping a
    tensor in a list fails inside the compiler with aot_eager, and with the eager
    backend runs and leaves a tensor that cannot be read."""
    x = torch.randn(5, 4)
    ens = fe.Ensemble([_Logs() for _ in range(3)])
    try:
        torch.compile(ens, backend="aot_eager")(x)
    except Exception as error:  # Dynamo's own error classes differ between versions
        assert "torch._dynamo" in type(error).__module__, type(error)
    else:
        raise AssertionError("aot_eager compiled a forward keeping a tensor in a list")
    torch._dynamo.reset()
    ens = fe.Ensemble([_Logs() for _ in range(3)])
    torch.compile(ens, backend="eager")(x)
    assert len(ens.stacked.log) == 1
    try:
        ens.stacked.log[0] + 1
    except RuntimeError as error:
        assert "escaped" in str(error), error
    else:
        raise AssertionError("the kept tensor could be read")


def embedding_max_norm() -> None:
    """unsupported.md: Embedding(max_norm) compiled without fullgraph runs with a graph
    break, as the loop (outputs and renormalised weights); fullgraph=True refuses it."""
    torch.manual_seed(0)
    members = [nn.Embedding(10, 3, max_norm=0.5).double() for _ in range(3)]
    with torch.no_grad():
        for m in members:
            m.weight.mul_(3)  # rows well outside max_norm
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(copy.deepcopy(members))
    compiled = torch.compile(ens, backend="aot_eager")
    for idx in ([1, 2, 2], [7, 1, 9]):
        got = compiled(torch.tensor(idx))
        want = torch.stack([m(torch.tensor(idx)) for m in loop])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    weights = torch.stack([m.weight.detach() for m in loop])
    torch.testing.assert_close(ens.stacked_params()["weight"], weights, rtol=0, atol=1e-15)
    torch._dynamo.reset()
    fresh = fe.Ensemble(copy.deepcopy(members))
    before = fresh.stacked_params()["weight"].clone()
    try:
        torch.compile(fresh, backend="aot_eager", fullgraph=True)(torch.tensor([1, 2]))
    except Exception as error:  # Dynamo's own error classes differ between versions
        assert "max_norm" in str(error), error
    else:
        raise AssertionError("fullgraph=True compiled Embedding(max_norm)")
    assert torch.equal(fresh.stacked_params()["weight"], before)


def optimizer_limits() -> None:
    """compile.md: adam's and sgd-with-momentum's in-place steps compile whole (three
    steps equal eager's); sgd without momentum and rmsprop stop with Dynamo's error
    under fullgraph=True."""
    fmodel, params, buffers = fe.stack(make_members(3))
    x, y = torch.randn(5, 4), torch.randn(5, 2)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    for name, transform, compiles in (
        ("adam", fe.optim.adam(1e-2), True),
        ("sgd with momentum", fe.optim.sgd(0.1, momentum=0.9, weight_decay=1e-3), True),
        ("sgd", fe.optim.sgd(0.1), False),
        ("rmsprop", fe.optim.rmsprop(1e-2), False),
    ):

        def step(params, state, transform=transform):
            _, grads, _ = fe.value_and_grad(loss_fn)(params, buffers, x, y)
            return transform.update_(grads, state, params)

        torch._dynamo.reset()
        compiled_params = {k: v.clone() for k, v in params.items()}
        compiled_state = transform.init(compiled_params)
        try:
            for _ in range(3):
                compiled_state = torch.compile(step, fullgraph=True)(
                    compiled_params, compiled_state
                )
        except Exception as error:  # Dynamo's own error classes differ between versions
            assert not compiles, (name, error)
            assert "torch._dynamo" in type(error).__module__, (name, type(error))
        else:
            assert compiles, f"{name} compiled whole: update compile.md"
            eager_params = {k: v.clone() for k, v in params.items()}
            eager_state = transform.init(eager_params)
            for _ in range(3):
                eager_state = step(eager_params, eager_state)
            for k in params:  # three steps, compiled and eager alike
                torch.testing.assert_close(
                    compiled_params[k], eager_params[k], rtol=1e-5, atol=1e-6
                )


def transform_swaps() -> None:
    """An EnsembleOptimizer's transform assigned between calls of a compiled step (an lr
    change, then a schedule), the collector running often as in a busy program: Dynamo
    guarded on a weak dictionary of transforms by position, and a transform collected
    between tracing and guarding broke the guard (IndexError). Equals eager."""
    import gc

    def run(compiled: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        ens = fe.Ensemble(
            [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)) for _ in range(3)]
        )
        opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=1e-2))

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
            opt.step()

        call = torch.compile(step) if compiled else step
        x, y = torch.randn(6, 4), torch.randn(3, 6, 2)
        for lr in [1e-2, 1e-1, 1e-1, 3e-3, lambda count: 1e-2 * 0.5 ** count.double()]:
            opt.transform = fe.optim.adam(lr=lr)
            call(x, y)
        return {k: v.detach().clone() for k, v in ens.stacked_params().items()}

    threshold = gc.get_threshold()
    gc.set_threshold(50)
    try:
        compiled = run(True)
    finally:
        gc.set_threshold(*threshold)
    for k, v in run(False).items():
        torch.testing.assert_close(compiled[k], v, rtol=1e-5, atol=1e-6)


class DictInput(nn.Module):
    """Reads a dict input: ``obs`` through a Linear, plus a per-member ``shift``'s sum."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 2)

    def forward(self, d: dict) -> torch.Tensor:
        return self.l(d["obs"]) + d["shift"].sum()


def dict_inputs() -> None:
    """Dict arguments split over members under fullgraph compile: in_dims 0, None and a
    dict prefix given in another key order than the argument's (with an OrderedDict
    argument too), on fe.vmap, value_and_grad + update_ and the module face, against
    the loop in float64. Dynamo could not flatten such a dict of ints with optree."""
    n = 3
    torch.manual_seed(0)
    members = [DictInput().double() for _ in range(n)]
    obs = torch.randn(n, 5, 4, dtype=torch.float64)
    shift = torch.randn(n, 3, dtype=torch.float64)
    y = torch.randn(n, 5, 2, dtype=torch.float64)
    cases = [  # (in_dims entry, the argument, member i's argument)
        (0, {"obs": obs, "shift": shift}, lambda i: {"obs": obs[i], "shift": shift[i]}),
        (None, {"obs": obs[0], "shift": shift[0]}, lambda i: {"obs": obs[0], "shift": shift[0]}),
        (
            {"shift": 0, "obs": None},
            {"obs": obs[1], "shift": shift},
            lambda i: {"obs": obs[1], "shift": shift[i]},
        ),
        (
            {"obs": 0, "shift": None},
            OrderedDict(shift=shift[2], obs=obs),
            lambda i: {"obs": obs[i], "shift": shift[2]},
        ),
    ]
    for dim, arg, member_arg in cases:
        want = torch.stack([m(member_arg(i)) for i, m in enumerate(members)])
        # Inference, functional face.
        fmodel, params, buffers = fe.stack(copy.deepcopy(members))
        torch._dynamo.reset()
        got = torch.compile(fe.vmap(fmodel, in_dims=(dim,)), fullgraph=True)(params, buffers, arg)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        # Three training steps, functional face, against the loop with torch.optim.
        loop = copy.deepcopy(members)
        loop_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in loop]
        opt = fe.optim.adam(lr=1e-2)
        state = opt.init(params)
        value_and_grad = fe.value_and_grad(
            lambda p, b, d, t, fmodel=fmodel: F.mse_loss(fmodel(p, b, d), t), in_dims=(dim, 0)
        )

        def step(params, buffers, state, d, t, value_and_grad=value_and_grad, opt=opt):
            losses, grads, buffers = value_and_grad(params, buffers, d, t)
            return opt.update_(grads, state, params), losses

        compiled = torch.compile(step, fullgraph=True)
        # The module face, compiled with the same in_dims.
        ens = fe.Ensemble(copy.deepcopy(members))
        ens_opt = torch.optim.Adam(ens.parameters(), lr=1e-2)
        ens_step = torch.compile(lambda d, dim=dim, ens=ens: ens(d, in_dims=(dim,)), fullgraph=True)
        for _ in range(3):
            want_losses = []
            for i, (m, o) in enumerate(zip(loop, loop_opts, strict=True)):
                o.zero_grad()
                loss = F.mse_loss(m(member_arg(i)), y[i])
                loss.backward()
                o.step()
                want_losses.append(loss.detach())
            state, losses = compiled(params, buffers, state, arg, y)
            torch.testing.assert_close(losses, torch.stack(want_losses), rtol=1e-12, atol=1e-12)
            ens_opt.zero_grad()
            ((ens_step(arg) - y) ** 2).mean((1, 2)).sum().backward()
            ens_opt.step()
        for k in params:
            want_k = torch.stack([dict(m.named_parameters())[k] for m in loop]).detach()
            torch.testing.assert_close(params[k].detach(), want_k, rtol=1e-12, atol=1e-12)
            got_k = ens.state_dict()[f"stacked.{k}"]
            torch.testing.assert_close(got_k, want_k, rtol=1e-12, atol=1e-12)


def float64_steps() -> None:
    """The compiled functional step (value_and_grad + update_, inductor) against the
    eager step in float64, to 1e-12 after 3 steps: a model with BatchNorm1d or LayerNorm,
    Adam or AdamW, one learning rate or one per member. torch 2.10 and 2.11's inductor
    was 0.06 off here (versions.md), which float32 tolerances barely see."""
    dt = torch.float64
    cases = [("batch_norm", "adamw", True), ("layer_norm", "adam", True)]
    cases += [("batch_norm", "adam", False), ("layer_norm", "adamw", False)]
    for norm, kind, per_member in cases:
        torch.manual_seed(0)
        layer = nn.BatchNorm1d(16) if norm == "batch_norm" else nn.LayerNorm(16)
        modules = [
            nn.Sequential(
                nn.Linear(4, 16, bias=False), copy.deepcopy(layer), nn.Tanh(), nn.Linear(16, 2)
            )
            .to(dt)
            .train()
            for _ in range(3)
        ]
        lr = torch.tensor([1e-2, 3e-3, 1e-3], dtype=dt) if per_member else 1e-2
        opt = (fe.optim.adamw if kind == "adamw" else fe.optim.adam)(lr=lr)
        fmodel, params, buffers = fe.stack(copy.deepcopy(modules))
        _, ref_params, ref_buffers = fe.stack(copy.deepcopy(modules))

        def train_step(params, buffers, state, x, y, fmodel=fmodel, opt=opt):
            loss_fn = lambda p, b, x, y: F.mse_loss(fmodel(p, b, x), y)  # noqa: E731
            losses, grads, buffers = fe.value_and_grad(loss_fn)(params, buffers, x, y)
            return buffers, opt.update_(grads, state, params), losses

        torch._dynamo.reset()
        compiled = torch.compile(train_step, fullgraph=True)
        x, y = torch.randn(32, 4, dtype=dt), torch.randn(32, 2, dtype=dt)
        state, ref_state = opt.init(params), opt.init(ref_params)
        for _ in range(3):
            buffers, state, losses = compiled(params, buffers, state, x, y)
            ref_buffers, ref_state, ref_losses = train_step(
                ref_params, ref_buffers, ref_state, x, y
            )
            torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=1e-12)
        for got, want in ((params, ref_params), (buffers, ref_buffers), (state, ref_state)):
            for g, w in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=f"{norm} {kind}")


def attention_autocast() -> None:
    """Eval-mode TransformerEncoderLayer members under bfloat16 autocast: eager mode
    refuses the ensemble; compiled without gradients it computes what torch.compile of
    each member computes (float32, where the eager loop returns bfloat16); compiled with
    gradients it stops with torch's own error (compile.md)."""
    torch.manual_seed(0)
    members = [
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval() for _ in range(3)
    ]
    ens = fe.Ensemble(copy.deepcopy(members)).eval()
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            ens(x)
        except RuntimeError as error:
            assert "MultiheadAttention under torch.autocast" in str(error), error
        else:
            raise AssertionError("eager attention under autocast ran")
        with torch.no_grad():
            alone = torch.stack([torch.compile(copy.deepcopy(m))(x) for m in members])
            got = torch.compile(ens)(x)
        torch.testing.assert_close(got, alone, rtol=1e-6, atol=1e-6)
        try:
            torch.compile(ens)(x)
        except Exception as error:  # Dynamo wraps torch's RuntimeError
            assert "derivative for aten::_transformer_encoder_layer_fwd" in str(error), error
        else:
            raise AssertionError("compiled attention with gradients under autocast ran")


if __name__ == "__main__":
    faces = {
        "frozen": frozen_gradients,
        "functional": functional_training_step,
        "in_place": in_place_training_step,
        "pure_refused": pure_step_refused,
        "randomness_limits": randomness_limits,
        "second_derivatives": second_derivatives,
        "forward_mode": forward_mode,
        "user_mode": user_mode,
        "module": module_face_training_step,
        "mlp": mlp_training_step,
        "functional_mlp": functional_mlp_training_step,
        "functional_mlp_vmap": functional_mlp_vmap,
        "nested_vmap": nested_vmap,
        "polyak": polyak,
        "partition": partition,
        "rebound_buffer": rebound_buffer,
        "wrong_shape": wrong_shape,
        "optimizer_limits": optimizer_limits,
        "transform_swaps": transform_swaps,
        "cumulative_batch_norm": cumulative_batch_norm,
        "shared_input_in_place": shared_input_in_place,
        "embedding_max_norm": embedding_max_norm,
        "container_under_compile": container_under_compile,
        "dict_inputs": dict_inputs,
        "float64_steps": float64_steps,
        "attention_autocast": attention_autocast,
    }
    faces[sys.argv[1]]()
    print("OK")
