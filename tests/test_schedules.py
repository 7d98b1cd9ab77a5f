"""fe.optim's learning-rate schedules against torch.optim.lr_scheduler, per member."""

import math

import optree
import pytest
import torch
from helpers import runtime_typecheck_off
from torch import nn
from torch.optim import lr_scheduler

import funcensemble as fe

N, STEPS = 3, 8
TOL = {"rtol": 1e-12, "atol": 1e-14}

# Per-member settings, all different; every member stays within its schedule's first
# decay (t <= total steps), where torch's cosine and ours agree.
PEAK = [0.1, 0.05, 0.02]
START = [0.25, 0.5, 1.0]
WARM = [1, 3, 2]
TOTAL = [8, 10, 12]
FLOOR = [0.0, 0.01, 0.005]


def t64(values):
    return torch.tensor(values, dtype=torch.float64)


# name -> (fe schedule over all members, torch scheduler for member i)
SCHEDULES = {
    "linear_warmup": (
        lambda: fe.optim.linear_warmup(t64(PEAK), torch.tensor(WARM), start_factor=t64(START)),
        lambda opt, i: lr_scheduler.LinearLR(opt, start_factor=START[i], total_iters=WARM[i]),
    ),
    "cosine_decay": (
        lambda: fe.optim.cosine_decay(t64(PEAK), torch.tensor(TOTAL), min_lr=t64(FLOOR)),
        lambda opt, i: lr_scheduler.CosineAnnealingLR(opt, T_max=TOTAL[i], eta_min=FLOOR[i]),
    ),
    "warmup_cosine": (
        lambda: fe.optim.warmup_cosine(
            t64(PEAK),
            torch.tensor(WARM),
            torch.tensor(TOTAL),
            start_factor=t64(START),
            min_lr=t64(FLOOR),
        ),
        lambda opt, i: lr_scheduler.SequentialLR(
            opt,
            [
                lr_scheduler.LinearLR(opt, start_factor=START[i], total_iters=WARM[i]),
                lr_scheduler.CosineAnnealingLR(opt, T_max=TOTAL[i] - WARM[i], eta_min=FLOOR[i]),
            ],
            milestones=[WARM[i]],
        ),
    ),
}

# name -> (fe optimizer given lr, torch optimizer given params and lr)
OPTIMIZERS = {
    "adam": (lambda lr: fe.optim.adam(lr=lr), lambda p, lr: torch.optim.Adam(p, lr=lr)),
    "sgd": (
        lambda lr: fe.optim.sgd(lr=lr, momentum=0.9),
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
    ),
    "rmsprop": (lambda lr: fe.optim.rmsprop(lr=lr), lambda p, lr: torch.optim.RMSprop(p, lr=lr)),
}

# torch 2.6's SequentialLR steps the cosine scheduler with an epoch argument at the
# milestone, which it warns is deprecated; later versions do not.
_SEQUENTIAL_LR_WARNING = "ignore:The epoch parameter in `scheduler.step\\(\\)`:UserWarning"


def members() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(3, 2).double() for _ in range(N)]


def batch(step: int, member: int) -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(10 * step + member)).double()


def run_loop(schedule: str, optimizer: str):
    modules = members()
    opts = [OPTIMIZERS[optimizer][1](m.parameters(), PEAK[i]) for i, m in enumerate(modules)]
    scheds = [SCHEDULES[schedule][1](o, i) for i, o in enumerate(opts)]
    lrs = []
    for step in range(STEPS):
        lrs.append([o.param_groups[0]["lr"] for o in opts])
        for i, (m, o, s) in enumerate(zip(modules, opts, scheds, strict=True)):
            o.zero_grad()
            m(batch(step, i)).pow(2).mean().backward()
            o.step()
            s.step()
    return modules, lrs


def expected_params(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {
        k: torch.stack([m.get_parameter(k).detach() for m in modules]) for k in ("weight", "bias")
    }


@pytest.mark.filterwarnings(_SEQUENTIAL_LR_WARNING)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_values_match_torch_schedulers_per_member(schedule):
    _, torch_lrs = run_loop(schedule, "sgd")
    sched = SCHEDULES[schedule][0]()
    got = [sched(torch.tensor(t)).tolist() for t in range(STEPS)]
    for t in range(STEPS):
        for i in range(N):
            assert math.isclose(got[t][i], torch_lrs[t][i], rel_tol=1e-12, abs_tol=1e-15), (t, i)


@pytest.mark.filterwarnings(_SEQUENTIAL_LR_WARNING)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_functional_face_matches_the_loop(schedule, optimizer):
    modules, _ = run_loop(schedule, optimizer)
    fmodel, params, buffers = fe.stack(members())
    step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).pow(2).mean(), in_dims=(0,))
    opt = OPTIMIZERS[optimizer][0](SCHEDULES[schedule][0]())
    state = opt.init(params)
    for t in range(STEPS):
        xs = torch.stack([batch(t, i) for i in range(N)])
        _, grads, buffers = step(params, buffers, xs)
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
    assert state[-1].count.item() == STEPS
    want = expected_params(modules)
    for k in want:
        torch.testing.assert_close(params[k], want[k], **TOL)


