"""Frozen parameters (``requires_grad_(False)`` on the members) against the loop.

The loop trains each member with ``torch.optim`` over all its parameters: a frozen one
never gets a ``.grad``, so the optimizer never touches it or creates state for it.
Every funcensemble path must do the same: ``value_and_grad`` gives it ``None`` and
every optimizer path skips it (weight decay included).
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import funcensemble as fe

N, STEPS = 3, 4
LR, WD = 1e-2, 0.1
TOL = {"rtol": 1e-9, "atol": 1e-11}


class Scaled(nn.Module):
    """An MLP times a learned 0-dim scale (not a plain MLP: the general vmap path)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))  # the MLP fast path


# Architecture -> (factory, the parameters to freeze).
ARCHS = {
    "mlp, frozen first layer and last bias": (_mlp, ["0.weight", "0.bias", "2.bias"]),
    "scaled, frozen first layer and 0-dim scale": (
        Scaled,
        ["body.0.weight", "body.0.bias", "scale"],
    ),
}


def make_members(arch: str) -> tuple[list[nn.Module], list[str]]:
    factory, frozen = ARCHS[arch]
    torch.manual_seed(0)
    members = [factory().double() for _ in range(N)]
    for m in members:
        params = dict(m.named_parameters())
        for name in frozen:
            params[name].requires_grad_(False)
    return members, frozen


def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(16, 4, dtype=torch.float64), torch.randn(N, 16, 2, dtype=torch.float64)


def loop_training(members, make_opt):
    """Each member alone with its own torch.optim optimizer over all its parameters."""
    x, y = data()
    opts = [make_opt(m.parameters()) for m in members]
    for _ in range(STEPS):
        for m, opt, target in zip(members, opts, y, strict=True):
            opt.zero_grad()
            F.mse_loss(m(x), target).backward()
            opt.step()
    return opts


def stacked(members) -> dict[str, torch.Tensor]:
    return {
        k: torch.stack([dict(m.named_parameters())[k].detach() for m in members])
        for k, _ in members[0].named_parameters()
    }


def _fe_opt(kind: str) -> fe.optim.GradientTransformation:
    if kind == "adam":
        return fe.optim.adam(lr=LR, weight_decay=WD)
    if kind == "adamw":
        return fe.optim.adamw(lr=LR, weight_decay=WD)
    # "other transforms": SGD with L2 weight decay, composed from the small transforms.
    return fe.optim.chain(fe.optim.add_decayed_weights(WD), fe.optim.scale_by_learning_rate(LR))


_TORCH = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=LR, weight_decay=WD),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=LR, weight_decay=WD),
}


def _adam_state_of(state):
    return next(s for s in state if isinstance(s, fe.optim.AdamState))


def _check_state(kind, state, fresh, opts, frozen, names):
    """Frozen leaves' state as init left it; trainable moments as torch.optim's."""
    if kind == "sgd":
        return
    adam, init = _adam_state_of(state), _adam_state_of(fresh)
    for k in frozen:
        assert torch.equal(adam.count[k], init.count[k]), k
        assert torch.equal(adam.mu[k], init.mu[k]) and torch.equal(adam.nu[k], init.nu[k]), k
    for k in names:
        if k in frozen:
            continue
        ref = [o.state[dict(zip(names, o.param_groups[0]["params"], strict=True))[k]] for o in opts]
        assert adam.count[k].item() == STEPS
        torch.testing.assert_close(adam.mu[k], torch.stack([s["exp_avg"] for s in ref]), **TOL)
        torch.testing.assert_close(adam.nu[k], torch.stack([s["exp_avg_sq"] for s in ref]), **TOL)
    for o in opts:  # the loop never made state for a frozen parameter either
        assert len(o.state) == len(names) - len(frozen)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("path", ["pure", "pure, chunked", "update_", "EnsembleOptimizer"])
def test_functional_training_with_frozen_parameters_matches_loop(arch, kind, path):
    members, frozen = make_members(arch)
    names = [k for k, _ in members[0].named_parameters()]
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))
    initial = {k: params[k].clone() for k in frozen}
    opts = loop_training(members, _TORCH[kind])
    x, y = data()
    opt = _fe_opt(kind)
    state, fresh = opt.init(params), opt.init(params)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    step = fe.value_and_grad(loss_fn, (None, 0), chunk_size=2 if "chunked" in path else None)
    driver = fe.optim.EnsembleOptimizer(params, opt) if path == "EnsembleOptimizer" else None
    for _ in range(STEPS):
        _, grads, buffers = step(params, buffers, x, y)
        assert all(grads[k] is None for k in frozen)
        if path.startswith("pure"):
            updates, state = opt.update(grads, state, params)
            assert all(updates[k] is None for k in frozen)
            params = fe.optim.apply_updates(params, updates)
        elif path == "update_":
            state = opt.update_(grads, state, params)
        else:
            for k, p in params.items():
                p.grad = grads[k]
            driver.step()
            state = driver.state
    for k in frozen:
        assert torch.equal(params[k], initial[k]), k
        assert not params[k].requires_grad
    torch.testing.assert_close(params, stacked(members), **TOL)
    _check_state(kind, state, fresh, opts, frozen, names)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("optimizer", ["torch.optim", "EnsembleOptimizer"])
