"""fe.optim.rmsprop against torch.optim.RMSprop run per member."""

import copy

import pytest
import torch
from helpers import runtime_typecheck_off
from test_sgd import STEPS, TOL, N, grads, loss, members, stacked
from torch import nn

import funcensemble as fe

CASES = {
    "plain": [{"lr": 0.01}] * N,
    "momentum_decay": [{"lr": 0.01, "momentum": 0.9, "weight_decay": 0.1, "alpha": 0.9}] * N,
    "centered_maximize": [
        {"lr": 0.005, "centered": True, "momentum": 0.5, "eps": 1e-6, "maximize": True}
    ]
    * N,
    "per_member": [
        {"lr": 0.01, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0},
        {"lr": 0.02, "alpha": 0.9, "eps": 1e-4, "weight_decay": 0.1, "momentum": 0.9},
        {"lr": 0.0, "alpha": 0.5, "eps": 1e-2, "weight_decay": 0.0, "momentum": 0.3},
    ],
    "per_member_centered": [
        {"lr": lr, "alpha": a, "centered": True}
        for lr, a in ((0.01, 0.99), (0.02, 0.8), (0.005, 0.9))
    ],
}
DEFAULTS = {"lr": 0.01, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0}


def ours(case: str) -> fe.optim.GradientTransformation:
    kws = CASES[case]
    out = {}
    for key, default in DEFAULTS.items():
        values = [kw.get(key, default) for kw in kws]
        out[key] = torch.tensor(values, dtype=torch.float64) if len(set(values)) > 1 else values[0]
    return fe.optim.rmsprop(
        **out, centered=kws[0].get("centered", False), maximize=kws[0].get("maximize", False)
    )


def reference(case: str) -> tuple[list[nn.Module], list[torch.optim.RMSprop]]:
    modules = members()
    opts = [
        torch.optim.RMSprop(m.parameters(), **kw)
        for m, kw in zip(modules, CASES[case], strict=True)
    ]
    for step in range(STEPS):
        for i, (m, opt) in enumerate(zip(modules, opts, strict=True)):
            opt.zero_grad()
            loss(m, i, step).backward()
            opt.step()
    return modules, opts


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_rmsprop_per_member(case, in_place):
    ref, ref_opts = reference(case)
    mods = members()
    opt = ours(case)
    params = stacked(mods)
    state = opt.init(params)
    for step in range(STEPS):
        for i, m in enumerate(mods):
            m.zero_grad(set_to_none=True)
            loss(m, i, step).backward()
        g = grads(mods)
        assert g["2.bias"] is None
        if in_place:
            state = opt.update_(g, state, params)
        else:
            updates, state = opt.update(g, state, params)
            assert updates["2.bias"] is None
            params = fe.optim.apply_updates(params, updates)
        with torch.no_grad():
            for i, m in enumerate(mods):
                for k, p in m.named_parameters():
                    p.copy_(params[k][i])
    expected = stacked(ref)
    for k in expected:
        torch.testing.assert_close(params[k], expected[k], **TOL)
    rms = state[0]
    assert isinstance(rms, fe.optim.RMSpropState)
    for k, p in ref[0].named_parameters():
        if not p.requires_grad:
            assert rms.step[k].item() == 0 and not rms.square_avg[k].any()
            continue
        for i, (m, o) in enumerate(zip(ref, ref_opts, strict=True)):
            torch_state = o.state[m.get_parameter(k)]
            assert rms.step[k].item() == torch_state["step"].item() == STEPS
            for field in ("square_avg", "momentum_buffer", "grad_avg"):
                if field in torch_state:
                    torch.testing.assert_close(getattr(rms, field)[k][i], torch_state[field], **TOL)