@pytest.mark.filterwarnings(_SEQUENTIAL_LR_WARNING)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_ensemble_optimizer_matches_the_loop(optimizer):
    modules, _ = run_loop("warmup_cosine", optimizer)
    ens = fe.Ensemble(members())
    opt = fe.optim.EnsembleOptimizer(ens, OPTIMIZERS[optimizer][0](SCHEDULES["warmup_cosine"][0]()))
    for t in range(STEPS):
        xs = torch.stack([batch(t, i) for i in range(N)])
        opt.zero_grad()
        ens(xs, in_dims=0).pow(2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    want = expected_params(modules)
    got = ens.stacked_params()
    for k in want:
        torch.testing.assert_close(got[k].detach(), want[k], **TOL)


@pytest.mark.filterwarnings(_SEQUENTIAL_LR_WARNING)
def test_numbers_for_all_members_match_torch_with_the_fused_adam_step():
    """Every argument one number: a 0-dim rate, adam's fused in-place step."""
    ens = fe.Ensemble(members())
    sched = fe.optim.warmup_cosine(0.05, 2, 9, start_factor=0.5, min_lr=0.001)
    assert sched(torch.tensor(0)).dim() == 0
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=sched))
    loop = members()
    for t in range(STEPS):
        xs = torch.stack([batch(t, i) for i in range(N)])
        opt.zero_grad()
        ens(xs, in_dims=0).pow(2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    for i, m in enumerate(loop):
        o = torch.optim.Adam(m.parameters(), lr=0.05)
        s = lr_scheduler.SequentialLR(
            o,
            [
                lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=2),
                lr_scheduler.CosineAnnealingLR(o, T_max=7, eta_min=0.001),
            ],
            milestones=[2],
        )
        for t in range(STEPS):
            o.zero_grad()
            m(batch(t, i)).pow(2).mean().backward()
            o.step()
            s.step()
    want, got = expected_params(loop), ens.stacked_params()
    for k in want:
        torch.testing.assert_close(got[k].detach(), want[k], **TOL)


def test_zero_start_and_zero_warmup():
    sched = fe.optim.linear_warmup(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([4, 0, 2]))
    assert [sched(t).tolist() for t in range(5)] == [
        [0.0, 2.0, 0.0],
        [0.25, 2.0, 2.0],
        [0.5, 2.0, 4.0],
        [0.75, 2.0, 4.0],
        [1.0, 2.0, 4.0],
    ]


def test_zero_warmup_is_no_warmup_where_linear_lr_holds_its_start_factor():
    """The one documented difference from LinearLR: warmup_steps=0 gives peak_lr from the
    first update on, with any start_factor; LinearLR(total_iters=0) keeps start_factor *
    lr for good (the docstring called the schedule LinearLR's without saying so)."""
    sched = fe.optim.linear_warmup(1e-3, 0, start_factor=0.1)
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1e-3)
    linear = lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=0)
    for t in range(4):
        assert sched(t).item() == 1e-3
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-4, rel=1e-12)  # torch's quirk
        opt.step()
        linear.step()
    assert "LinearLR(total_iters=0)" in fe.optim.linear_warmup.__doc__  # the difference told


def test_after_the_decay_the_rate_stays_at_the_floor():
    sched = fe.optim.warmup_cosine(1.0, 2, 6, min_lr=torch.tensor([0.0, 0.1]))
    for t in (6, 7, 100):
        torch.testing.assert_close(sched(t), torch.tensor([0.0, 0.1]).double(), rtol=0, atol=0)
    decay = fe.optim.cosine_decay(1.0, 4, min_lr=0.25)
    assert decay(4).item() == decay(50).item() == 0.25
    # Where torch's CosineAnnealingLR, past T_max, rises again.
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    torch_decay = lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=0.25)
    for _ in range(6):
        opt.step()
        torch_decay.step()
    assert opt.param_groups[0]["lr"] > 0.25 + 1e-3


