"""fe.optim.EnsembleOptimizer stepping an Ensemble in place, against per-module torch.optim."""

import copy
import io
import re

import pytest
import torch
from helpers import (
    assert_trees_equal,
    optim_batch,
    optim_loss,
    optim_net_members,
    runtime_typecheck_off,
)
from torch import nn

import funcensemble as fe

N = 3
STEPS = 10
TOL = {"rtol": 2.5e-6, "atol": 2.5e-6}
PARTIAL, NONE = 3, 6
SKIPPED = "fc2.bias"


def backward_reference(modules: list[nn.Module], step: int) -> None:
    for i, m in enumerate(modules):
        m.zero_grad(set_to_none=True)
        if step != NONE:
            optim_loss(m, step, i).backward()
            if step == PARTIAL:
                m.get_parameter(SKIPPED).grad = None


def ensemble_loss(ens: fe.Ensemble, step: int) -> torch.Tensor:
    """The sum of the members' own losses: each member's gradient is its own loss's."""
    xs, ys = zip(*[optim_batch(step, i) for i in range(N)], strict=True)
    out = ens(torch.stack(xs), in_dims=0)
    return ((out - torch.stack(ys)) ** 2).mean(dim=(1, 2)).sum()


def backward_ensemble(ens: fe.Ensemble, opt: fe.optim.EnsembleOptimizer, step: int) -> None:
    opt.zero_grad()
    if step != NONE:
        ensemble_loss(ens, step).backward()
        if step == PARTIAL:
            ens.stacked.get_parameter(SKIPPED).grad = None