@pytest.mark.parametrize("case", ["momentum_decay", "centered_maximize", "per_member"])
def test_ensemble_optimizer_matches_torch_rmsprop(case):
    ref = members()
    for m in ref:
        m[2].bias.requires_grad_(True)
    ens = fe.Ensemble(copy.deepcopy(ref))
    opts = [
        torch.optim.RMSprop(m.parameters(), **kw) for m, kw in zip(ref, CASES[case], strict=True)
    ]
    opt = fe.optim.EnsembleOptimizer(ens, ours(case))
    for step in range(STEPS):
        xs = []
        for i, (m, o) in enumerate(zip(ref, opts, strict=True)):
            g = torch.Generator().manual_seed(100 * step + i)
            xs.append(torch.randn(8, 4, generator=g, dtype=torch.float64))
            o.zero_grad()
            m(xs[-1]).pow(2).mean().backward()
            o.step()
        opt.zero_grad()
        ens(torch.stack(xs), in_dims=0).pow(2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    expected = stacked(ref)
    for k, p in ens.stacked_params().items():
        torch.testing.assert_close(p.detach(), expected[k], **TOL)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": -1.0}, ValueError, "Invalid learning rate: -1.0"),
        ({"eps": -1.0}, ValueError, "Invalid epsilon value: -1.0"),
        ({"momentum": -0.5}, ValueError, "Invalid momentum value: -0.5"),
        ({"weight_decay": -0.1}, ValueError, "Invalid weight_decay value: -0.1"),
        ({"alpha": -0.1}, ValueError, "Invalid alpha value: -0.1"),
        ({"alpha": torch.tensor([0.9, -0.1])}, ValueError, "member 1"),
        ({"centered": 1}, TypeError, "centered must be a bool"),
        ({"maximize": "yes"}, TypeError, "maximize must be a bool"),
    ],
)
def test_invalid_hyperparameters_are_refused_at_construction(kwargs, error, match):
    with runtime_typecheck_off(), pytest.raises(error, match=match):
        fe.optim.rmsprop(**kwargs)


def test_state_layout_and_checks():
    params = {"w": torch.zeros(2, 3), "steps": torch.zeros(2, dtype=torch.int64)}
    plain, _ = fe.optim.rmsprop().init(params)
    assert plain.momentum_buffer == {"w": None, "steps": None}
    assert plain.grad_avg == {"w": None, "steps": None}
    full, _ = fe.optim.rmsprop(momentum=0.9, centered=True).init(params)
    assert full.momentum_buffer["w"].shape == full.grad_avg["w"].shape == (2, 3)
    with pytest.raises(ValueError, match="3 per-member values"):
        fe.optim.rmsprop(alpha=torch.full((3,), 0.9)).init(params)
    opt = fe.optim.rmsprop(weight_decay=0.1)
    with pytest.raises(ValueError, match="weight decay needs the parameters"):
        opt.update({"w": torch.ones(2, 3), "steps": None}, opt.init(params))
    with pytest.raises(TypeError, match="expected an RMSpropState"):
        opt.update({"w": torch.ones(2, 3), "steps": None}, (None, fe.optim.EmptyState()), params)


@pytest.mark.parametrize("in_place", [False, True])
def test_float32_matches_torch_rmsprop(in_place):
    torch.manual_seed(0)
    w0 = torch.randn(N, 5, 4)
    alphas = (0.9, 0.99, 0.5)
    opt = fe.optim.rmsprop(lr=0.01, alpha=torch.tensor(alphas), momentum=0.5, centered=True)
    params = {"w": w0.clone()}
    state = opt.init(params)
    ref = [nn.Parameter(w0[i].clone()) for i in range(N)]
    topt = [
        torch.optim.RMSprop([p], lr=0.01, alpha=a, momentum=0.5, centered=True)
        for p, a in zip(ref, alphas, strict=True)
    ]
    for _ in range(STEPS):
        g = torch.randn(N, 5, 4)
        if in_place:
            state = opt.update_({"w": g}, state, params)
        else:
            updates, state = opt.update({"w": g}, state, params)
            params = fe.optim.apply_updates(params, updates)
        for i in range(N):
            ref[i].grad = g[i].clone()
            topt[i].step()
    assert params["w"].dtype == torch.float32
    expected = torch.stack([p.detach() for p in ref])
    torch.testing.assert_close(params["w"], expected, rtol=1e-5, atol=1e-6)