def test_a_per_member_schedule_for_the_wrong_number_of_members_is_refused():
    params = {"w": torch.zeros(2, 3)}
    opt = fe.optim.adam(lr=fe.optim.cosine_decay(torch.tensor([0.1, 0.2, 0.3]), 5))
    state = opt.init(params)
    with pytest.raises(ValueError, match="has 3 per-member values"):
        opt.update({"w": torch.ones(2, 3)}, state, params)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: fe.optim.linear_warmup(0.1, 2.0), TypeError, "warmup_steps must be an int"),
        (lambda: fe.optim.linear_warmup(0.1, -1), ValueError, "warmup_steps must be >= 0"),
        (
            lambda: fe.optim.linear_warmup(0.1, torch.tensor([1.0, 2.0])),
            TypeError,
            "must hold integers",
        ),
        (
            lambda: fe.optim.linear_warmup(0.1, torch.tensor([1, -2])),
            ValueError,
            "warmup_steps must be >= 0 for every member, got -2 for member 1",
        ),
        (lambda: fe.optim.linear_warmup(0.1, torch.tensor(3)), ValueError, "shape"),
        (lambda: fe.optim.linear_warmup(-0.1, 2), ValueError, "Invalid peak_lr value"),
        (lambda: fe.optim.linear_warmup(0.1, 2, start_factor=1.5), ValueError, "start_factor"),
        (lambda: fe.optim.cosine_decay(0.1, 0), ValueError, "decay_steps must be >= 1"),
        (lambda: fe.optim.cosine_decay(0.1, 5, min_lr=-1.0), ValueError, "Invalid min_lr"),
        (lambda: fe.optim.cosine_decay("0.1", 5), TypeError, "peak_lr must be a float"),
        (
            lambda: fe.optim.cosine_decay(torch.tensor([0.1, 0.2]), torch.tensor([5, 6, 7])),
            ValueError,
            "disagree on the number of members",
        ),
        (
            lambda: fe.optim.warmup_cosine(0.1, 5, 5),
            ValueError,
            "total_steps must exceed warmup_steps, got total_steps 5 and warmup_steps 5",
        ),
        (
            lambda: fe.optim.warmup_cosine(0.1, torch.tensor([1, 6]), 5),
            ValueError,
            "must exceed warmup_steps for member 1",
        ),
    ],
)
def test_bad_arguments_are_refused_when_built(build, error, match):
    with runtime_typecheck_off(), pytest.raises(error, match=match):
        build()


def test_numpy_step_counts_are_taken_as_ints():
    # Found by an audit: len(loader) * epochs as a NumPy integer was refused, where
    # torch's LinearLR and CosineAnnealingLR take it (a NumPy bool stays refused).
    import numpy as np

    for build in (
        lambda s: fe.optim.linear_warmup(0.1, s(3)),
        lambda s: fe.optim.cosine_decay(0.1, s(10), min_lr=0.01),
        lambda s: fe.optim.warmup_cosine(0.1, s(2), s(9)),
    ):
        plain, numpy = build(int), build(np.int64)
        for count in range(12):
            assert torch.equal(torch.as_tensor(numpy(count)), torch.as_tensor(plain(count)))
    with runtime_typecheck_off(), pytest.raises(TypeError, match="must be an int"):
        fe.optim.linear_warmup(0.1, np.bool_(True))


def test_a_bad_count_is_refused():
    with runtime_typecheck_off(), pytest.raises(TypeError, match="called with the step count"):
        fe.optim.cosine_decay(0.1, 5)(1.5)


def test_a_lambda_schedule_of_the_count_in_double_is_lambdalr():
    """As the training how-to says: ``0.9 ** count`` is float32 (the count is int64);
    ``0.9 ** count.double()`` steps as ``LambdaLR`` with a Python float."""
    assert (0.9 ** torch.tensor(3)).dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    start = torch.randn(3, 4, generator=g, dtype=torch.float64)
    grads = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(6)]
    params = {"w": start.clone()}
    opt = fe.optim.adam(lr=lambda count: 1e-2 * 0.9 ** count.double())
    state = opt.init(params)
    members = [torch.nn.Parameter(start[i].clone()) for i in range(3)]
    torch_opts = [torch.optim.Adam([p], lr=1e-2) for p in members]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.9**step) for o in torch_opts]
    for grad in grads:
        state = opt.update_({"w": grad.clone()}, state, params)
        for i, (o, s) in enumerate(zip(torch_opts, scheds, strict=True)):
            members[i].grad = grad[i].clone()
            o.step()
            s.step()
    torch.testing.assert_close(
        params["w"], torch.stack([p.detach() for p in members]), rtol=1e-15, atol=1e-15
    )


@pytest.mark.parametrize("chained", [False, True])
def test_a_refused_update_in_place_leaves_the_schedule_count(chained):
    """scale_by_learning_rate never reads the parameters: update_ checks the gradients
    against them before any state moves (the count advanced, then the add refused)."""
    lr = fe.optim.scale_by_learning_rate(lambda c: 0.1)
    opt = fe.optim.chain(fe.optim.clip_by_global_norm(1.0), lr) if chained else lr
    params = {"w": torch.zeros(3, 4)}
    state = opt.init(params)
    before = optree.tree_map(torch.clone, state)
    with pytest.raises(ValueError, match=r"update_: the gradient for params\['w'\] has shape"):
        opt.update_({"w": torch.ones(3, 5)}, state, params)
    torch.testing.assert_close(state, before, rtol=0, atol=0)
    assert torch.equal(params["w"], torch.zeros(3, 4))