def stacked(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    each = [dict(m.named_parameters()) for m in modules]
    return {k: torch.stack([p[k].detach() for p in each]) for k in each[0]}


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("maximize", [False, True])
def test_matches_per_module_torch_optim(kind, maximize):
    options = dict(lr=1e-2, weight_decay=1e-2, amsgrad=True, maximize=maximize)
    reference = optim_net_members(N)
    ens = fe.Ensemble(copy.deepcopy(reference))
    opt = fe.optim.EnsembleOptimizer(ens, getattr(fe.optim, kind)(**options))
    torch_cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    torch_opts = [torch_cls(m.parameters(), **options) for m in reference]
    start = {k: v.detach().clone() for k, v in ens.stacked_params().items()}
    for step in range(STEPS):
        backward_reference(reference, step)
        for o in torch_opts:
            o.step()
        backward_ensemble(ens, opt, step)
        opt.step()
    theirs = stacked(reference)
    for name, p in ens.stacked_params().items():
        torch.testing.assert_close(p.detach() - start[name], theirs[name] - start[name], **TOL)
    state = next(s for s in opt.state if isinstance(s, fe.optim.AdamState))
    for name in theirs:
        per_member = [
            o.state[dict(m.named_parameters())[name]]
            for o, m in zip(torch_opts, reference, strict=True)
        ]
        if not per_member[0]:
            assert state.count[name].item() == 0
            continue
        assert state.count[name].item() == per_member[0]["step"].item()
        torch.testing.assert_close(
            state.mu[name], torch.stack([s["exp_avg"] for s in per_member]), **TOL
        )
        torch.testing.assert_close(
            state.nu_max[name], torch.stack([s["max_exp_avg_sq"] for s in per_member]), **TOL
        )


def test_params_from_stack_and_a_closure():
    fmodel, params, buffers = fe.stack([nn.Linear(4, 2).double() for _ in range(N)])
    opt = fe.optim.EnsembleOptimizer(params, fe.optim.adam(0.1))
    x = torch.randn(5, 4, dtype=torch.float64)
    before = params["weight"].detach().clone()

    def closure():
        opt.zero_grad()
        loss = fe.vmap(fmodel)(params, buffers, x).pow(2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.ndim == 0 and params["weight"].grad is not None
    assert not torch.equal(params["weight"], before)
    assert params["weight"].is_leaf  # updated in place


def test_zero_grad_to_zeros():
    ens = fe.Ensemble([nn.Linear(3, 1) for _ in range(N)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam())
    ens(torch.randn(2, 3)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert ens.stacked.weight.grad is not None and not ens.stacked.weight.grad.any()
    opt.zero_grad()
    assert ens.stacked.weight.grad is None


def train(ens: fe.Ensemble, opt: fe.optim.EnsembleOptimizer, steps: range) -> None:
    for step in steps:
        backward_ensemble(ens, opt, step)
        opt.step()


def test_state_dict_round_trip_through_torch_save():
    make = lambda: fe.optim.adamw(lambda c: 1e-2 * 0.9**c, amsgrad=True)  # noqa: E731
    ens = fe.Ensemble(optim_net_members(N))
    opt = fe.optim.EnsembleOptimizer(ens, make())
    train(ens, opt, range(4))
    buffer = io.BytesIO()
    torch.save({"model": ens.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = fe.Ensemble(optim_net_members(N, seed=7))
    resumed.load_state_dict(saved["model"])
    resumed_opt = fe.optim.EnsembleOptimizer(resumed, make())
    resumed_opt.load_state_dict(saved["optim"])
    train(ens, opt, range(4, 8))
    train(resumed, resumed_opt, range(4, 8))
    for name, p in ens.stacked_params().items():
        torch.testing.assert_close(resumed.stacked_params()[name], p, rtol=0, atol=0)
    assert set(opt.state_dict()["state"]) == set(resumed_opt.state_dict()["state"])


def test_state_dict_is_readable():
    ens = fe.Ensemble(optim_net_members(N))
    keys = fe.optim.EnsembleOptimizer(ens, fe.optim.adam()).state_dict()["state"]
    assert "state[0].mu['fc1.weight']" in keys and "state[0].count['scale']" in keys


def test_load_state_dict_rejects_a_mismatch_before_changing_anything():
    ens = fe.Ensemble(optim_net_members(N))
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(amsgrad=True))
    train(ens, opt, range(2))
    before = opt.state
    other = fe.optim.EnsembleOptimizer(fe.Ensemble(optim_net_members(N)), fe.optim.adam())
    with pytest.raises(ValueError, match=r"(?s)amsgrad=False.*amsgrad=True"):
        opt.load_state_dict(other.state_dict())  # the transforms' records differ
    unrecorded = {k: v for k, v in other.state_dict().items() if k != "transform"}
    with pytest.raises(
        ValueError,
        match=r"`.*` does not match this optimizer's state \(expected a tensor of shape "
        r"\(3, .*\), got None\)\. It was saved from a different transform",
    ):
        opt.load_state_dict(unrecorded)  # the state's own structure differs too
    bigger = fe.optim.EnsembleOptimizer(
        fe.Ensemble(optim_net_members(N + 1)), fe.optim.adam(amsgrad=True)
    )
    with pytest.raises(
        ValueError,
        match=r"does not match this optimizer's state \(expected a tensor of shape \(3, .*\), "
        r"got a tensor of shape \(4, .*\)\)\. It was saved with a different member count",
    ):
        opt.load_state_dict(bigger.state_dict())
    chained = fe.optim.EnsembleOptimizer(
        fe.Ensemble(optim_net_members(N)),
        fe.optim.chain(
            fe.optim.add_decayed_weights(0.1),
            fe.optim.scale_by_adam(amsgrad=True),
            fe.optim.scale_by_learning_rate(1e-3),
        ),
    )
    with pytest.raises(
        ValueError,
        match=r"the state does not match this optimizer: it is missing `.*` and has extra `.*`",
    ):
        opt.load_state_dict({"state": chained.state_dict()["state"]})
    corrupt = opt.state_dict()
    corrupt["state"] = {k: 1.0 if v is not None else v for k, v in corrupt["state"].items()}
    with pytest.raises(ValueError, match=r"\(expected a tensor of shape \(.*\), got a float\)"):
        opt.load_state_dict(corrupt)
    with (
        runtime_typecheck_off(),
        pytest.raises(TypeError, match=r"not an optimizer state \(expected the dict returned"),
    ):
        opt.load_state_dict({"mu": 1})
    assert opt.state is before


def test_construction_errors():
    with runtime_typecheck_off():
        with pytest.raises(
            TypeError, match=r"params is neither an Ensemble nor a mapping .* got list\)\. Pass"
        ):
            fe.optim.EnsembleOptimizer([nn.Linear(2, 2)], fe.optim.adam())
        ens = fe.Ensemble([nn.Linear(2, 2) for _ in range(N)])
        with pytest.raises(
            TypeError,
            match=r"transform is not a GradientTransformation \(expected .* got function\)",
        ):
            fe.optim.EnsembleOptimizer(ens, lambda g: g)
    leaf = torch.zeros(N, 2, requires_grad=True)
    with pytest.raises(
        TypeError, match=r"parameter `w` must be a leaf tensor \(expected .*got a non-leaf tensor\)"
    ):
        fe.optim.EnsembleOptimizer({"w": leaf * 2}, fe.optim.adam())


def test_sparse_gradients_are_refused():
    w = torch.zeros(N, 2, requires_grad=True)
    opt = fe.optim.EnsembleOptimizer({"w": w}, fe.optim.adam())
    w.grad = torch.zeros(N, 2).to_sparse()
    with pytest.raises(RuntimeError, match=r"`w` has a sparse gradient"):
        opt.step()


@pytest.mark.parametrize(
    "alias",
    [lambda p: p, lambda p: p.detach(), lambda p: nn.Parameter(p)],
    ids=["same", "detached", "parameter-over-it"],
)
def test_one_tensor_under_two_names_is_refused(alias):
    """It was stepped twice a step, with two states (-0.2 after one step of lr 0.1 on a
    gradient of 1, where torch.optim steps a parameter listed once to -0.1)."""
    p = nn.Parameter(torch.zeros(N, 3))
    with pytest.raises(ValueError, match=r"`a` and `b` are the same tensor \(expected each"):
        fe.optim.EnsembleOptimizer(
            {"a": p, "w": torch.zeros(N, 3), "b": alias(p)}, fe.optim.sgd(0.1)
        )
    fe.optim.EnsembleOptimizer({"a": p, "b": p[1:].detach()}, fe.optim.sgd(0.1))  # other views


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(i)))


@pytest.mark.parametrize("face", ["Ensemble", "stack"])
def test_tied_weights_are_one_parameter_and_step_as_the_loop(face):
    torch.manual_seed(0)
    members = [Tied().double() for _ in range(N)]
    loop = copy.deepcopy(members)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in loop]
    idx, target = torch.tensor([1, 2, 3, 4]), torch.randn(4, 10, dtype=torch.float64)
    if face == "Ensemble":
        ens = fe.Ensemble(members)
        opt = fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(0.1, momentum=0.9))
        forward = ens
    else:
        fmodel, params, buffers = fe.stack(members)
        params = {k: nn.Parameter(v) for k, v in params.items()}
        opt = fe.optim.EnsembleOptimizer(params, fe.optim.sgd(0.1, momentum=0.9))

        def forward(i: torch.Tensor) -> torch.Tensor:
            return torch.func.vmap(fmodel, in_dims=(0, 0, None))(params, buffers, i)

    assert list(opt.params) == ["emb.weight"]
    for _ in range(5):
        for m, o in zip(loop, opts, strict=True):
            o.zero_grad()
            ((m(idx) - target) ** 2).mean().backward()
            o.step()
        opt.zero_grad()
        ((forward(idx) - target) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    expected = torch.stack([m.emb.weight.detach() for m in loop])
    torch.testing.assert_close(opt.params["emb.weight"].detach(), expected, rtol=1e-12, atol=1e-12)


def test_repr():
    ens = fe.Ensemble([nn.Linear(2, 2) for _ in range(N)])
    assert repr(fe.optim.EnsembleOptimizer(ens, fe.optim.adam())) == (
        "EnsembleOptimizer(2 stacked parameters)"
    )


def test_state_dict_loads_into_an_optimizer_with_another_weight_decay():
    # One state layout whatever the hyperparameter values: changing weight_decay (or
    # maximize) on resume keeps the moments, as load_state_dict's docstring says: load
    # into the saved transform, then assign the new one (or drop the record).
    ens = fe.Ensemble(optim_net_members(N))
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adamw(1e-2, weight_decay=0.1))
    train(ens, opt, range(2))
    resumed = fe.optim.EnsembleOptimizer(ens, fe.optim.adamw(1e-2, weight_decay=0.1))
    resumed.load_state_dict(opt.state_dict())
    resumed.transform = fe.optim.adamw(1e-2, weight_decay=0.0, maximize=True)
    torch.testing.assert_close(resumed.state, opt.state, rtol=0, atol=0)
    assert "weight_decay=0.0" in resumed.state_dict()["transform"]
    again = fe.optim.EnsembleOptimizer(ens, fe.optim.adamw(1e-2, weight_decay=0.0, maximize=True))
    again.load_state_dict({"state": opt.state_dict()["state"]})  # no record: not compared
    torch.testing.assert_close(again.state, opt.state, rtol=0, atol=0)


def test_a_torch_optim_state_dict_is_refused_as_such_before_anything_changes():
    members = [torch.nn.Linear(3, 2) for _ in range(2)]
    plain = torch.optim.Adam(members[0].parameters())
    members[0](torch.randn(4, 3)).sum().backward()
    plain.step()
    ens = fe.Ensemble(members)
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-3))
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(TypeError, match=r"this is a torch\.optim optimizer's state_dict"):
        opt.load_state_dict(plain.state_dict())
    torch.testing.assert_close(opt.state_dict()["state"], before["state"], rtol=0, atol=0)


