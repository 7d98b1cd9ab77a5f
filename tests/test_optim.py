"""fe.optim's functional optimizers against N separate torch.optim optimizers, in float64."""

import copy
import itertools
import math
from typing import Any, NamedTuple

import optree
import pytest
import torch
from helpers import (
    assert_trees_equal,
    optim_batch,
    optim_loss,
    optim_net_members,
    runtime_typecheck_off,
    skip_unless_dynamo_traces_optree,
)
from torch import nn

import funcensemble as fe

N = 3
STEPS = 10
TOL = {"rtol": 1e-12, "atol": 1e-12}  # float64
# Which gradients exist at each step: at PARTIAL one parameter gets none, at NONE
# no parameter does (a step that must change nothing).
PARTIAL, NONE = 3, 6
SKIPPED = "fc2.bias"
INT_LEAF = "bn.num_batches_tracked"


def adam_state(state: Any) -> fe.optim.AdamState:
    """The AdamState inside a chain's tuple of states."""
    (found,) = [s for s in state if isinstance(s, fe.optim.AdamState)]
    return found


def named(module: nn.Module) -> dict[str, nn.Parameter]:
    return dict(module.named_parameters())


def stacked_params(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The optimizer's tree: stacked parameters plus BatchNorm's integer counter."""
    tree = {k: torch.stack([named(m)[k].detach() for m in modules]) for k in named(modules[0])}
    tree[INT_LEAF] = torch.stack([m.get_buffer(INT_LEAF) for m in modules])
    return tree


def backward_all(modules: list[nn.Module], step: int) -> None:
    """Each member's own loss, backpropagated by plain autograd; grads as the step wants."""
    for i, m in enumerate(modules):
        m.zero_grad(set_to_none=True)
        if step == NONE:
            continue
        optim_loss(m, step, i).backward()
        if step == PARTIAL:
            m.get_parameter(SKIPPED).grad = None


def stacked_grads(modules: list[nn.Module]) -> dict[str, torch.Tensor | None]:
    grads: dict[str, torch.Tensor | None] = {}
    each = [named(m) for m in modules]
    for k in each[0]:
        gs = [params[k].grad for params in each]
        grads[k] = None if gs[0] is None else torch.stack(gs)
    grads[INT_LEAF] = None
    return grads


def load(modules: list[nn.Module], params: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for i, m in enumerate(modules):
            for k, p in named(m).items():
                p.copy_(params[k][i])


class Run(NamedTuple):
    reference: list[nn.Module]
    torch_opts: list[torch.optim.Optimizer]
    start: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    state: Any


def run(
    transform: fe.optim.GradientTransformation,
    torch_opt: Any,
    *,
    dtype: torch.dtype = torch.float64,
    steps: int = STEPS,
    in_place: bool = False,
) -> Run:
    """Train N modules with ``torch_opt(i, params) -> (optimizer, scheduler | None)`` each,
    and N copies with ``transform`` on their stacked parameters, from the same start
    (with ``update`` and ``apply_updates``, or with ``update_`` if ``in_place``)."""
    reference = optim_net_members(N, dtype=dtype)
    ours = copy.deepcopy(reference)
    made = [torch_opt(i, m.parameters()) for i, m in enumerate(reference)]
    params = stacked_params(ours)
    start = {k: v.clone() for k, v in params.items()}
    state = transform.init(params)
    for step in range(steps):
        backward_all(reference, step)
        for opt, scheduler in made:
            opt.step()
            if scheduler is not None:
                scheduler.step()
        backward_all(ours, step)
        if in_place:
            state = transform.update_(stacked_grads(ours), state, params)
        else:
            updates, state = transform.update(stacked_grads(ours), state, params)
            params = fe.optim.apply_updates(params, updates)
        load(ours, params)
    return Run(reference, [opt for opt, _ in made], start, params, state)


def assert_matches_torch(r: Run, *, amsgrad: bool, tol: dict[str, float] = TOL) -> None:
    """Same change from the start, and the same optimizer state, member by member."""
    ours = adam_state(r.state)
    for name in named(r.reference[0]):
        theirs = torch.stack([named(m)[name].detach() for m in r.reference])
        torch.testing.assert_close(
            r.params[name] - r.start[name], theirs - r.start[name], **tol, msg=name
        )
        states = [
            opt.state[named(m)[name]] for opt, m in zip(r.torch_opts, r.reference, strict=True)
        ]
        if not states[0]:  # never had a gradient: torch made no state
            assert all(not s for s in states)
            assert ours.count[name].item() == 0
            assert not ours.mu[name].any() and not ours.nu[name].any()
            continue
        assert all(s["step"].item() == states[0]["step"].item() for s in states)
        assert ours.count[name].item() == states[0]["step"].item(), name
        fields = [("mu", "exp_avg"), ("nu", "exp_avg_sq")]
        fields += [("nu_max", "max_exp_avg_sq")] if amsgrad else []
        for field, key in fields:
            torch.testing.assert_close(
                getattr(ours, field)[name],
                torch.stack([s[key] for s in states]),
                **tol,
                msg=f"{field} of {name}",
            )
        if not amsgrad:
            assert ours.nu_max[name] is None
    # The integer buffer is not optimized: no state, and the same tensor back.
    assert r.params[INT_LEAF] is r.start[INT_LEAF] or torch.equal(
        r.params[INT_LEAF], r.start[INT_LEAF]
    )
    assert ours.mu[INT_LEAF] is None and ours.count[INT_LEAF] is None


GRID = list(
    itertools.product(
        ["adam", "adamw"],
        [1e-2, 1e-3],
        [(0.9, 0.999), (0.95, 0.9995)],
        [0.0, 1e-2],
        [False, True],
        [False, True],
    )
)


@pytest.mark.parametrize(("kind", "lr", "betas", "weight_decay", "amsgrad", "maximize"), GRID)
def test_matches_torch_optim(kind, lr, betas, weight_decay, amsgrad, maximize):
    options = dict(weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
    transform = getattr(fe.optim, kind)(lr, betas, **options)
    torch_cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW

    def torch_opt(i, params):
        return torch_cls(params, lr=lr, betas=betas, **options), None

    assert_matches_torch(run(transform, torch_opt), amsgrad=amsgrad)


def test_skipped_leaf_keeps_its_own_step_count():
    r = run(fe.optim.adam(1e-2), lambda i, p: (torch.optim.Adam(p, lr=1e-2), None))
    counts = adam_state(r.state).count
    assert counts["fc1.weight"].item() == STEPS - 1  # every step but the all-None one
    assert counts[SKIPPED].item() == STEPS - 2
    assert counts["unused.weight"].item() == 0
    assert counts[INT_LEAF] is None


def test_float32_matches_torch_optim():
    r = run(
        fe.optim.adamw(1e-2, amsgrad=True),
        lambda i, p: (torch.optim.AdamW(p, lr=1e-2, amsgrad=True), None),
        dtype=torch.float32,
    )
    assert r.params["fc1.weight"].dtype == torch.float32
    assert_matches_torch(r, amsgrad=True, tol={"rtol": 1e-6, "atol": 1e-7})


# --- per-member hyperparameters ---------------------------------------------------------

PER_MEMBER = {
    "lr": torch.tensor([1e-2, 3e-3, 1e-3], dtype=torch.float64),
    "beta1": torch.tensor([0.9, 0.8, 0.95], dtype=torch.float64),
    "beta2": torch.tensor([0.999, 0.99, 0.9995], dtype=torch.float64),
    "eps": torch.tensor([1e-8, 1e-3, 1e-6], dtype=torch.float64),
    "weight_decay": torch.tensor([0.0, 1e-2, 0.1], dtype=torch.float64),
}
SHARED = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2}


def per_member_case(kind: str, which: str, **flags: bool):
    """``(transform, torch_opt)`` with ``which`` hyperparameter(s) per member, else shared."""
    chosen = {k: (PER_MEMBER[k] if which in (k, "all") else v) for k, v in SHARED.items()}

    def value(k: str, i: int) -> float:
        v = chosen[k]
        return float(v[i]) if isinstance(v, torch.Tensor) else v

    transform = getattr(fe.optim, kind)(
        chosen["lr"],
        (chosen["beta1"], chosen["beta2"]),
        chosen["eps"],
        weight_decay=chosen["weight_decay"],
        **flags,
    )
    torch_cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW

    def torch_opt(i, params):
        opt = torch_cls(
            params,
            lr=value("lr", i),
            betas=(value("beta1", i), value("beta2", i)),
            eps=value("eps", i),
            weight_decay=value("weight_decay", i),
            **flags,
        )
        return opt, None

    return transform, torch_opt


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("which", [*PER_MEMBER, "all"])
def test_per_member_hyperparameters_match_separate_torch_optimizers(kind, which):
    transform, torch_opt = per_member_case(kind, which, amsgrad=True)
    assert_matches_torch(run(transform, torch_opt), amsgrad=True)


def test_per_member_lr_from_logspace_in_float32():
    lrs = torch.logspace(-3, -2, N)  # float32, used with float64 parameters
    r = run(
        fe.optim.adam(lr=lrs),
        lambda i, p: (torch.optim.Adam(p, lr=float(lrs[i])), None),
    )
    assert_matches_torch(r, amsgrad=False)


# --- schedules --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_schedule_matches_lambda_lr(kind):
    def schedule(count):
        return 1e-2 * 0.8**count  # a float32 0-dim tensor (count is an int64 tensor)

    transform = getattr(fe.optim, kind)(schedule, amsgrad=True)
    torch_cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    # torch gets the schedule's own (float32-rounded) values, so the comparison is of
    # the optimizers alone.
    factor = [float(schedule(torch.tensor(e))) for e in range(STEPS + 1)]

    def torch_opt(i, params):
        opt = torch_cls(params, lr=1.0, amsgrad=True)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: factor[epoch])

    r = run(transform, torch_opt)
    assert_matches_torch(r, amsgrad=True)
    assert r.state[-1].count.item() == STEPS  # advanced on the all-None step too


def test_schedule_with_python_control_flow_returning_floats():
    def schedule(count):
        return 1e-2 if count < 4 else 1e-3

    r = run(
        fe.optim.adam(schedule),
        lambda i, p: (
            (opt := torch.optim.Adam(p, lr=1.0)),
            torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1e-2 if e < 4 else 1e-3),
        ),
    )
    assert_matches_torch(r, amsgrad=False)