def test_module_face_training_with_frozen_parameters_matches_loop(arch, kind, optimizer):
    members, frozen = make_members(arch)
    ens = fe.Ensemble(copy.deepcopy(members))
    initial = {k: ens.stacked_params()[k].detach().clone() for k in frozen}
    loop_training(members, _TORCH[kind])
    x, y = data()
    if optimizer == "torch.optim":
        opt = _TORCH[kind](ens.parameters())
    else:
        opt = fe.optim.EnsembleOptimizer(ens, _fe_opt(kind))
    for _ in range(STEPS):
        opt.zero_grad()
        out = ens(x)
        # The members' losses add up: each member's gradient is its own loss's.
        sum(F.mse_loss(out[i], y[i]) for i in range(N)).backward()
        assert all(ens.stacked_params()[k].grad is None for k in frozen)
        opt.step()
    got = {k: v.detach() for k, v in ens.stacked_params().items()}
    for k in frozen:
        assert torch.equal(got[k], initial[k]), k
    torch.testing.assert_close(got, stacked(members), **TOL)
    if optimizer == "torch.optim":
        assert len(opt.state) == len(got) - len(frozen)
    else:  # the frozen leaves' state is as init made it
        adam = _adam_state_of(opt.state)
        for k in frozen:
            assert adam.count[k].item() == 0, k
            assert not adam.mu[k].any() and not adam.nu[k].any(), k


def test_frozen_parameters_inside_a_torch_func_transform_get_none():
    """Under another transform (torch.func.grad inside), frozen leaves still get None."""
    members, frozen = make_members("scaled, frozen first layer and 0-dim scale")
    fmodel, params, buffers = fe.stack(members)
    x, y = data()

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    _, eager, _ = fe.value_and_grad(loss_fn, (None, 0))(params, buffers, x, y)
    seen = []

    def via_transform(x):
        _, grads, _ = fe.value_and_grad(loss_fn, (None, 0))(params, buffers, x, y)
        seen.append(sorted(k for k, g in grads.items() if g is None))
        return {k: g for k, g in grads.items() if g is not None}  # vmap returns tensors

    nested = torch.func.vmap(via_transform)(x.unsqueeze(0))
    assert seen == [sorted(frozen)]
    assert all(eager[k] is None for k in frozen)
    assert nested.keys() == eager.keys() - set(frozen)
    for k, g in nested.items():
        torch.testing.assert_close(g[0], eager[k], **TOL)


def test_plain_tensors_without_requires_grad_are_all_differentiated():
    """No leaf requires grad (detached copies): every float leaf is differentiated."""
    members, _ = make_members("mlp, frozen first layer and last bias")
    for m in members:
        m.requires_grad_(True)
    fmodel, params, buffers = fe.stack(members)
    x, y = data()

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    _, ref, _ = fe.value_and_grad(loss_fn, (None, 0))(params, buffers, x, y)
    plain = {k: v.detach() for k, v in params.items()}
    _, got, _ = fe.value_and_grad(loss_fn, (None, 0))(plain, buffers, x, y)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.slow  # the first use of fe.distributed imports torch.distributed.checkpoint
def test_sharded_training_with_frozen_parameters_matches_loop():
    """ShardedEnsemble.step_ (value_and_grad + update + apply_updates on each shard)."""
    members, frozen = make_members("scaled, frozen first layer and 0-dim scale")
    sharded = fe.distributed.ShardedEnsemble(copy.deepcopy(members), ["cpu", "cpu"])
    loop_training(members, _TORCH["adamw"])
    x, y = data()
    opt = _fe_opt("adamw")
    state = sharded.init_optimizer(opt)

    def loss_fn(p, b, x, y):
        return F.mse_loss(sharded.fmodel(p, b, x), y)

    initial = {k: sharded.to_ensemble().stacked_params()[k].detach().clone() for k in frozen}
    for _ in range(STEPS):
        _, state = sharded.step_(loss_fn, opt, state, x, y, in_dims=(None, 0))
    got = {k: v.detach() for k, v in sharded.to_ensemble().stacked_params().items()}
    for k in frozen:
        assert torch.equal(got[k], initial[k]), k
    torch.testing.assert_close(got, stacked(members), **TOL)