def test_grad_scaler_given_an_ensemble_optimizer_says_what_to_do() -> None:
    """GradScaler.step reads param_groups: the error was a bare AttributeError."""
    ens = fe.Ensemble([nn.Linear(4, 1) for _ in range(3)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=1e-3))
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in ens.parameters()]
    scaler.scale(ens(torch.randn(8, 4)).square().sum()).backward()
    with pytest.raises(AttributeError, match=r"no param_groups.*scale the loss yourself"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, ens.parameters(), strict=True))
    assert not hasattr(opt, "param_groups")  # probing tools see no groups


@pytest.mark.parametrize(
    ("saved", "loading"),
    [
        pytest.param(lambda: fe.optim.adam(1e-2), lambda: fe.optim.adam(1e-3), id="lr"),
        pytest.param(lambda: fe.optim.adam(), lambda: fe.optim.adamw(), id="adam-adamw"),
        pytest.param(
            lambda: fe.optim.sgd(0.1, momentum=0.9),
            lambda: fe.optim.sgd(0.1, momentum=0.8),
            id="momentum",
        ),
        pytest.param(
            lambda: fe.optim.adam(torch.tensor([1e-2, 2e-2, 3e-2])),
            lambda: fe.optim.adam(torch.tensor([1e-2, 3e-2, 2e-2])),
            id="per-member-order",
        ),
        pytest.param(
            lambda: fe.optim.adam(fe.optim.warmup_cosine(1e-2, 2, 10)),
            lambda: fe.optim.adam(fe.optim.warmup_cosine(1e-2, 3, 10)),
            id="schedule",
        ),
    ],
)
def test_a_state_saved_with_other_hyperparameters_is_refused(saved, loading):
    """The state held no hyperparameters: loaded into an optimizer built with others it
    continued with those (0.09 off the torch.optim loop, whose load_state_dict puts
    the saved lr back). The record of the transform is compared; popping it is the
    explicit way to change hyperparameters on resume."""
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(3)])
    opt = fe.optim.EnsembleOptimizer(ens, saved())
    ens(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    other = fe.optim.EnsembleOptimizer(ens, loading())
    before = copy.deepcopy(other.state)
    with pytest.raises(ValueError, match=r"expected the same transform and hyperparameters"):
        other.load_state_dict(state)
    assert_trees_equal(other.state, before)
    fe.optim.EnsembleOptimizer(ens, saved()).load_state_dict(state)  # the same: loads
    other.load_state_dict({k: v for k, v in state.items() if k != "transform"})


def test_the_transform_record_survives_fe_save_and_is_compared_by_fe_load(tmp_path):
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(3)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
    ens(torch.randn(4, 3)).sum().backward()
    opt.step()
    fe.save(tmp_path / "opt.st", opt)
    fe.load(tmp_path / "opt.st", fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2)))
    with pytest.raises(ValueError, match=r"(?s)adam\(lr=0.01.*adam\(lr=0.001"):
        fe.load(tmp_path / "opt.st", fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-3)))
    # Another kind of transform: named too (a list of 18 missing and extra leaves ended
    # with "load into the optimizer itself: fe.load(path, opt)", which the user did).
    sgd = fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(0.1, momentum=0.9))
    state = copy.deepcopy(sgd.state)
    with pytest.raises(ValueError, match=r"(?s)load: the state was saved .*adam\(lr=0.01.*sgd\("):
        fe.load(tmp_path / "opt.st", sgd)
    assert_trees_equal(sgd.state, state)


