"""fe.optim.sgd against torch.optim.SGD run per member."""

import copy

import optree
import pytest
import torch
from helpers import runtime_typecheck_off, skip_unless_dynamo_traces_optree
from torch import nn

import funcensemble as fe

N = 3
STEPS = 6
TOL = {"rtol": 1e-12, "atol": 1e-12}


def members() -> list[nn.Module]:
    torch.manual_seed(0)
    out = []
    for _ in range(N):
        m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
        m[2].bias.requires_grad_(False)  # a frozen leaf: no gradient, skipped
        out.append(m)
    return out


def loss(m: nn.Module, i: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + i)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    return m(x).pow(2).mean()


def stacked(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    names = [k for k, _ in modules[0].named_parameters()]
    return {k: torch.stack([m.get_parameter(k).detach() for m in modules]) for k in names}


def grads(modules: list[nn.Module]) -> dict[str, torch.Tensor | None]:
    out = {}
    for k, p in modules[0].named_parameters():
        out[k] = None if p.grad is None else torch.stack([m.get_parameter(k).grad for m in modules])
    return out


# Per member: one dict of torch.optim.SGD keyword arguments per member.
CASES = {
    "plain": [{"lr": 0.1}] * N,
    "momentum": [{"lr": 0.1, "momentum": 0.9}] * N,
    "dampening_decay": [{"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1}] * N,
    "nesterov_maximize": [
        {"lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "maximize": True}
    ]
    * N,
    "per_member": [
        {"lr": 0.1, "momentum": 0.0, "dampening": 0.5, "weight_decay": 0.0},
        {"lr": 0.05, "momentum": 0.9, "dampening": 0.5, "weight_decay": 0.2},
        {"lr": 0.01, "momentum": 0.5, "dampening": 0.0, "weight_decay": 0.0},
    ],
    "per_member_nesterov": [
        {"lr": lr, "momentum": m, "nesterov": True}
        for lr, m in ((0.1, 0.9), (0.05, 0.5), (0.0, 0.1))
    ],
}


def ours(case: str) -> fe.optim.GradientTransformation:
    kws = CASES[case]
    out = {}
    for key in ("lr", "momentum", "dampening", "weight_decay"):
        values = [kw.get(key, 0.0) for kw in kws]
        out[key] = torch.tensor(values, dtype=torch.float64) if len(set(values)) > 1 else values[0]
    return fe.optim.sgd(
        **out, nesterov=kws[0].get("nesterov", False), maximize=kws[0].get("maximize", False)
    )


def reference(case: str) -> tuple[list[nn.Module], list[torch.optim.SGD]]:
    modules = members()
    opts = [
        torch.optim.SGD(m.parameters(), **kw) for m, kw in zip(modules, CASES[case], strict=True)
    ]
    for step in range(STEPS):
        for i, (m, opt) in enumerate(zip(modules, opts, strict=True)):
            opt.zero_grad()
            loss(m, i, step).backward()
            opt.step()
    return modules, opts


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_sgd_per_member(case, in_place):
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
    sgd_state = state[0]
    assert isinstance(sgd_state, fe.optim.SGDState)
    for k, p in ref[0].named_parameters():
        if not p.requires_grad:
            assert sgd_state.count[k] is None or sgd_state.count[k].item() == 0
            continue
        # One count per member once a per-member momentum holding 0 has stepped: a
        # member with momentum 0 takes no momentum update (torch.optim keeps no buffer).
        count = sgd_state.count[k]
        momenta = [kw.get("momentum", 0.0) for kw in CASES[case]]
        if count.dim() == 0:
            assert len(set(momenta)) == 1 or 0.0 not in momenta
            assert count.item() == (STEPS if momenta[0] else 0)  # momentum updates taken
        else:
            assert count.tolist() == [STEPS if m else 0 for m in momenta]
        for i, (m, o) in enumerate(zip(ref, ref_opts, strict=True)):
            buf = o.state[m.get_parameter(k)].get("momentum_buffer")
            if buf is not None:
                torch.testing.assert_close(sgd_state.momentum_buffer[k][i], buf, **TOL)


def test_update_and_update_agree_exactly():
    # Exactly while each step keeps the parameters within a factor 2, as here (see
    # test_update_adds_back_torchs_step_exactly_within_a_factor_2 for elsewhere).
    opt = fe.optim.sgd(lr=torch.tensor([0.1, 0.2]), momentum=0.9, weight_decay=0.1)
    torch.manual_seed(0)
    p1 = {"w": torch.randn(2, 3, dtype=torch.float64)}
    p2 = {"w": p1["w"].clone()}
    s1, s2 = opt.init(p1), opt.init(p2)
    for _ in range(3):
        g = {"w": torch.randn(2, 3, dtype=torch.float64)}
        u, s1 = opt.update(g, s1, p1)
        p1 = fe.optim.apply_updates(p1, u)
        s2 = opt.update_(g, s2, p2)
    assert torch.equal(p1["w"], p2["w"])
    assert torch.equal(s1[0].momentum_buffer["w"], s2[0].momentum_buffer["w"])


@pytest.mark.parametrize("case", ["momentum", "nesterov_maximize", "per_member"])
def test_ensemble_optimizer_matches_torch_sgd(case):
    ref = members()
    for m in ref:
        m[2].bias.requires_grad_(True)
    ens = fe.Ensemble(copy.deepcopy(ref))
    opts = [torch.optim.SGD(m.parameters(), **kw) for m, kw in zip(ref, CASES[case], strict=True)]
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
        ({"momentum": -0.5}, ValueError, "Invalid momentum value: -0.5"),
        ({"weight_decay": torch.tensor([0.1, -0.1])}, ValueError, "member 1"),
        ({"dampening": torch.ones(2, 2)}, ValueError, r"shape \[N\]"),
        ({"nesterov": True}, ValueError, "Nesterov momentum requires a momentum"),
        ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, ValueError, "zero dampening"),
        (
            {"nesterov": True, "momentum": torch.tensor([0.9, 0.0])},
            ValueError,
            "Nesterov momentum requires",
        ),
        ({"nesterov": 1}, TypeError, "nesterov must be a bool"),
        ({"maximize": "yes"}, TypeError, "maximize must be a bool"),
        ({"momentum": "0.9"}, TypeError, "momentum must be a float"),
    ],
)
def test_invalid_hyperparameters_are_refused_at_construction(kwargs, error, match):
    with runtime_typecheck_off(), pytest.raises(error, match=match):
        fe.optim.sgd(**{"lr": 0.1, **kwargs})


def test_torch_refuses_what_sgd_refuses():
    w = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        torch.optim.SGD(w, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="Invalid momentum value"):
        torch.optim.SGD(w, lr=0.1, momentum=-0.5)


def test_state_layout_and_checks():
    params = {"w": torch.zeros(2, 3), "steps": torch.zeros(2, dtype=torch.int64)}
    plain, _ = fe.optim.sgd(lr=0.1).init(params)
    moving, _ = fe.optim.sgd(lr=0.1, momentum=torch.tensor([0.0, 0.9])).init(params)
    assert plain.momentum_buffer == {"w": None, "steps": None}
    assert moving.momentum_buffer["w"].shape == (2, 3) and moving.momentum_buffer["steps"] is None
    opt = fe.optim.sgd(lr=torch.ones(3))
    with pytest.raises(ValueError, match="3 per-member values"):
        opt.init(params)
    opt = fe.optim.sgd(lr=0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match="weight decay needs the parameters"):
        opt.update({"w": torch.ones(2, 3), "steps": None}, opt.init(params))
    with pytest.raises(TypeError, match="expected an SGDState"):
        opt.update({"w": torch.ones(2, 3), "steps": None}, (None, fe.optim.EmptyState()), params)


def test_schedule_lr_matches_lambda_lr():
    torch.manual_seed(0)
    w0 = torch.randn(2, 3, dtype=torch.float64)
    opt = fe.optim.sgd(lr=lambda count: 0.1 * 0.5 ** count.item(), momentum=0.9)
    params = {"w": w0.clone()}
    state = opt.init(params)
    ref = [nn.Parameter(w0[i].clone()) for i in range(2)]
    topt = [torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in ref]
    sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda c: 0.5**c) for o in topt]
    for step in range(4):
        g = torch.randn(2, 3, dtype=torch.float64)
        state = opt.update_({"w": g}, state, params)
        for i in range(2):
            ref[i].grad = g[i].clone()
            topt[i].step()
            sched[i].step()
        del step
    torch.testing.assert_close(params["w"], torch.stack([p.detach() for p in ref]), **TOL)