def test_per_member_schedule():
    lrs = PER_MEMBER["lr"]

    def torch_opt(i, params):
        opt = torch.optim.Adam(params, lr=float(lrs[i]))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)

    assert_matches_torch(run(fe.optim.adam(lambda c: lrs * 0.5**c), torch_opt), amsgrad=False)


def test_functional_loop_with_fe_value_and_grad_matches_torch_optim():
    """End to end: fe.value_and_grad's per-member grads (None for the unused layer)."""
    reference = optim_net_members(N)
    fmodel, params, buffers = fe.stack(copy.deepcopy(reference))
    params = {k: v.detach() for k, v in params.items()}
    start = {k: v.clone() for k, v in params.items()}
    opt = fe.optim.adam(1e-2, weight_decay=1e-2, amsgrad=True)
    state = opt.init(params)
    torch_opts = [
        torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-2, amsgrad=True)
        for m in reference
    ]

    def loss_fn(p, b, x, y):
        return ((fmodel(p, b, x) - y) ** 2).mean()

    value_and_grad = fe.value_and_grad(loss_fn, in_dims=(0, 0))
    for step in range(STEPS):
        for i, (m, o) in enumerate(zip(reference, torch_opts, strict=True)):
            o.zero_grad()
            optim_loss(m, step, i).backward()
            o.step()
        xs, ys = zip(*[optim_batch(step, i) for i in range(N)], strict=True)
        _, grads, buffers = value_and_grad(params, buffers, torch.stack(xs), torch.stack(ys))
        assert grads["unused.weight"] is None
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
    for name in params:
        theirs = torch.stack([named(m)[name].detach() for m in reference])
        torch.testing.assert_close(params[name] - start[name], theirs - start[name], **TOL)