def test_a_members_momentum_set_to_zero_and_back_resumes_its_buffer():
    """Population-based training sets one member's momentum to 0 for a while:
    torch.optim.RMSprop leaves that member's buffer as it was and resumes from it. The
    buffer once took g / avg on those steps (member 0 ended 0.26 off the loop)."""
    n = 2
    torch.manual_seed(0)
    params = {"w": torch.randn(n, 3, dtype=torch.float64)}
    loop = [torch.nn.Parameter(params["w"][i].clone()) for i in range(n)]
    opts = [torch.optim.RMSprop([p], lr=0.01, momentum=0.9, foreach=False) for p in loop]
    per_member = lambda ms: torch.tensor(ms, dtype=torch.float64)  # noqa: E731
    eo = fe.optim.EnsembleOptimizer(params, fe.optim.rmsprop(0.01, momentum=per_member([0.9] * 2)))
    g = torch.Generator().manual_seed(1)
    for momenta in [[0.9, 0.9]] * 3 + [[0.0, 0.9]] * 2 + [[0.9, 0.9]] * 3:
        eo.transform = fe.optim.rmsprop(0.01, momentum=per_member(momenta))
        grads = torch.randn(n, 3, dtype=torch.float64, generator=g)
        for i in range(n):
            opts[i].param_groups[0]["momentum"] = momenta[i]
            loop[i].grad = grads[i].clone()
            opts[i].step()
        params["w"].grad = grads.clone()
        eo.step()
    tol = {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(params["w"], torch.stack([p.detach() for p in loop]), **tol)
    for i in range(n):
        torch.testing.assert_close(
            eo.state[0].momentum_buffer["w"][i], opts[i].state[loop[i]]["momentum_buffer"], **tol
        )


def _momentum_switch(first, then, face):
    """Two members stepped 4 times by fe.optim.rmsprop, its momentum ``first`` for two
    steps and ``then`` after, on ``face``; and by torch.optim.RMSprop per member, with
    the group's momentum set likewise. Returns (ours, the loop's) parameters."""
    n = 2
    torch.manual_seed(0)
    params = {"w": torch.randn(n, 3, dtype=torch.float64)}
    loop = [torch.nn.Parameter(params["w"][i].clone()) for i in range(n)]
    per_member = lambda m: torch.tensor(m, dtype=torch.float64) if isinstance(m, list) else m  # noqa: E731
    each = lambda m, i: m[i] if isinstance(m, list) else m  # noqa: E731
    opts = [torch.optim.RMSprop([p], lr=0.01, momentum=each(first, i)) for i, p in enumerate(loop)]
    transform = fe.optim.rmsprop(0.01, momentum=per_member(first))
    eo = fe.optim.EnsembleOptimizer(params, transform) if face == "EnsembleOptimizer" else None
    state = transform.init(params)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        momentum = first if step < 2 else then
        transform = fe.optim.rmsprop(0.01, momentum=per_member(momentum))
        grads = torch.randn(n, 3, dtype=torch.float64, generator=g)
        before = params["w"].clone()
        try:
            if face == "EnsembleOptimizer":
                eo.transform = transform
                params["w"].grad = grads.clone()
                eo.step()
            elif face == "update_":
                state = transform.update_({"w": grads}, state, params)
            else:
                updates, state = transform.update({"w": grads}, state, params)
                params = fe.optim.apply_updates(params, updates)
        except ValueError:
            assert torch.equal(params["w"], before)  # refused before any change
            raise
        for i in range(n):
            opts[i].param_groups[0]["momentum"] = each(momentum, i)
            loop[i].grad = grads[i].clone()
            opts[i].step()
    return params["w"], torch.stack([p.detach() for p in loop])


@pytest.mark.parametrize("face", ["EnsembleOptimizer", "update_", "update"])
def test_a_momentum_of_zeros_per_member_steps_a_state_made_without_momentum(face):
    """Every member's momentum is still 0, so torch.optim.RMSprop steps on without a
    buffer; this was refused as if momentum had been switched on."""
    ours, loop = _momentum_switch(0.0, [0.0, 0.0], face)
    torch.testing.assert_close(ours, loop, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="holds no buffer"):
        _momentum_switch(0.0, [0.0, 0.9], face)  # torch: KeyError('momentum_buffer')


def test_a_member_whose_momentum_was_zero_from_the_start_starts_its_buffer_at_zero():
    """A [N] momentum gives every member a buffer from the start, zeros for a member
    whose momentum is 0; switched on, it steps from there, which is the loop's step with
    a zero buffer made at the switch (torch.optim.RMSprop made it none: KeyError)."""
    with pytest.raises(KeyError, match="momentum_buffer"):
        _momentum_switch([0.0, 0.5], 0.9, "update")
    ours, _ = _momentum_switch([0.0, 0.5], [0.0, 0.5], "update")
    n = 2
    torch.manual_seed(0)
    w = torch.randn(n, 3, dtype=torch.float64)
    loop = [torch.nn.Parameter(w[i].clone()) for i in range(n)]
    opts = [
        torch.optim.RMSprop([p], lr=0.01, momentum=m) for p, m in zip(loop, [0.0, 0.5], strict=True)
    ]
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = torch.randn(n, 3, dtype=torch.float64, generator=g)
        for i in range(n):
            if step == 2:
                opts[i].param_groups[0]["momentum"] = 0.9
                opts[i].state[loop[i]].setdefault("momentum_buffer", torch.zeros(3, dtype=w.dtype))
            loop[i].grad = grads[i].clone()
            opts[i].step()
    params = {"w": w.clone()}
    transform = fe.optim.rmsprop(0.01, momentum=torch.tensor([0.0, 0.5], dtype=torch.float64))
    state = transform.init(params)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        if step == 2:
            transform = fe.optim.rmsprop(0.01, momentum=0.9)
        grads = torch.randn(n, 3, dtype=torch.float64, generator=g)
        state = transform.update_({"w": grads}, state, params)
    expected = torch.stack([p.detach() for p in loop])
    torch.testing.assert_close(params["w"], expected, rtol=1e-12, atol=1e-14)
    assert not torch.equal(ours, params["w"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"momentum": 0.9}, {"centered": True, "momentum": 0.5, "weight_decay": 0.01}],
    ids=["plain", "momentum", "centered-momentum-decay"],
)
def test_steps_bit_for_bit_as_torch_rmsprop_given_the_same_gradients(dtype, kwargs):
    """fe computed g / avg and then scaled it by -lr, where torch rounds (-lr * g) / avg
    (addcdiv) and param.add_(buf, alpha=-lr): 1 ulp apart on many elements from the first
    step, which RMSprop's dynamics grew past the 1e-12 the docs claimed. Gradients here
    are elementwise functions of the parameters, alike in both runs while they agree."""
    torch.manual_seed(0)
    n, width, lr = 4, 512, 1e-3
    start, c = torch.randn(n, width, dtype=dtype), torch.randn(n, width, dtype=dtype)

    def grad_of(p: torch.Tensor, ci: torch.Tensor) -> torch.Tensor:
        return p * p * p - ci * p + 0.1 * ci

    loop = [start[i].clone().requires_grad_() for i in range(n)]
    opts = [torch.optim.RMSprop([p], lr=lr, **kwargs) for p in loop]
    opt = fe.optim.rmsprop(lr=lr, **kwargs)
    in_place = {"w": start.clone()}
    pure = {"w": start.clone()}
    state_, state = opt.init(in_place), opt.init(pure)
    for _ in range(300):
        for i, p in enumerate(loop):
            p.grad = grad_of(p.detach(), c[i])
            opts[i].step()
        state_ = opt.update_({"w": grad_of(in_place["w"], c)}, state_, in_place)
        updates, state = opt.update({"w": grad_of(pure["w"], c)}, state, pure)
        pure = fe.optim.apply_updates(pure, updates)
    expected = torch.stack([p.detach() for p in loop])
    assert torch.equal(in_place["w"], expected)
    if "momentum" not in kwargs:  # the pure step adds back exactly without momentum
        assert torch.equal(pure["w"], expected)
    else:  # with it, wherever a parameter stays within a factor 2 of where it was
        torch.testing.assert_close(
            pure["w"], expected, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6
        )
    for field in ("square_avg", "momentum_buffer", "grad_avg"):
        if field in opts[0].state[loop[0]]:
            ours = getattr(state_[0], field)["w"]
            assert torch.equal(
                ours, torch.stack([o.state[p][field] for o, p in zip(opts, loop, strict=True)])
            )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("per_member_momentum", [False, True])
