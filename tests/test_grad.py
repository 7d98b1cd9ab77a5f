"""fe.value_and_grad / fe.grad against torch.autograd.grad on each module, one at a time."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import funcensemble as fe

TOL = {"rtol": 1e-10, "atol": 1e-12}


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        self.unused = nn.Parameter(torch.randn(3))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def make_members(n: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [WithUnused().double() for _ in range(n)]


def loop_reference(modules, xs, ys, per_member: bool):
    losses, grads = [], []
    for i, m in enumerate(modules):
        x, y = (xs[i], ys[i]) if per_member else (xs, ys)
        loss = F.mse_loss(m(x), y)
        names = [k for k, _ in m.named_parameters()]
        g = torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)
        losses.append(loss.detach())
        grads.append(dict(zip(names, g, strict=True)))
    return torch.stack(losses), grads


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("per_member", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_value_and_grad_matches_loop(n, per_member, chunk_size):
    modules = make_members(n)
    fmodel, params, buffers = fe.stack(modules)
    before = {k: v.clone() for k, v in buffers.items()}
    shape = (n, 16) if per_member else (16,)
    xs = torch.randn(*shape, 4, dtype=torch.float64)
    ys = torch.randn(*shape, 1, dtype=torch.float64)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    in_dims = 0 if per_member else None
    step = fe.value_and_grad(loss_fn, in_dims, chunk_size=chunk_size)
    losses, grads, new_buffers = step(params, buffers, xs, ys)

    ref_losses, ref_grads = loop_reference(modules, xs, ys, per_member)
    torch.testing.assert_close(losses, ref_losses, **TOL)
    for i in range(n):
        for name, g in ref_grads[i].items():
            if g is None:
                assert grads[name] is None, name
            else:
                torch.testing.assert_close(grads[name][i], g, **TOL)
    # The loop's forward updated each module's BatchNorm statistics: so did ours, in a
    # fresh buffers dict, while the input buffers stay untouched (pure step).
    for name, t in before.items():
        assert torch.equal(buffers[name], t)
        ref = torch.stack([dict(m.named_buffers())[name] for m in modules])
        torch.testing.assert_close(new_buffers[name], ref, **TOL)
    assert new_buffers["body.1.num_batches_tracked"].tolist() == [1] * n
    assert losses.grad_fn is None and not any(
        g is not None and g.grad_fn is not None for g in grads.values()
    )


def test_grad_has_aux_and_kwargs():
    modules = make_members(3)
    fmodel, params, buffers = fe.stack(modules)
    x = torch.randn(8, 4, dtype=torch.float64)

    def loss_fn(p, b, x, *, target):
        out = fmodel(p, b, x)
        return (out - target).pow(2).mean(), {"out": out}

    grads, _, aux = fe.grad(loss_fn, has_aux=True)(params, buffers, x, target=1.0)
    assert aux["out"].shape == (3, 8, 1)
    assert aux["out"].grad_fn is None
    ref = [torch.autograd.grad((m(x) - 1.0).pow(2).mean(), m.scale)[0] for m in modules]
    torch.testing.assert_close(grads["scale"], torch.stack(ref), **TOL)


def test_functorch_path_matches_autograd_path():
    """Inside another torch.func transform fe.grad switches to torch.func.grad."""
    modules = make_members(3)
    for m in modules:
        m.eval()
    fmodel, params, buffers = fe.stack(modules)
    x = torch.randn(8, 4, dtype=torch.float64)

    def loss_fn(p, b, x):
        return fmodel(p, b, x).pow(2).mean()

    _, eager, _ = fe.value_and_grad(loss_fn)(params, buffers, x)

    def via_transform(x):
        losses, grads, _ = fe.value_and_grad(loss_fn)(params, buffers, x)
        return grads["body.0.weight"], losses

    # jacrev needs no grads of x here; vmap over a batch of one input is the simplest
    # enclosing transform.
    nested, _ = torch.func.vmap(via_transform)(x.unsqueeze(0))
    torch.testing.assert_close(nested[0], eager["body.0.weight"], **TOL)
    # torch.func.grad reports unused parameters as zeros, not None.
    _, grads_t, _ = torch.func.vmap(lambda x: fe.value_and_grad(loss_fn)(params, buffers, x))(
        x.unsqueeze(0)
    )
    assert torch.equal(grads_t["unused"], torch.zeros(1, 3, 3, dtype=torch.float64))
    assert eager["unused"] is None


def test_losses_must_be_scalar_per_member():
    fmodel, params, buffers = fe.stack([nn.Linear(2, 2) for _ in range(2)])
    step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x))
    with pytest.raises(ValueError, match=r"one scalar per member, got \(5, 2\)"):
        step(params, buffers, torch.randn(5, 2))


def test_adam_training_step_matches_loop():
    """fe.value_and_grad drives torch.optim.Adam on the stacked leaves like the loop."""
    # No BatchNorm here: a bias right before BatchNorm has a gradient of pure round-off,
    # which Adam's normalisation blows up to +-lr, so no tolerance would be meaningful.
    torch.manual_seed(0)
    modules = [
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double() for _ in range(3)
    ]
    clones = copy.deepcopy(modules)
    fmodel, params, buffers = fe.stack(clones)
    opt = torch.optim.Adam(params.values(), lr=1e-2)
    ref_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in modules]
    x = torch.randn(16, 4, dtype=torch.float64)
    y = torch.randn(16, 1, dtype=torch.float64)
    step = fe.value_and_grad(lambda p, b, x, y: F.mse_loss(fmodel(p, b, x), y))
    for _ in range(5):
        _, grads, buffers = step(params, buffers, x, y)
        for k, p in params.items():
            p.grad = grads[k]
        opt.step()
        for m, o in zip(modules, ref_opts, strict=True):
            o.zero_grad(set_to_none=True)
            F.mse_loss(m(x), y).backward()
            o.step()
    for k, p in params.items():
        ref = torch.stack([dict(m.named_parameters())[k].detach() for m in modules])
        torch.testing.assert_close(p.detach(), ref, rtol=1e-9, atol=1e-10)