# --- the functional contract ------------------------------------------------------------


def small_tree(n: int = N) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(n, 4, 2, generator=g, dtype=torch.float64),
        "b": torch.randn(n, 2, generator=g, dtype=torch.float64),
    }


def test_update_and_apply_updates_do_not_mutate_their_inputs():
    opt = fe.optim.adamw(1e-2, amsgrad=True, maximize=True)
    params = small_tree()
    grads = {k: v * 2 + 1 for k, v in small_tree().items()}
    state = opt.init(params)
    state = opt.update(grads, state, params)[1]  # non-zero moments
    snapshot = optree.tree_map(torch.clone, (params, grads, state), none_is_leaf=False)
    updates, new_state = opt.update(grads, state, params)
    new_params = fe.optim.apply_updates(params, updates)
    assert_trees_equal((params, grads, state), snapshot)
    assert not torch.equal(new_params["w"], params["w"])
    assert not torch.equal(adam_state(new_state).mu["w"], adam_state(state).mu["w"])


def test_all_none_step_changes_nothing():
    opt = fe.optim.adam(1e-2, weight_decay=0.1, amsgrad=True)
    params = small_tree()
    state = opt.update(small_tree(), opt.init(params), params)[1]
    updates, new_state = opt.update({"w": None, "b": None}, state, params)
    assert updates == {"w": None, "b": None}
    assert_trees_equal(new_state, state)
    assert fe.optim.apply_updates(params, updates)["w"] is params["w"]


def test_empty_trees():
    for tree in ({}, (), []):
        opt = fe.optim.adamw(lr=lambda c: 1e-3)
        state = opt.init(tree)
        updates, state = opt.update(tree, state, tree)
        assert fe.optim.apply_updates(tree, updates) == tree


class Pair(NamedTuple):
    first: Any
    second: Any


def test_any_pytree_structure_matches_the_dict_version():
    flat = small_tree()
    flat["scale"] = torch.rand(N, dtype=torch.float64)
    nested = Pair([flat["w"], {"inner": flat["b"]}], (flat["scale"], None))
    grads_flat = {k: v.cos() for k, v in flat.items()}
    grads_nested = Pair([grads_flat["w"], {"inner": grads_flat["b"]}], (grads_flat["scale"], None))
    opt = fe.optim.adam(torch.tensor([1e-2, 1e-3, 1e-1]), amsgrad=True, weight_decay=0.1)
    p1, s1 = flat, opt.init(flat)
    p2, s2 = nested, opt.init(nested)
    for _ in range(3):
        u1, s1 = opt.update(grads_flat, s1, p1)
        p1 = fe.optim.apply_updates(p1, u1)
        u2, s2 = opt.update(grads_nested, s2, p2)
        p2 = fe.optim.apply_updates(p2, u2)
    assert isinstance(p2, Pair) and p2.second[1] is None
    assert_trees_equal(p2.first[0], p1["w"])
    assert_trees_equal(p2.first[1]["inner"], p1["b"])
    assert_trees_equal(p2.second[0], p1["scale"])


def test_non_float_leaves_get_no_state_and_no_update_even_with_a_gradient():
    params = {
        "w": torch.ones(N, 2),
        "ids": torch.arange(N),
        "flag": torch.ones(N, dtype=torch.bool),
    }
    opt = fe.optim.adam(0.1, weight_decay=0.1, maximize=True)
    state = opt.init(params)
    grads = {"w": torch.ones(N, 2), "ids": torch.ones(N, dtype=torch.int64), "flag": None}
    updates, state = opt.update(grads, state, params)
    assert updates["ids"] is None and updates["flag"] is None
    assert adam_state(state).mu["ids"] is None
    new = fe.optim.apply_updates(params, updates)
    assert new["ids"] is params["ids"] and new["w"].ne(1).all()


def test_apply_updates_returns_fresh_leaves_with_the_params_requires_grad():
    _, params, _ = fe.stack([nn.Linear(3, 2) for _ in range(N)])
    params["bias"].requires_grad_(False)
    opt = fe.optim.adam(0.1)
    updates, _ = opt.update(
        {k: torch.ones_like(v) for k, v in params.items()}, opt.init(params), params
    )
    new = fe.optim.apply_updates(params, updates)
    assert new["weight"].requires_grad and new["weight"].is_leaf
    assert not new["bias"].requires_grad
    assert new["weight"].grad_fn is None


def test_bfloat16_keeps_dtypes():
    params = {"w": torch.randn(N, 4, dtype=torch.bfloat16)}
    # Per-member values bfloat16 holds exactly (others are refused, see below).
    lrs, b1 = torch.tensor([2.0**-7, 2.0**-10, 2.0**-13]), torch.tensor([0.875] * 3)
    opt = fe.optim.adam(lrs, betas=(b1, 0.99))
    state = opt.init(params)
    for _ in range(3):
        updates, state = opt.update({"w": torch.randn(N, 4, dtype=torch.bfloat16)}, state, params)
        params = fe.optim.apply_updates(params, updates)
    assert params["w"].dtype == updates["w"].dtype == adam_state(state).nu["w"].dtype
    assert params["w"].dtype == torch.bfloat16 and torch.isfinite(params["w"]).all()


def test_chain_composes_building_blocks_into_adam():
    lr, wd = 1e-2, 0.1
    params, grads = small_tree(), {k: v.sin() for k, v in small_tree().items()}
    manual = fe.optim.chain(
        fe.optim.scale_by_adam(),
        fe.optim.add_decayed_weights(wd),
        fe.optim.scale_by_learning_rate(lr),
    )
    alias = fe.optim.adamw(lr, weight_decay=wd)
    u1, _ = manual.update(grads, manual.init(params), params)
    u2, _ = alias.update(grads, alias.init(params), params)
    # The same step up to rounding: the alias folds lr into the bias correction before
    # dividing, in torch.optim's order; the chain scales the finished direction.
    torch.testing.assert_close(u1, u2, rtol=1e-13, atol=0)