@pytest.mark.parametrize("in_place", [False, True])
def test_float32_matches_torch_sgd(in_place):
    torch.manual_seed(0)
    w0 = torch.randn(N, 5, 4)
    opt = fe.optim.sgd(lr=torch.tensor([0.1, 0.05, 0.01]), momentum=0.9, nesterov=True)
    params = {"w": w0.clone()}
    state = opt.init(params)
    ref = [nn.Parameter(w0[i].clone()) for i in range(N)]
    lrs = (0.1, 0.05, 0.01)
    topt = [
        torch.optim.SGD([p], lr=lr, momentum=0.9, nesterov=True)
        for p, lr in zip(ref, lrs, strict=True)
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
    torch.testing.assert_close(params["w"], expected, rtol=1e-6, atol=1e-6)


# Population-based training explores by swapping the transform for one with new values
# (docs/how-to/surgery.md); torch.optim by setting the group's momentum. A member with
# momentum 0 has no buffer there, and one is started afresh (the gradient itself) when
# its momentum becomes non-zero; a member whose momentum drops to 0 keeps its buffer
# untouched and resumes it when its momentum comes back.
MOMENTA = [
    ([0.0, 0.5, 0.9], [0.9, 0.9, 0.0], [0.3, 0.0, 0.8]),  # per member, zeros moving about
    (0.0, [0.9, 0.0, 0.5], 0.7),  # the float 0: a state without buffers, then per member
    (0.0, 0.9, 0.0),  # floats only
    ([0.5, 0.9, 0.7], 0.8),  # no zero: Nesterov in every phase
]


def batches(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step)
    return torch.randn(N, 8, 4, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("phases", MOMENTA, ids=str)
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("face", ["update", "update_", "EnsembleOptimizer"])
def test_momentum_changed_mid_training_matches_the_loop(phases, nesterov, face):
    loop, ours = members(), members()
    torch_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in loop]
    ens = fe.Ensemble(ours) if face == "EnsembleOptimizer" else None
    fmodel, params, buffers = fe.stack(ours)
    value_and_grad = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).pow(2).mean(), in_dims=(0,))
    opt = state = None
    step = 0
    for momentum in phases:
        per_member = isinstance(momentum, list)
        values = momentum if per_member else [momentum] * N
        with_nesterov = nesterov and 0.0 not in values  # it needs momentum > 0
        m = torch.tensor(momentum, dtype=torch.float64) if per_member else momentum
        tx = fe.optim.sgd(lr=0.1, momentum=m, nesterov=with_nesterov)
        for o, v in zip(torch_opts, values, strict=True):
            o.param_groups[0].update(momentum=v, nesterov=with_nesterov)
        if face == "EnsembleOptimizer":
            if opt is None:
                opt = fe.optim.EnsembleOptimizer(ens, tx)
            opt.transform = tx
        elif state is None:
            state = tx.init(params)
        for _ in range(3):
            step += 1
            x = batches(step)
            for i, (mod, o) in enumerate(zip(loop, torch_opts, strict=True)):
                o.zero_grad()
                mod(x[i]).pow(2).mean().backward()
                o.step()
            if face == "EnsembleOptimizer":
                opt.zero_grad()
                ens(x, in_dims=0).pow(2).mean(dim=(1, 2)).sum().backward()
                opt.step()
                continue
            _, grads, _ = value_and_grad(params, buffers, x)
            if face == "update_":
                state = tx.update_(grads, state, params)
            else:
                updates, state = tx.update(grads, state, params)
                params = fe.optim.apply_updates(params, updates)
    if ens is not None:
        params = {k: v.detach() for k, v in ens.stacked_params().items()}
    torch.testing.assert_close(params, stacked(loop), **TOL)