def test_the_transform_record_does_not_depend_on_dict_order_and_covers_hetero_groups():
    """The re-audit: a partition's labels dict built in another order was refused on
    resume (its description followed insertion order); hens.optimizer(fe.optim.adam,
    lr=lrs) was recorded as a transform of one's own, so other rates loaded silently
    (0.62 off the loop)."""
    ens = fe.Ensemble([nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)) for _ in range(3)])
    names = list(ens.stacked_params())
    forward = {k: ("a" if k.endswith("bias") else "b") for k in names}
    backward = {k: forward[k] for k in reversed(names)}
    parts = {"a": fe.optim.sgd(0.1), "b": fe.optim.adam(1e-2)}
    saved = fe.optim.EnsembleOptimizer(ens, fe.optim.partition(parts, forward)).state_dict()
    fe.optim.EnsembleOptimizer(ens, fe.optim.partition(parts, backward)).load_state_dict(saved)

    hens = fe.HeteroEnsemble([nn.Linear(3, 2), nn.Linear(3, 4), nn.Linear(3, 2)])
    rates = torch.tensor([0.1, 0.2, 0.3])
    saved = fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam, lr=rates)).state_dict()
    same = fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam, lr=rates.clone()))
    same.load_state_dict(saved)
    other = fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam, lr=rates / 10))
    with pytest.raises(ValueError, match=r"expected the same transform and hyperparameters"):
        other.load_state_dict(saved)
    plain = fe.optim.EnsembleOptimizer(hens, fe.optim.adam(1e-2))  # one transform, every group
    fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam(1e-2))).load_state_dict(
        plain.state_dict()
    )