@pytest.mark.slow
def test_update_under_torch_compile_fullgraph():
    skip_unless_dynamo_traces_optree()
    lrs = torch.tensor([1e-2, 3e-3, 1e-3], dtype=torch.float64)
    opt = fe.optim.adam(
        lambda c: lrs * 0.9**c, (torch.tensor([0.9, 0.8, 0.95]), 0.999), amsgrad=True
    )

    def step(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return fe.optim.apply_updates(params, updates), state

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    params = small_tree()
    eager = (params, opt.init(params))
    traced = (params, opt.init(params))
    # The test run's beartype wrappers cannot be traced by dynamo; users have none.
    with runtime_typecheck_off():
        for k in range(4):
            grads = {k2: v.cos() * (k + 1) for k2, v in small_tree().items()}
            if k == 2:
                grads["b"] = None
            eager = step(grads, eager[1], eager[0])
            traced = compiled(grads, traced[1], traced[0])
    torch.testing.assert_close(traced[0], eager[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adam_state(traced[1]).count, adam_state(eager[1]).count)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    opt = fe.optim.adamw(torch.tensor([1e-2, 1e-3, 1e-4]), amsgrad=True, maximize=True)
    cpu = small_tree()
    gpu = {k: v.cuda() for k, v in cpu.items()}
    s_cpu, s_gpu = opt.init(cpu), opt.init(gpu)
    for k in range(3):
        g = {k2: v.cos() * (k + 1) for k2, v in small_tree().items()}
        u, s_cpu = opt.update(g, s_cpu, cpu)
        cpu = fe.optim.apply_updates(cpu, u)
        u, s_gpu = opt.update({k2: v.cuda() for k2, v in g.items()}, s_gpu, gpu)
        gpu = fe.optim.apply_updates(gpu, u)
    assert adam_state(s_gpu).count["w"].device.type == "cuda"
    torch.testing.assert_close({k: v.cpu() for k, v in gpu.items()}, cpu, rtol=1e-12, atol=1e-12)


# --- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [fe.optim.adam, fe.optim.adamw])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, r"Invalid learning rate: -1\.0"),
        ({"lr": float("nan")}, r"Invalid learning rate: nan"),
        ({"eps": -1.0}, r"Invalid epsilon value: -1\.0"),
        ({"betas": (1.0, 0.999)}, r"Invalid beta parameter at index 0: 1\.0"),
        ({"betas": (-0.1, 0.999)}, r"Invalid beta parameter at index 0: -0\.1"),
        ({"betas": (0.9, 1.0)}, r"Invalid beta parameter at index 1: 1\.0"),
        ({"weight_decay": -1.0}, r"Invalid weight_decay value: -1\.0"),
        ({"lr": torch.tensor([1e-3, -1.0])}, r"Invalid learning rate: -1\.0 \(member 1"),
        ({"betas": (0.9, torch.tensor([0.9, 1.5]))}, r"beta parameter at index 1: 1\.5 \(member 1"),
        ({"eps": torch.tensor([-1.0])}, r"Invalid epsilon value: -1\.0 \(member 0"),
        ({"weight_decay": torch.tensor([0.1, -2.0])}, r"Invalid weight_decay value: -2\.0"),
        (
            {"lr": torch.ones(2, 3)},
            r"lr as a tensor must be 1-D .* got \(2, 3\)\)\. Pass one value per member",
        ),
        ({"lr": torch.ones(0)}, r"must be 1-D with one value per member"),
        (
            {"betas": (0.9, 0.99, 0.999)},
            r"betas must be a pair .* \(expected 2 values, got 3 values\)",
        ),
        ({"betas": (0.9, float("nan"))}, r"Invalid beta parameter at index 1: nan"),
        ({"eps": float("nan")}, r"Invalid epsilon value: nan"),
        ({"weight_decay": torch.tensor([0.1, float("nan")])}, r"weight_decay value: nan"),
        ({"lr": torch.ones(3, device="meta")}, r"lr is a meta tensor, which holds no values"),
    ],
)
def test_invalid_hyperparameters_raise_value_error(make, kwargs, match):
    # Shapes and arities beartype rejects in the test run reach funcensemble's own checks.
    with runtime_typecheck_off(), pytest.raises(ValueError, match=match):
        make(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"lr": "0.1"},
            r"adam: lr must be a float, a 1-D tensor .* \(expected a number, got str\)",
        ),
        ({"lr": True}, r"lr must be a float"),
        (
            {"lr": [1e-3, 1e-2]},
            r"\(expected a number, got list\)\. Give per-member values as a 1-D tensor, one "
            r"value per member in member order: torch\.tensor\(\[\.\.\.\], "
            r"dtype=torch\.float64\) .*, or pass lr as one float shared by all members\.$",
        ),
        (
            {"weight_decay": (0.0, 0.1)},
            r"got tuple\)\. Give per-member values as a 1-D tensor.*pass weight_decay as one",
        ),
        ({"lr": torch.tensor([1, 2])}, r"lr as a tensor must be floating point"),
        ({"betas": 0.9}, r"betas must be a pair \(beta1, beta2\) \(expected .*, got float\)"),
        ({"amsgrad": 1}, r"amsgrad must be a bool \(expected True or False, got int\)"),
        ({"maximize": None}, r"maximize must be a bool \(expected True or False, got NoneType\)"),
    ],
)
def test_wrongly_typed_hyperparameters_raise_type_error(kwargs, match):
    with runtime_typecheck_off(), pytest.raises(TypeError, match=match):
        fe.optim.adam(**kwargs)


def test_zero_dim_tensor_hyperparameters_are_plain_numbers():
    opt = fe.optim.adam(torch.tensor(0.1))
    params = {"w": torch.zeros(2)}  # no member axis needed for a shared value
    updates, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    torch.testing.assert_close(updates["w"], torch.full((2,), -0.1))