def test_per_member_rates_with_momentum_step_bit_for_bit_as_torch_rmsprop(
    dtype, per_member_momentum
):
    """A per-member lr with momentum added buf * -lr (rounded) to the parameter, where
    torch's param.add_(buf, alpha=-lr) rounds once: 1 ulp on 5% of the elements after a
    step, up to 1.4e-6 of the total update after 1,000 float32 steps, where torch's
    flavours agree exactly. A member with momentum 0 steps along g / avg, as torch's."""
    torch.manual_seed(0)
    n, width = 4, 512
    start, c = torch.randn(n, width, dtype=dtype), torch.randn(n, width, dtype=dtype)
    lrs = torch.tensor([1e-3, 3e-3, 1e-2, 3e-4])
    momentum = torch.tensor([0.9, 0.0, 0.3, 0.8]) if per_member_momentum else 0.9

    def grad_of(p: torch.Tensor, ci: torch.Tensor) -> torch.Tensor:
        return p * p * p - ci * p + 0.1 * ci

    loop = [start[i].clone().requires_grad_() for i in range(n)]
    opts = [
        torch.optim.RMSprop(
            [p], lr=float(lrs[i]), momentum=float(momentum[i]) if per_member_momentum else momentum
        )
        for i, p in enumerate(loop)
    ]
    opt = fe.optim.rmsprop(lr=lrs, momentum=momentum)
    params = {"w": start.clone()}
    state = opt.init(params)
    for _ in range(300):
        for i, p in enumerate(loop):
            p.grad = grad_of(p.detach(), c[i])
            opts[i].step()
        state = opt.update_({"w": grad_of(params["w"], c)}, state, params)
    assert torch.equal(params["w"], torch.stack([p.detach() for p in loop]))