def test_an_optimizer_file_from_before_the_transform_record_still_loads(tmp_path):
    """fe.load refused a file without the record ('the file is missing leaf
    ['transform']'), which load_state_dict takes."""
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(3)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
    ens(torch.randn(4, 3)).sum().backward()
    opt.step()
    fe.save(tmp_path / "old.st", {"state": opt.state_dict()["state"]})  # the old layout
    fresh = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
    fe.load(tmp_path / "old.st", fresh)
    assert_trees_equal(fresh.state, opt.state)


def test_assigning_a_schedule_mid_run_keeps_the_moments_as_a_torch_scheduler_does():
    """A constant lr assigned a schedule (then a constant again) keeps Adam's moments;
    the schedule counts from 0, as a LambdaLR made mid-run (it raised at every step)."""
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double() for _ in range(3)
    ]
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01, foreach=True) for m in loop]
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=0.01))
    schedulers = []
    for step in range(8):
        if step == 3:
            opt.transform = fe.optim.adam(lr=lambda c: 0.01 * 0.5 ** c.double())
            schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda c: 0.5**c) for o in opts]
        if step == 6:
            opt.transform = fe.optim.adam(lr=0.003)
            for o in opts:
                o.param_groups[0]["lr"] = 0.003
            schedulers = []
        x = torch.randn(5, 3, dtype=torch.float64)
        for m, o in zip(loop, opts, strict=True):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        for s in schedulers:
            s.step()
        opt.zero_grad()
        ens(x).pow(2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        if 3 <= step < 6:
            assert opt.state[-1].count.item() == step - 2
    for name, p in ens.stacked_params().items():
        want = torch.stack([dict(m.named_parameters())[name] for m in loop])
        torch.testing.assert_close(p, want, rtol=1e-10, atol=1e-12, msg=name)
    # A schedule in place of another keeps its count (training.md); a constant in
    # between restarts it.
    opt.transform = fe.optim.adam(lr=lambda c: 0.01 * 0.5 ** c.double())
    opt.transform = fe.optim.adam(lr=lambda c: 0.02 * 0.5 ** c.double())
    assert opt.state[-1].count.item() == 0
    opt.zero_grad()
    ens(x).pow(2).mean(dim=(1, 2)).sum().backward()
    opt.step()
    opt.transform = fe.optim.adam(lr=lambda c: 0.03 * 0.5 ** c.double())
    assert opt.state[-1].count.item() == 1
    opt.transform = fe.optim.adam(lr=0.01)
    opt.transform = fe.optim.adam(lr=lambda c: 0.03 * 0.5 ** c.double())
    assert opt.state[-1].count.item() == 0
    # A transform keeping other state: refused by the next step, nothing changed.
    opt.transform = fe.optim.adam(lr=0.01, amsgrad=True)
    kept = copy.deepcopy((ens.state_dict(), opt.state))
    with pytest.raises(ValueError, match="adam"):
        opt.step()
    assert_trees_equal((ens.state_dict(), opt.state), kept)


def test_an_ensemble_converted_mid_run_says_how_to_keep_the_moments():
    """The step refuses a state of the old dtype and names the route that keeps the
    moments, which equals torch.optim's (its load_state_dict casts the state too)."""
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double() for _ in range(3)
    ]
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in loop]
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=0.01))
    x = torch.randn(5, 3, dtype=torch.float64)
    for m, o in zip(loop, opts, strict=True):
        m(x).pow(2).mean().backward()
        o.step()
    ens(x).pow(2).mean(dim=(1, 2)).sum().backward()
    opt.step()
    ens.float()
    ens.zero_grad()
    ens(x.float()).pow(2).mean(dim=(1, 2)).sum().backward()
    kept = copy.deepcopy(ens.state_dict())
    with pytest.raises(
        ValueError, match=r"new\.load_state_dict\(opt\.state_dict\(\)\) converts them"
    ):
        opt.step()
    assert_trees_equal(ens.state_dict(), kept)
    new = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=0.01))
    new.load_state_dict(opt.state_dict())
    new.step()
    for i, (m, o) in enumerate(zip(loop, opts, strict=True)):
        saved = o.state_dict()
        m.float()
        o = torch.optim.Adam(m.parameters(), lr=0.01)
        o.load_state_dict(saved)
        m.zero_grad()
        m(x.float()).pow(2).mean().backward()
        o.step()
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.stacked_params()[name][i], p, rtol=1e-6, atol=1e-7)


