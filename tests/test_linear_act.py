"""The fast path's kept-buffer route (``_linear_act.LinearAct`` on ``_workspace`` buffers)
equals the loop, and never overwrites a tensor anyone still holds."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcensemble as fe
from funcensemble import _torch_compat
from funcensemble._kernels import linear_act as _linear_act
from funcensemble._kernels import workspace as _workspace

TOL = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-12},
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
}
STEPS = 4


@pytest.fixture(autouse=True)
def every_buffer_kept(monkeypatch):
    """Keep even the tiny buffers of these tests, and count the route's calls and the
    buffers it reused."""
    monkeypatch.setattr(_workspace, "MIN_BYTES", 0)
    _workspace.clear()
    seen: dict[str, int] = {"apply": 0, "reused": 0}
    original_held, original_apply = (
        _torch_compat.storage_held_elsewhere,
        _linear_act.LinearAct.apply,
    )

    def held(t):
        out = original_held(t)
        seen["reused"] += not out  # the pool hands this kept buffer out again
        return out

    def apply(*args):
        seen["apply"] += 1
        return original_apply(*args)

    monkeypatch.setattr(_torch_compat, "storage_held_elsewhere", held)
    monkeypatch.setattr(_linear_act.LinearAct, "apply", apply)
    yield seen
    _workspace.clear()


def heads(n: int, act: nn.Module, dtype: torch.dtype, *, bias: bool = True) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(
            nn.Linear(5, 7, bias=bias), act, nn.Linear(7, 6), nn.Dropout(0.0), act, nn.Linear(6, 3)
        ).to(dtype)
        for _ in range(n)
    ]


ACTS = [nn.Tanh(), nn.ReLU(), nn.Sigmoid(), nn.GELU(), nn.Identity()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("act", ACTS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("per_member", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_module_face_trains_as_the_loop(dtype, act, per_member, bias, every_buffer_kept):
    n = 3
    members = heads(n, act, dtype, bias=bias)
    loop = [m for m in heads(n, act, dtype, bias=bias)]
    ens = fe.Ensemble(members)
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
    ref_opt = torch.optim.Adam([p for m in loop for p in m.parameters()], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    tol = TOL[dtype]
    for _ in range(STEPS):
        x = torch.randn(*((n,) if per_member else ()), 11, 5, generator=g, dtype=dtype)
        y = torch.randn(n, 11, 3, generator=g, dtype=dtype)
        out = ens(x, in_dims=0) if per_member else ens(x)
        ref = torch.stack([m(x[i] if per_member else x) for i, m in enumerate(loop)])
        torch.testing.assert_close(out, ref, **tol)
        opt.zero_grad()
        F.mse_loss(out, y, reduction="sum").backward()
        ref_opt.zero_grad()
        F.mse_loss(ref, y, reduction="sum").backward()
        for name, p in ens.stacked_params().items():
            grads = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
            torch.testing.assert_close(p.grad, grads, **tol)
        opt.step()
        ref_opt.step()
    for name, p in ens.stacked_params().items():
        ref_params = [dict(m.named_parameters())[name] for m in loop]
        torch.testing.assert_close(p.detach(), torch.stack(ref_params).detach(), **tol)
        state = opt.state_dict()["state"]
        mu = next(v for k, v in state.items() if "mu" in k and k.endswith(f"['{name}']"))
        exp_avg = torch.stack([ref_opt.state[q]["exp_avg"] for q in ref_params])
        torch.testing.assert_close(mu, exp_avg, **tol)
    assert every_buffer_kept["apply"] >= 3 * STEPS  # the route ran, one call per Linear
    assert every_buffer_kept["reused"] > 0  # and later steps wrote into kept buffers


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_functional_face_trains_as_the_loop(dtype, every_buffer_kept):
    n = 3
    members, loop = heads(n, nn.Tanh(), dtype), heads(n, nn.Tanh(), dtype)
    fmodel, params, buffers = fe.stack(members)
    params = {k: v.detach() for k, v in params.items()}

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    value_and_grad = fe.value_and_grad(loss_fn, in_dims=(None, 0))
    opt = fe.optim.adam(1e-2)
    state = opt.init(params)
    ref_opt = torch.optim.Adam([p for m in loop for p in m.parameters()], lr=1e-2)
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        x = torch.randn(9, 5, generator=g, dtype=dtype)
        y = torch.randn(n, 9, 3, generator=g, dtype=dtype)
        losses, grads, buffers = value_and_grad(params, buffers, x, y)
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
        ref_opt.zero_grad()
        ref_losses = torch.stack([F.mse_loss(m(x), y[i]) for i, m in enumerate(loop)])
        ref_losses.sum().backward()
        ref_opt.step()
        torch.testing.assert_close(losses, ref_losses.detach(), **TOL[dtype])
    for name, p in params.items():
        ref = torch.stack([dict(m.named_parameters())[name].detach() for m in loop])
        torch.testing.assert_close(p, ref, **TOL[dtype])
    assert every_buffer_kept["reused"] > 0


def test_held_outputs_and_graphs_are_never_overwritten(every_buffer_kept):
    members = heads(2, nn.Tanh(), torch.float64)
    ens = fe.Ensemble(members)
    x = torch.randn(8, 5, dtype=torch.float64)
    # Outputs kept across calls, under no_grad and with grad.
    with torch.no_grad():
        first = ens(x)
    kept = first.clone()
    second = ens(2 * x)
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
    # A graph not yet backpropagated keeps its saved activations: a second forward
    # (and its backward) in between must not change the first one's gradients.
    ens.zero_grad()
    second.sum().backward(retain_graph=True)
    want = {k: p.grad.clone() for k, p in ens.stacked_params().items()}
    for scale in (3.0, 4.0):
        ens.zero_grad()
        ens(scale * x).pow(2).sum().backward()
    ens.zero_grad()
    second.sum().backward()  # the retained graph, after two other steps ran
    for k, p in ens.stacked_params().items():
        torch.testing.assert_close(p.grad, want[k], rtol=0, atol=0)
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
    # A held .grad is not overwritten by the next backward.
    held = {k: p.grad for k, p in ens.stacked_params().items()}
    copies = {k: g.clone() for k, g in held.items()}
    for p in ens.stacked_params().values():
        p.grad = None
    ens(5 * x).sum().backward()
    for k in held:
        torch.testing.assert_close(held[k], copies[k], rtol=0, atol=0)
    assert every_buffer_kept["reused"] > 0


@pytest.mark.parametrize("holder", ["untyped_storage", "storage"])
def test_an_output_held_through_its_storage_object_is_never_overwritten(holder):
    """An output held only through its storage object (``out.untyped_storage()``, the
    deprecated ``out.storage()``) was handed out again by the next call: the use count
    of a storage counts its Python object once whether anyone holds it or not."""
    members = [
        nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1), nn.Tanh()).double()
        for _ in range(3)
    ]
    ens = fe.Ensemble(members)
    x = torch.randn(16, 4, dtype=torch.float64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        out = ens(x)
        kept, offset, shape = out.clone(), out.storage_offset(), out.shape
        storage = getattr(out, holder)()
        del out
        ens(2 * x)
        held = torch.empty(0, dtype=torch.float64).set_(
            storage.untyped() if holder == "storage" else storage, offset, shape
        )
    torch.testing.assert_close(held, kept, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize(
    "act", [nn.Tanh(), nn.Sigmoid(), nn.ReLU()], ids=lambda m: type(m).__name__
)
def test_double_backward_matches_the_loop(dtype, act):
    # A gradient penalty: create_graph=True builds a graph through the route's backward.
    n = 3
    members, loop = heads(n, act, dtype), heads(n, act, dtype)
    ens = fe.Ensemble(members)
    params = list(ens.stacked_params().values())
    for scale in (1.0, 2.0):  # twice: the second runs with buffers kept from the first
        x = scale * torch.linspace(-1, 1, 40, dtype=dtype).view(8, 5)
        out = ens(x)
        grads = torch.autograd.grad(out.pow(2).sum(), params, create_graph=True)
        ens.zero_grad()
        sum(g.pow(2).sum() for g in grads).backward()
        ref_params = [list(m.parameters()) for m in loop]
        for m in loop:
            m.zero_grad()
        ref_out = [m(x) for m in loop]
        flat = [p for ps in ref_params for p in ps]
        ref_grads = torch.autograd.grad(
            sum(o.pow(2).sum() for o in ref_out), flat, create_graph=True
        )
        sum(g.pow(2).sum() for g in ref_grads).backward()
        k = len(ref_params[0])
        for j, p in enumerate(params):
            torch.testing.assert_close(
                grads[j].detach(), torch.stack(ref_grads[j::k]).detach(), **TOL[dtype]
            )
            torch.testing.assert_close(
                p.grad, torch.stack([ps[j].grad for ps in ref_params]), **TOL[dtype]
            )


def test_inference_mode_then_training():
    ens = fe.Ensemble(heads(2, nn.Tanh(), torch.float64))
    x = torch.randn(8, 5, dtype=torch.float64)
    with torch.inference_mode():
        infer = ens(x)
    out = ens(x)
    out.sum().backward()  # a buffer made under inference_mode would refuse to be saved
    # Bitwise on torch 2.7+; torch 2.6 rounds the inference route one ulp apart.
    torch.testing.assert_close(out.detach(), infer, rtol=1e-12, atol=1e-15)


def test_in_place_on_the_output_as_with_the_plain_ops():
    # One output feature: the transposed output is already contiguous, so the caller
    # gets the last layer's own output; modifying it in place must work as with the
    # plain ops (which do not save it) and give the loop's gradients.
    torch.manual_seed(3)
    loop = [nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1)).double() for _ in range(3)]
    ens = fe.Ensemble(loop)
    x = torch.randn(8, 5, dtype=torch.float64)
    out = ens(x)
    out.mul_(2).pow(2).sum().backward()
    sum(m(x).mul_(2).pow(2).sum() for m in loop).backward()
    for name, p in ens.stacked_params().items():
        ref = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
        torch.testing.assert_close(p.grad, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
def test_a_first_layer_stepped_between_two_backward_passes_as_in_the_loop(
    per_member, every_buffer_kept
):
    # Found by an audit: the kept-buffer route saved every layer's weight, the first
    # layer's too, whose input needs no gradient; stepping it between two backward
    # passes of one graph raised autograd's in-place error, where the loop (whose
    # addmm saves the weight only for the input's gradient) runs.
    torch.manual_seed(5)
    loop = [nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 2)).double() for _ in range(3)]
    ens = fe.Ensemble(copy.deepcopy(loop))
    x = torch.randn(*([3] if per_member else []), 10, 6, dtype=torch.float64)
    outs = {
        "ensemble": (ens(x, in_dims=0 if per_member else None), [ens.stacked[0].weight]),
        "loop": (
            torch.stack([m(x[i] if per_member else x) for i, m in enumerate(loop)]),
            [m[0].weight for m in loop],
        ),
    }
    assert every_buffer_kept["apply"] == 2  # both layers took the route under test
    for out, first_weights in outs.values():
        out.pow(2).sum().backward(retain_graph=True)
        with torch.no_grad():
            for w in first_weights:
                w.sub_(0.1 * w.grad)
        out.abs().sum().backward()
    for name, p in ens.stacked_params().items():
        want = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
        torch.testing.assert_close(p.grad, want, **TOL[torch.float64])


@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
def test_batched_gradients_through_kept_buffers_match_the_loop(per_member):
    # torch's legacy vmap runs the backward of is_grads_batched and of vectorized
    # jacobians: the kept buffers' out= kernels have no batching rule there, so fresh
    # tensors are used (layer outputs of 64 KiB and more take the kept buffers).
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4)) for _ in range(4)]
    ens = fe.Ensemble(copy.deepcopy(members))
    x = torch.randn(*((4,) if per_member else ()), 64, 8, requires_grad=True)
    out = ens(x, in_dims=0 if per_member else None)
    v = torch.randn(3, *out.shape)
    (got,) = torch.autograd.grad(out, x, v, is_grads_batched=True)
    outs = [m(x[i] if per_member else x) for i, m in enumerate(members)]
    (want,) = torch.autograd.grad(outs, x, [v[:, i] for i in range(4)], is_grads_batched=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    jac = torch.autograd.functional.jacobian(
        lambda z: ens(z, in_dims=0 if per_member else None).sum(0), x, vectorize=True
    )
    loop = torch.autograd.functional.jacobian(
        lambda z: sum(m(z[i] if per_member else z) for i, m in enumerate(members)),
        x,
        vectorize=True,
    )
    torch.testing.assert_close(jac, loop, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("last", [nn.Sigmoid, nn.Tanh, nn.ReLU], ids=lambda k: k.__name__)
@pytest.mark.parametrize("out", [1, 3])
@pytest.mark.parametrize("rows", [5, 600])  # plain ops, and kept buffers
@pytest.mark.parametrize("norm", [False, True], ids=["fast path", "general path"])
def test_an_output_a_last_activation_saved_can_be_changed_in_place(last, out, rows, norm):
    """The loop's torch.stack hands back a fresh tensor; the ensemble handed back the
    last activation's own output (one output feature on the fast path, always on the
    general path), so y.mul_(2) made backward fail. It is a copy there now."""
    torch.manual_seed(4)

    def make() -> nn.Module:
        middle = nn.LayerNorm(16) if norm else nn.Tanh()
        return nn.Sequential(nn.Linear(5, 16), middle, nn.Linear(16, out), last()).double()

    members = [make() for _ in range(3)]
    loop = copy.deepcopy(members)
    x = torch.randn(rows, 5, dtype=torch.float64)
    ens = fe.Ensemble(members)
    fmodel, params, buffers = fe.stack(loop)
    want = torch.stack([m(x) for m in loop])
    want.mul_(2).pow(2).sum().backward()
    for got in (ens(x), fe.vmap(fmodel)(params, buffers, x)):
        got.mul_(2)
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-12, atol=1e-12)
        got.pow(2).sum().backward()
    for name, p in ens.stacked_params().items():
        ref = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
        torch.testing.assert_close(p.grad, ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(params[name].grad, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("per_member", [False, True])
@pytest.mark.parametrize(
    "act", [nn.Tanh(), nn.ReLU(), nn.Sigmoid()], ids=lambda m: type(m).__name__
)
def test_inference_runs_the_layers_without_autograd_as_the_loop(per_member, act, every_buffer_kept):
    """Under no_grad (or with nothing requiring grad) the kept-buffer layers run their
    kernels directly, without LinearAct: outputs equal the loop's."""
    n = 3
    members = heads(n, act, torch.float64)
    ens = fe.Ensemble(members)
    x = torch.randn(*((n,) if per_member else ()), 11, 5, dtype=torch.float64)
    calls = every_buffer_kept["apply"]
    with torch.no_grad():
        for _ in range(2):  # the second call reuses the kept buffers
            got = ens(x, in_dims=0) if per_member else ens(x)
            want = torch.stack([m(x[i] if per_member else x) for i, m in enumerate(members)])
            torch.testing.assert_close(got, want, **TOL[torch.float64])
    assert every_buffer_kept["apply"] == calls  # no autograd.Function on this path
    assert every_buffer_kept["reused"] > 0