def test_per_member_size_is_checked_at_init():
    opt = fe.optim.adam(lr=torch.full((4,), 1e-3))
    with pytest.raises(
        ValueError,
        match=r"lr has 4 per-member values but params\['b'\] has "
        r"leading size 3",
    ):
        opt.init(small_tree())
    opt = fe.optim.adamw(betas=(torch.full((3,), 0.9), 0.999))
    with pytest.raises(ValueError, match=r"betas\[0\] has 3 .* params\['s'\] has no member axis"):
        opt.init({"s": torch.zeros(())})
    opt = fe.optim.adamw(weight_decay=torch.full((2,), 0.1))
    with pytest.raises(ValueError, match=r"weight_decay has 2 per-member values"):
        opt.init(small_tree())


def test_ensemble_optimizer_refuses_a_per_member_size_mismatch_at_construction():
    params = {k: torch.nn.Parameter(v) for k, v in small_tree().items()}
    before = {k: v.detach().clone() for k, v in params.items()}
    with pytest.raises(ValueError, match=r"adam: eps has 2 per-member values but params\['b'\]"):
        fe.optim.EnsembleOptimizer(params, fe.optim.adam(eps=torch.full((2,), 1e-8)))
    assert_trees_equal({k: v.detach() for k, v in params.items()}, before)


def test_per_member_values_of_any_float_dtype_are_used_as_given():
    # A float16 or float64 [N] tensor: member i trains with float(values[i]), like a
    # torch.optim given that number, whatever the parameters' dtype.
    for dtype in (torch.float16, torch.float64):
        lrs = torch.tensor([1e-2, 3e-3, 1e-3], dtype=dtype)
        r = run(
            fe.optim.adamw(lr=lrs),
            lambda i, p, lrs=lrs: (torch.optim.AdamW(p, lr=float(lrs[i])), None),
        )
        assert_matches_torch(r, amsgrad=False)


def test_schedule_outputs_are_checked_at_update():
    params = small_tree()
    bad_size = fe.optim.adam(lambda c: torch.full((4,), 1e-3))
    with pytest.raises(ValueError, match=r"adam: lr has 4 per-member values but params\['b'\]"):
        bad_size.update(params, bad_size.init(params), params)
    with runtime_typecheck_off():
        bad_type = fe.optim.adam(lambda c: "fast")
        with pytest.raises(TypeError, match=r"lr schedule must return .* got str"):
            bad_type.update(params, bad_type.init(params), params)
    for value in (math.nan, math.inf):  # said "got float"; a float, a wrong value
        not_finite = fe.optim.adam(lambda c, v=value: v)
        with pytest.raises(
            ValueError, match=rf"lr schedule must return a finite float.* got {value}"
        ):
            not_finite.update(params, not_finite.init(params), params)


def test_update_rejects_grads_that_do_not_match_the_params():
    opt = fe.optim.adam(weight_decay=0.1)
    params = small_tree()
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"updates do not match the structure of the parameters"):
        opt.update({"w": params["w"]}, state, params)
    with pytest.raises(ValueError, match=r"update for params\['b'\] has shape \(3, 5\)"):
        opt.update({"w": params["w"], "b": torch.zeros(3, 5, dtype=torch.float64)}, state, params)
    with pytest.raises(ValueError, match=r"dtype torch.float32"):
        opt.update({"w": params["w"], "b": params["b"].float()}, state, params)
    with (
        runtime_typecheck_off(),
        pytest.raises(
            TypeError,
            match=r"params\['b'\] is not a tensor \(expected a tensor or None, got float\)",
        ),
    ):
        opt.update({"w": params["w"], "b": 1.0}, state, params)


def test_update_rejects_a_foreign_state():
    params = small_tree()
    opt = fe.optim.adam()
    with pytest.raises(
        ValueError,
        match=r"chain: the state is not this chain's \(expected the state returned by this chain",
    ):
        opt.update(params, (), params)
    state = opt.init(params)
    for make in (fe.optim.adam, fe.optim.sgd, fe.optim.rmsprop):  # params and state swapped
        with (
            runtime_typecheck_off(),
            pytest.raises(ValueError, match=r"often the parameters: update and update_ take"),
        ):
            make(0.1).update(params, params, state)
    with runtime_typecheck_off(), pytest.raises(TypeError, match=r"expected an AdamState"):
        fe.optim.scale_by_adam().update(params, fe.optim.EmptyState(), params)
    with runtime_typecheck_off(), pytest.raises(TypeError, match=r"expected a ScheduleState"):
        fe.optim.scale_by_learning_rate(lambda c: 0.1).update(params, None, params)


def test_weight_decay_needs_params():
    opt = fe.optim.adamw(weight_decay=0.1)
    params = small_tree()
    with pytest.raises(ValueError, match=r"weight decay needs the parameters"):
        opt.update(params, opt.init(params))


def test_chain_rejects_non_transforms():
    with (
        runtime_typecheck_off(),
        pytest.raises(
            TypeError,
            match=r"chain: transform 1 is not a GradientTransformation \(expected .*got \w+\)",
        ),
    ):
        fe.optim.chain(fe.optim.scale_by_adam(), lambda g: g)


def test_apply_updates_rejects_mismatches():
    params = small_tree()
    with pytest.raises(ValueError, match=r"apply_updates: updates do not match the structure"):
        fe.optim.apply_updates(params, {"w": None})
    with pytest.raises(ValueError, match=r"apply_updates: the update for params\['w'\] has shape"):
        fe.optim.apply_updates(params, {"w": torch.zeros(1), "b": None})
    with pytest.raises(TypeError, match=r"params\['x'\] is a int but has an update"):
        fe.optim.apply_updates({"x": 3}, {"x": torch.zeros(1)})


def test_complex_parameters_are_refused():
    with pytest.raises(TypeError, match=r"complex parameters are not supported"):
        fe.optim.adam().init({"z": torch.zeros(N, 2, dtype=torch.complex64)})