def test_a_transform_keeping_another_kind_of_state_says_how_to_go_on():
    """It advised passing "the state that this transform's init returned", which an
    EnsembleOptimizer's user never passes."""
    ens = fe.Ensemble([nn.Linear(3, 1) for _ in range(2)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(lr=0.1))
    ens(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.transform = fe.optim.sgd(lr=lambda c: 0.1 * 0.5 ** c.double(), momentum=0.9)
    kept = copy.deepcopy((ens.state_dict(), opt.state))
    with pytest.raises(
        TypeError, match=r"EnsembleOptimizer\.step: .* Build a new EnsembleOptimizer"
    ) as error:
        opt.step()
    assert "Pass the state" not in str(error.value)
    assert_trees_equal((ens.state_dict(), opt.state), kept)


def test_a_clip_put_in_front_mid_run_says_how_to_keep_the_moments():
    # Found by an audit: the chain's own words came out ("Pass the state that init
    # returned", "got EmptyState"), which an EnsembleOptimizer's user never passes.
    torch.manual_seed(0)
    loop = [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double() for _ in range(N)]
    ens = fe.Ensemble(copy.deepcopy(loop))
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
    torch_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in loop]
    for step in range(5):
        x = torch.randn(6, 3, dtype=torch.float64)
        if step == 2:
            opt.transform = fe.optim.chain(fe.optim.clip_by_global_norm(0.05), fe.optim.adam(1e-2))
        opt.zero_grad()
        ens(x).pow(2).mean(dim=(1, 2)).sum().backward()
        if step == 2:
            kept = copy.deepcopy((ens.state_dict(), opt.state))
            with pytest.raises(ValueError, match=r"EnsembleOptimizer\.step: .*chain") as error:
                opt.step()
            assert "opt.state = (fe.optim.EmptyState(), opt.state)" in str(error.value)
            assert_trees_equal((ens.state_dict(), opt.state), kept)
            opt.state = (fe.optim.EmptyState(), opt.state)  # as it advises
        opt.step()
        for m, o in zip(loop, torch_opts, strict=True):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            if step >= 2:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
    for name, p in ens.stacked_params().items():
        want = torch.stack([m.get_parameter(name) for m in loop])
        torch.testing.assert_close(p, want, rtol=1e-12, atol=1e-14)


def test_copy_members_with_a_transform_of_another_kind_is_refused_before_copying():
    """Its docstring: everything is checked before anything is written. Member 2's Adam
    moments were overwritten, then the next step refused the sgd transform."""
    torch.manual_seed(0)
    ens = fe.Ensemble([nn.Linear(3, 1) for _ in range(3)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=0.1))
    ens(torch.randn(4, 3)).sum().backward()
    opt.step()
    kept = copy.deepcopy(opt.state)
    with pytest.raises(ValueError, match=r"copy_members_: the transform given keeps another state"):
        opt.copy_members_(0, 2, transform=fe.optim.sgd(0.1))
    assert_trees_equal(opt.state, kept)
    opt.step()  # the optimizer goes on as it was


def test_loading_a_state_holding_meta_tensors_names_the_entry():
    """It raised torch's bare 'Cannot copy out of meta tensor; no data!'."""
    ens = fe.Ensemble([nn.Linear(3, 1) for _ in range(2)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=0.1))
    saved = opt.state_dict()
    key = next(k for k, v in saved["state"].items() if isinstance(v, torch.Tensor) and v.dim() > 1)
    saved["state"][key] = saved["state"][key].to("meta")
    kept = copy.deepcopy(opt.state)
    with pytest.raises(ValueError, match=rf"`{re.escape(key)}` is on the meta device"):
        opt.load_state_dict(saved)
    assert_trees_equal(opt.state, kept)