@pytest.mark.parametrize(
    "make, later",
    [
        (lambda: fe.optim.rmsprop(0.01), lambda: fe.optim.rmsprop(0.01, centered=True)),
        (lambda: fe.optim.rmsprop(0.01), lambda: fe.optim.rmsprop(0.01, momentum=0.9)),
        (lambda: fe.optim.adam(0.01), lambda: fe.optim.adam(0.01, amsgrad=True)),
    ],
    ids=["rmsprop-centered", "rmsprop-momentum", "adam-amsgrad"],
)
def test_switching_on_a_buffer_torch_optim_cannot_switch_on_is_refused_before_a_change(make, later):
    # torch.optim creates these buffers at a parameter's first step only (a KeyError
    # after); here a clear error, and nothing stepped.
    ens = fe.Ensemble(members())
    opt = fe.optim.EnsembleOptimizer(ens, make())
    ens(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    opt.transform = later()
    before = {k: v.detach().clone() for k, v in ens.stacked_params().items()}
    with pytest.raises(ValueError, match=r"the state holds no buffer for .* torch.optim cannot"):
        opt.step()
    torch.testing.assert_close(
        {k: v.detach() for k, v in ens.stacked_params().items()}, before, rtol=0, atol=0
    )


@pytest.mark.parametrize("make", ["sgd", "rmsprop", "chain"])
@pytest.mark.parametrize("in_place", [True, False])
def test_a_refused_schedule_value_leaves_every_state_as_it_was(make, in_place):
    """sgd and rmsprop are chains of a direction and a learning rate: the schedule's
    value is checked by the last step, after the direction ran. In place, the
    direction's new state is copied in only once the last step has run, so a refused
    value (4 rates for 3 members here) changes nothing (the momentum buffers moved by
    0.16 before)."""
    n = 3

    def schedule(count):
        return torch.full((n if int(count) < 2 else n + 1,), 0.1, dtype=torch.float64)

    if make == "sgd":
        opt = fe.optim.sgd(lr=schedule, momentum=0.9)
    elif make == "rmsprop":
        opt = fe.optim.rmsprop(lr=schedule, momentum=0.9)
    else:
        opt = fe.optim.chain(
            fe.optim.scale_by_adam(),
            fe.optim.clip_by_global_norm(1.0),
            fe.optim.scale_by_learning_rate(schedule),
        )
    torch.manual_seed(0)
    params = {"w": torch.randn(n, 4, 2, dtype=torch.float64)}
    state = opt.init(params)
    for _ in range(2):
        grads = {"w": torch.randn(n, 4, 2, dtype=torch.float64)}
        if in_place:
            state = opt.update_(grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            params = fe.optim.apply_updates(params, updates)
    before = [t.clone() for t in optree.tree_leaves(state)]
    ids = [id(t) for t in optree.tree_leaves(state)]
    kept = params["w"].clone()
    with pytest.raises(ValueError, match="lr has 4 per-member values"):
        if in_place:
            opt.update_({"w": torch.ones(n, 4, 2, dtype=torch.float64)}, state, params)
        else:
            opt.update({"w": torch.ones(n, 4, 2, dtype=torch.float64)}, state, params)
    after = optree.tree_leaves(state)
    assert [id(t) for t in after] == ids
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(params["w"], kept)


def test_a_float_zero_momentum_phase_leaves_unstarted_buffers_unstarted():
    """sgd(momentum=[0, 0.9]), then the float 0, then [0.9, 0.9]: member 0 has never
    taken a momentum update, so torch.optim.SGD starts its buffer at the gradient
    itself. The float-0 phase once advanced its count, and it blended 0.9 * 0 + 0.5 * g
    instead (0.13 off the loop)."""
    n = 2
    torch.manual_seed(0)
    params = {"w": torch.randn(n, 3, dtype=torch.float64)}
    loop = [torch.nn.Parameter(params["w"][i].clone()) for i in range(n)]
    opts = [
        torch.optim.SGD([p], lr=0.1, momentum=m, dampening=0.5)
        for p, m in zip(loop, [0.0, 0.9], strict=True)
    ]
    per_member = lambda ms: torch.tensor(ms, dtype=torch.float64)  # noqa: E731
    phases = [(per_member([0.0, 0.9]), 2), (0.0, 2), (per_member([0.9, 0.9]), 2)]
    state = fe.optim.sgd(0.1, momentum=phases[0][0], dampening=0.5).init(params)
    g = torch.Generator().manual_seed(1)
    for momentum, steps in phases:
        opt = fe.optim.sgd(0.1, momentum=momentum, dampening=0.5)
        for _ in range(steps):
            grads = torch.randn(n, 3, dtype=torch.float64, generator=g)
            for i in range(n):
                m = float(momentum[i]) if isinstance(momentum, torch.Tensor) else momentum
                opts[i].param_groups[0]["momentum"] = m
                loop[i].grad = grads[i].clone()
                opts[i].step()
            state = opt.update_({"w": grads}, state, params)
    want = torch.stack([p.detach() for p in loop])
    torch.testing.assert_close(params["w"], want, rtol=1e-12, atol=1e-14)
    assert state[0].count["w"].tolist() == [2.0, 4.0]  # momentum updates each member took


# torch.optim.SGD's keyword arguments per member (four members), for the bit-for-bit tests.
M = 4
GRID = {
    "plain": [{"lr": 0.01}] * M,
    "momentum": [{"lr": 0.01, "momentum": 0.9}] * M,
    "dampening_decay": [{"lr": 0.01, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1}] * M,
    "nesterov_decay_maximize": [
        {"lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "maximize": True}
    ]
    * M,
    "per_member": [
        {"lr": lr, "momentum": m, "dampening": d, "weight_decay": wd}
        for lr, m, d, wd in (
            (0.01, 0.0, 0.5, 0.0),
            (0.03, 0.9, 0.5, 0.2),
            (0.003, 0.5, 0.0, 0.01),
            (0.0, 0.99, 0.1, 0.1),
        )
    ],
    "per_member_nesterov": [
        {"lr": lr, "momentum": m, "nesterov": True}
        for lr, m in ((0.01, 0.9), (0.02, 0.5), (0.005, 0.1), (0.013, 0.99))
    ],
}


def grid_sgd(case: str, lr: object = None) -> fe.optim.GradientTransformation:
    kws = GRID[case]
    out = {}
    for key in ("lr", "momentum", "dampening", "weight_decay"):
        values = [kw.get(key, 0.0) for kw in kws]
        out[key] = torch.tensor(values, dtype=torch.float64) if len(set(values)) > 1 else values[0]
    if lr is not None:
        out["lr"] = lr
    return fe.optim.sgd(
        **out, nesterov=kws[0].get("nesterov", False), maximize=kws[0].get("maximize", False)
    )


def grad_of(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """An elementwise gradient of the parameter (exact ops only: alike in both runs while
    the parameters agree); its ascent under ``maximize`` stays bounded as well."""
    return (p - c) * (1.0 + 0.1 * p * p)


def run_torch(case, start, c, steps, schedule=None):
    loop = [torch.nn.Parameter(start[i].clone()) for i in range(M)]
    opts = [torch.optim.SGD([p], **kw) for p, kw in zip(loop, GRID[case], strict=True)]
    for t in range(steps):
        for i, (p, o) in enumerate(zip(loop, opts, strict=True)):
            if schedule is not None:
                o.param_groups[0]["lr"] = float(schedule(t))
            sign = -1.0 if GRID[case][i].get("maximize", False) else 1.0
            p.grad = sign * grad_of(p.detach(), c[i])
            o.step()
    bufs = [o.state[p].get("momentum_buffer") for o, p in zip(opts, loop, strict=True)]
    return torch.stack([p.detach() for p in loop]), bufs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", [*GRID, "schedule"])
@pytest.mark.parametrize("face", ["update_", "EnsembleOptimizer"])
def test_steps_bit_for_bit_as_torch_sgd_given_the_same_gradients(face, case, dtype):
    """fe scaled the direction by -lr and then added it (two roundings), where torch.optim
    steps with param.add_(direction, alpha=-lr), one: 20 to 36 float32 ulps apart after
    300 steps. The rate now folds into torch's own operation, per-member rates by addcmul_
    (which rounds alike), schedules' values too."""
    torch.manual_seed(0)
    steps, schedule = 300, None
    if case == "schedule":
        schedule = fe.optim.warmup_cosine(0.03, 20, 250, start_factor=0.1, min_lr=1e-3)
    start = torch.randn(M, 257, dtype=torch.float64).to(dtype)
    c = torch.randn(M, 257, dtype=torch.float64).to(dtype)
    grid = "momentum" if case == "schedule" else case
    expected, bufs = run_torch(grid, start, c, steps, schedule)
    opt = grid_sgd(grid, schedule)
    sign = -1.0 if GRID[grid][0].get("maximize", False) else 1.0
    if face == "update_":
        params = {"w": start.clone()}
        state = opt.init(params)
        for _ in range(steps):
            state = opt.update_({"w": sign * grad_of(params["w"], c)}, state, params)
    else:
        params = {"w": torch.nn.Parameter(start.clone())}
        eo = fe.optim.EnsembleOptimizer(params, opt)
        for _ in range(steps):
            params["w"].grad = sign * grad_of(params["w"].detach(), c)
            eo.step()
        state = eo.state
    assert torch.isfinite(expected).all()
    assert torch.equal(params["w"].detach(), expected)
    for i, buf in enumerate(bufs):
        if buf is not None:
            assert torch.equal(state[0].momentum_buffer["w"][i], buf)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["plain", "nesterov_decay_maximize", "per_member"])
def test_update_adds_back_torchs_step_exactly_within_a_factor_2(case, dtype):
    """The pure update returns what torch's step makes the parameters less the parameters:
    apply_updates adds it back exactly wherever a step keeps a parameter within a factor
    2 of where it was (300 steps bit for bit with torch.optim, parameters near 3), and
    elsewhere (near zero, crossing it) to an ulp of the larger of the two values."""
    torch.manual_seed(0)
    start = (3.0 + torch.rand(M, 257, dtype=torch.float64)).to(dtype)
    c = (3.0 + torch.randn(M, 257, dtype=torch.float64)).to(dtype)
    expected, _ = run_torch(case, start, c, 300)
    opt = grid_sgd(case)
    sign = -1.0 if GRID[case][0].get("maximize", False) else 1.0
    params = {"w": start.clone()}
    state = opt.init(params)
    for _ in range(300):
        updates, state = opt.update({"w": sign * grad_of(params["w"], c)}, state, params)
        params = fe.optim.apply_updates(params, updates)
    assert torch.equal(params["w"], expected)

    # Step by step from update_'s parameters (torch's, by the test above), with random
    # gradients that move parameters about zero.
    params = {"w": torch.randn(M, 257, dtype=torch.float64).to(dtype)}
    state = opt.init(params)
    outside = 0
    for _ in range(50):
        grads = {"w": 3 * torch.randn(M, 257, dtype=torch.float64).to(dtype)}
        updates, _ = opt.update(grads, state, params)
        pure = fe.optim.apply_updates(params, updates)["w"]
        old = params["w"].clone()
        state = opt.update_(grads, state, params)
        new = params["w"]
        within = (new / old >= 0.5) & (new / old <= 2)
        assert torch.equal(pure[within], new[within])
        ulp = torch.finfo(dtype).eps * torch.maximum(old.abs(), new.abs())
        assert ((pure - new).abs() <= ulp).all()
        outside += int((~within).sum())
    assert outside > 100  # the second claim was exercised


def test_update_without_the_parameters_is_one_rounding_from_torch():
    torch.manual_seed(0)
    start, c = torch.randn(M, 257, dtype=torch.float64), torch.randn(M, 257, dtype=torch.float64)
    expected, _ = run_torch("momentum", start, c, 100)
    opt = grid_sgd("momentum")
    params = {"w": start.clone()}
    state = opt.init(params)
    for _ in range(100):
        updates, state = opt.update({"w": grad_of(params["w"], c)}, state)
        params = fe.optim.apply_updates(params, updates)
    torch.testing.assert_close(params["w"], expected, rtol=0, atol=1e-13)


@pytest.mark.slow
@pytest.mark.parametrize(
    "lr",
    [0.1, torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64), fe.optim.linear_warmup(0.1, 3)],
    ids=["float", "per_member", "schedule"],
)
def test_update_and_update_in_place_under_torch_compile_fullgraph(lr):
    """The folded step compiles whole, in place too (returning all-None updates from it
    did not: Dynamo's optree unflatten refused them)."""
    skip_unless_dynamo_traces_optree()
    opt = fe.optim.sgd(lr, momentum=0.9, weight_decay=0.01)

    def step(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return fe.optim.apply_updates(params, updates), state

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled_ = torch.compile(opt.update_, backend="aot_eager", fullgraph=True)
    start = torch.randn(3, 4, dtype=torch.float64)
    eager, traced, in_place = ({"w": start.clone()} for _ in range(3))
    eager_state, traced_state, in_place_state = (opt.init(p) for p in (eager, traced, in_place))
    # The test run's beartype wrappers cannot be traced by dynamo; users have none.
    with runtime_typecheck_off():
        for k in range(4):
            grads = {"w": start.cos() * (k + 1)}
            eager, eager_state = step(grads, eager_state, eager)
            traced, traced_state = compiled(grads, traced_state, traced)
            in_place_state = compiled_(grads, in_place_state, in_place)
    assert torch.equal(traced["w"], eager["w"])
    torch.testing.assert_close(in_place["w"], eager["w"], rtol=0, atol=1e-15)