def test_standalone_transforms_validate_like_the_aliases():
    with pytest.raises(ValueError, match=r"scale_by_adam: Invalid epsilon value: -1\.0"):
        fe.optim.scale_by_adam(eps=-1.0)
    with pytest.raises(ValueError, match=r"add_decayed_weights: Invalid weight_decay value"):
        fe.optim.add_decayed_weights(-0.5)
    with pytest.raises(ValueError, match=r"scale_by_learning_rate: Invalid learning rate: -2\.0"):
        fe.optim.scale_by_learning_rate(-2.0)


# --- one state layout per optimizer, whatever its hyperparameter values ------------------

LAYOUT_OPTIONS = [
    {},
    {"weight_decay": 0.1},
    {"weight_decay": torch.tensor([0.0, 0.1, 0.2])},
    {"maximize": True},
    {"amsgrad": True},
    {"betas": (torch.tensor([0.8, 0.9, 0.95]), 0.99), "eps": torch.tensor([1e-8, 1e-6, 1e-4])},
]


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("options", LAYOUT_OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_state_layout_does_not_depend_on_hyperparameter_values(kind, options):
    params = {"w": torch.zeros(3, 4, 2), "steps": torch.zeros(3, dtype=torch.int64)}

    # A None (no state for an integer leaf, no nu_max without amsgrad) keeps its slot.
    def layout(state):
        return optree.tree_structure(state, none_is_leaf=True)

    default = getattr(fe.optim, kind)(1e-3).init(params)
    state = getattr(fe.optim, kind)(1e-3, **options).init(params)
    assert layout(state) == layout(default)
    assert [type(s) for s in state] == [fe.optim.AdamState, fe.optim.EmptyState]
    assert layout(fe.optim.adamw(0.1, weight_decay=0.0).init(params)) == layout(default)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_saved_state_loads_into_an_optimizer_with_another_weight_decay(kind, tmp_path):
    torch.manual_seed(0)
    make = getattr(fe.optim, kind)
    params = {"w": torch.randn(3, 4, 2, dtype=torch.float64)}
    grads = {"w": torch.randn(3, 4, 2, dtype=torch.float64)}
    before = make(1e-2, weight_decay=0.1)
    state = before.init(params)
    for _ in range(2):
        state = before.update_(grads, state, params)
    fe.save(tmp_path / "opt.safetensors", {"params": params, "opt_state": state})
    after = make(1e-2, weight_decay=0.0)
    loaded = fe.load(
        tmp_path / "opt.safetensors",
        {"params": {"w": torch.zeros_like(params["w"])}, "opt_state": after.init(params)},
    )
    torch.testing.assert_close(loaded, {"params": params, "opt_state": state}, rtol=0, atol=0)
    # And it steps on from there as the new optimizer does from the old state.
    expected, resumed = optree.tree_map(torch.clone, (params, state)), loaded
    exp_state = after.update_(grads, expected[1], expected[0])
    res_state = after.update_(grads, resumed["opt_state"], resumed["params"])
    torch.testing.assert_close((resumed["params"], res_state), (expected[0], exp_state))


def test_a_state_saved_with_amsgrad_is_refused_without_it(tmp_path):
    # amsgrad keeps a running maximum that a state without it cannot supply, or drop
    # silently: the load is refused with the leaf's name, in either direction.
    params = {"w": torch.zeros(3, 2)}
    for saved, template, word in ((True, False, "has extra"), (False, True, "is missing")):
        path = tmp_path / f"{saved}.safetensors"
        fe.save(path, fe.optim.adam(amsgrad=saved).init(params))
        with pytest.raises(ValueError, match=rf"{word} leaf `\[0\].nu_max\['w'\]`"):
            fe.load(path, fe.optim.adam(amsgrad=template).init(params))


def test_the_optimizer_layer_depends_on_pytrees_only():
    # Module -> stack -> vmap -> grad -> optimizer -> params: the optimizer modules import
    # nothing of Ensemble; an Ensemble reaches them through its registered view.
    import ast
    import pathlib

    root = pathlib.Path(fe.__file__).parent
    files = [*sorted((root / "optim").glob("*.py")), root / "_checkpoint" / "paths.py"]
    assert len(files) > 5
    for path in files:
        tree = ast.parse(path.read_text())
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert not any(m.endswith(("_core.ensemble", "_ensemble")) for m in imported), path


def test_a_nested_chain_given_another_optimizers_state_names_what_it_got() -> None:
    """The inner chain (sgd) got the rmsprop state's second entry, an EmptyState, and the
    message said "got a tuple of 0"."""
    params = {"w": torch.zeros(3, 2)}
    opt = fe.optim.chain(fe.optim.clip_by_global_norm(1.0), fe.optim.sgd(0.1))
    state = fe.optim.rmsprop(0.1).init(params)
    with pytest.raises(ValueError, match=r"got EmptyState, another transform's state"):
        opt.update({"w": torch.ones(3, 2)}, state, params)


SPARSE_CASES = {
    "sgd": lambda: fe.optim.sgd(0.1),
    "sgd-momentum": lambda: fe.optim.sgd(0.1, momentum=0.9, weight_decay=0.1),
    "adam": lambda: fe.optim.adam(1e-2),
    "adamw-per-member": lambda: fe.optim.adamw(torch.tensor([1e-2, 2e-2, 3e-2, 4e-2])),
    "rmsprop": lambda: fe.optim.rmsprop(1e-2),
    "rmsprop-momentum": lambda: fe.optim.rmsprop(1e-2, momentum=0.9, centered=True),
    "clip-adam": lambda: fe.optim.chain(fe.optim.clip_by_global_norm(1.0), fe.optim.adam(1e-2)),
    "scale_by_adam": lambda: fe.optim.scale_by_adam(),
    "decay-rate": lambda: fe.optim.chain(
        fe.optim.add_decayed_weights(0.1), fe.optim.scale_by_learning_rate(0.1)
    ),
}


@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
@pytest.mark.parametrize("make", list(SPARSE_CASES))
def test_a_sparse_gradient_is_refused_before_anything_changes(make, in_place):
    """torch's kernels refused a sparse gradient midway (adam, rmsprop: after earlier
    leaves had stepped and counts had moved) or with their own messages (clip, SGD with
    momentum). Every transform now names the leaf first. Plain SGD ran, torch.optim's
    result (param.add_(sparse, alpha=-lr)); it is refused as well, as
    EnsembleOptimizer.step refuses sparse gradients: one rule for fe.optim."""
    opt = SPARSE_CASES[make]()
    params = {"a": torch.randn(4, 3), "b": torch.randn(4, 64)}
    state = opt.init(params)
    for _ in range(2):  # a started state, with moments and buffers to keep
        grads = {"a": torch.randn(4, 3), "b": torch.randn(4, 64)}
        if in_place:
            state = opt.update_(grads, state, params)
        else:
            state = opt.update(grads, state, params)[1]
    before = [t.clone() for t in optree.tree_leaves((params, state))]
    grads = {"a": torch.randn(4, 3), "b": torch.randn(4, 64).to_sparse()}
    with pytest.raises(RuntimeError, match=r"params\['b'\] is not a dense tensor .*to_dense"):
        if in_place:
            opt.update_(grads, state, params)
        else:
            opt.update(grads, state, params)
    for a, b in zip(before, optree.tree_leaves((params, state)), strict=True):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_csr_gradient_is_refused_too():
    opt = fe.optim.sgd(0.1)
    params = {"w": torch.randn(4, 3)}
    with pytest.raises(RuntimeError, match=r"got torch.sparse_csr\)"):
        opt.update_({"w": torch.randn(4, 3).to_sparse_csr()}, opt.init(params), params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "make",
    [
        lambda: fe.optim.sgd(0.1, momentum=torch.tensor([0.99, 0.9, 0.5])),
        lambda: fe.optim.adam(1e-3, betas=(torch.tensor([0.9, 0.8, 0.7]), 0.999)),
        lambda: fe.optim.rmsprop(1e-3, alpha=torch.tensor([0.99, 0.9, 0.95])),
    ],
    ids=["sgd-momentum", "adam-beta1", "rmsprop-alpha"],
)
def test_per_member_values_a_half_dtype_would_round_are_refused(dtype, make):
    """Per-member values were viewed in a float16/bfloat16 parameter's dtype (bf16(0.99)
    is 0.98828125), where torch.optim computes with the member's float in float32: 22
    off after 200 bfloat16 SGD steps. Refused before anything changes."""
    params = {"w": torch.randn(N, 4, dtype=dtype)}
    opt = make()
    with pytest.raises(ValueError, match=r"would be rounded to .* Keep the parameters in float32"):
        opt.init(params)  # refused when the state is built, before any step
    with pytest.raises(ValueError, match=r"would be rounded to"):
        fe.optim.EnsembleOptimizer(params, make())


def test_a_per_member_schedule_a_half_dtype_would_round_is_refused_at_its_step():
    """training.md: a schedule's per-member values cannot be checked when the state is
    built; the first step returning one bfloat16 would round is refused, and nothing
    changes (warmup's first rate, 0, is exact, so step 0 runs)."""
    schedule = fe.optim.linear_warmup(torch.tensor([0.1, 0.01], dtype=torch.float64), 3)
    opt = fe.optim.adam(lr=schedule)
    params = {"w": torch.ones(2, 64, dtype=torch.bfloat16)}
    grads = {"w": torch.ones(2, 64, dtype=torch.bfloat16)}
    state = opt.init(params)
    state = opt.update_(grads, state, params)
    before = [t.clone() for t in optree.tree_leaves((params, state))]
    with pytest.raises(ValueError, match=r"per-member lr for bfloat16 parameters would be"):
        opt.update_(grads, state, params)
    for a, b in zip(before, optree.tree_leaves((params, state)), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("given", ["module", "generator", "dict values"])
@pytest.mark.parametrize(
    "transform",
    [
        lambda: fe.optim.adam(1e-3),
        lambda: fe.optim.sgd(0.1),  # keeps no state: init passed without a word
        lambda: fe.optim.rmsprop(1e-3),
        lambda: fe.optim.chain(fe.optim.clip_by_global_norm(1.0), fe.optim.adam(1e-3)),
    ],
)
def test_init_of_a_module_or_a_generator_is_refused(transform, given):
    # Each was one leaf without state: init returned an all-None state, and the mistake
    # surfaced (if at all) at update_ as a pytree-structure error.
    ens = fe.Ensemble([torch.nn.Linear(3, 1) for _ in range(2)])
    params = {
        "module": ens,
        "generator": ens.parameters(),
        "dict values": ens.stacked_params().values(),
    }[given]
    with pytest.raises(
        TypeError, match=r"expected a pytree of stacked tensors.*ens.stacked_params"
    ):
        transform().init(params)
    transform().init(ens.stacked_params())
    transform().init(list(ens.parameters()))


@pytest.mark.parametrize(
    ("reference", "make", "options"),
    [
        (torch.optim.SGD, fe.optim.sgd, {"lr": 0.1}),
        (torch.optim.SGD, fe.optim.sgd, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.RMSprop, fe.optim.rmsprop, {"lr": 0.01, "momentum": 0.9}),
        (torch.optim.RMSprop, fe.optim.rmsprop, {"lr": 0.01}),
        (torch.optim.Adam, fe.optim.adam, {"lr": 0.01}),
        (torch.optim.AdamW, fe.optim.adamw, {"lr": 0.01, "weight_decay": 0.01}),
    ],
    ids=["sgd", "sgd-momentum", "rmsprop-momentum", "rmsprop", "adam", "adamw"],
)
def test_an_infinite_parameter_stays_infinite_on_every_face(reference, make, options):
    """A diverged member's parameter at -inf with a finite gradient: torch.optim keeps it
    at -inf. The pure update returned new - params, -inf - -inf = NaN, which
    apply_updates wrote (sgd, rmsprop with momentum, adamw with weight decay)."""
    params = torch.tensor([[-math.inf, 2.0], [1.0, 2.0]], dtype=torch.float64)
    grads = torch.tensor([[0.5, 1.0], [0.5, 1.0]], dtype=torch.float64)
    loop = []
    for i in range(2):
        p = nn.Parameter(params[i].clone())
        opt = reference([p], **options)
        for _ in range(2):
            p.grad = grads[i].clone()
            opt.step()
        loop.append(p.detach())
    want = torch.stack(loop)
    opt = make(**options)
    pure = {"w": params.clone()}
    state = opt.init(pure)
    stepped = {"w": params.clone()}
    in_place = opt.init(stepped)
    for _ in range(2):
        updates, state = opt.update({"w": grads.clone()}, state, pure)
        pure = fe.optim.apply_updates(pure, updates)
        in_place = opt.update_({"w": grads.clone()}, in_place, stepped)
    assert want[0, 0] == -math.inf
    torch.testing.assert_close(pure["w"], want, rtol=1e-15, atol=0)
    torch.testing.assert_close(stepped["w"], want, rtol=1e-15, atol=0)


@pytest.mark.parametrize(
    "ours, theirs, names",
    [
        (
            lambda: fe.optim.adam(1e-2, amsgrad=True),
            lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
            {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"},
        ),
        (
            lambda: fe.optim.sgd(0.1, momentum=0.9),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            {"momentum_buffer": "momentum_buffer"},
        ),
        (
            lambda: fe.optim.rmsprop(1e-2, momentum=0.9, centered=True),
            lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
            {
                "step": "step",
                "square_avg": "square_avg",
                "momentum_buffer": "momentum_buffer",
                "grad_avg": "grad_avg",
            },
        ),
    ],
    ids=["adam", "sgd", "rmsprop"],
)
def test_state_names_map_to_torch_optims_as_training_md_tabulates(ours, theirs, names):
    """training.md's table: member i of a state leaf is torch.optim's value of that
    member's parameter, under the tabulated names."""
    torch.manual_seed(0)
    members = [nn.Linear(3, 2).double() for _ in range(3)]
    loop = copy.deepcopy(members)
    x = torch.randn(4, 3, dtype=torch.float64)
    ens = fe.Ensemble(members)
    opt = fe.optim.EnsembleOptimizer(ens, ours())
    torch_opts = [theirs(m.parameters()) for m in loop]
    for _ in range(2):
        opt.zero_grad()
        ens(x).pow(2).sum().backward()
        opt.step()
        for m, o in zip(loop, torch_opts, strict=True):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    state, lr_state = opt.state
    assert type(lr_state).__name__ == "EmptyState"
    for ours_name, theirs_name in names.items():
        for leaf in ("weight", "bias"):
            got = getattr(state, ours_name)[leaf]
            for i, m in enumerate(loop):
                want = torch_opts[i].state[m.get_parameter(leaf)][theirs_name]
                row = got if got.dim() == 0 else got[i]
                torch.testing.assert_close(row.to(want.dtype), want, rtol=1e-12, atol=1e-15)
    if type(state).__name__ == "SGDState":  # its count: momentum updates so far
        assert state.count["weight"].item() == 2


@pytest.mark.parametrize("make", [fe.optim.adam, fe.optim.sgd, fe.optim.rmsprop])
def test_a_schedule_keeps_its_count_in_the_second_element_of_the_state(make):
    """training.md: the second element of a state is the learning rate's."""
    state = make(fe.optim.cosine_decay(1e-2, 100)).init({"w": torch.zeros(2, 3)})
    assert type(state[1]).__name__ == "ScheduleState" and int(state[1].count) == 0
    assert type(make(1e-2).init({"w": torch.zeros(2, 3)})[1]).__name__ == "EmptyState"


def test_apply_updates_inside_torch_func_transforms():
    # Found by an audit: under vmap apply_updates failed with torch's batching-rule error
    # (its multi-tensor add), under grad with torch's requires_grad_() error.
    torch.manual_seed(0)
    params, updates = (
        {"w": torch.randn(2, 3, 4), "b": torch.randn(2, 3)},
        {"w": torch.randn(2, 3, 4), "b": None},
    )
    moved = torch.func.vmap(fe.optim.apply_updates, in_dims=(0, {"w": 0, "b": None}))(
        params, updates
    )
    assert torch.equal(moved["w"], params["w"] + updates["w"])
    assert torch.equal(moved["b"], params["b"])
    trainable = {"w": torch.randn(3, 4, requires_grad=True)}
    with pytest.raises(
        RuntimeError,
        match=r"require grad inside a torch.func transform \(got params\['w'\]",
    ):
        torch.func.grad(lambda p: fe.optim.apply_updates(p, {"w": torch.ones(3, 4)})["w"].sum())(
            trainable
        )


def test_numpy_hyperparameters_are_taken_as_torch_optim_takes_them():
    # Found by an audit: np.float32 values (from a config or an array) were refused,
    # where torch.optim and Tensor.lerp_ take them; np.float64 passed as a float.
    import numpy as np

    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4, dtype=torch.float64)}
    grads = {"w": torch.randn(3, 4, dtype=torch.float64)}
    lr, tau = np.float32(1e-3), np.float32(0.005)
    with runtime_typecheck_off():
        numpy_adam = fe.optim.adam(lr=lr, betas=(np.float32(0.8), 0.99), weight_decay=np.int64(0))
        moved = fe.optim.polyak_update(params, grads, tau)
    plain = fe.optim.adam(lr=float(lr), betas=(float(np.float32(0.8)), 0.99), weight_decay=0.0)
    ours, _ = numpy_adam.update(grads, numpy_adam.init(params), params)
    theirs, _ = plain.update(grads, plain.init(params), params)
    assert torch.equal(ours["w"], theirs["w"])
    assert torch.equal(moved["w"], params["w"].lerp(grads["w"], float(tau)))
    with runtime_typecheck_off(), pytest.raises(TypeError, match="lr must be a float"):
        fe.optim.adam(lr=np.bool_(True))
