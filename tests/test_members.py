"""Member surgery (select, copy, append, drop) against the loop with the same surgery by hand.

The reference is a list of ordinary modules, each with its own torch.optim optimizer;
its surgery is what a user would write: ``copy.deepcopy`` of a module, and of its
optimizer's ``state_dict`` loaded into a new optimizer (hyperparameters included).
"""

import copy

import numpy as np
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

N = 4
LRS = [1e-2, 2e-2, 5e-3, 3e-2]
TOL = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-12},
    torch.float32: {"rtol": 2e-5, "atol": 2e-6},
}
# fe state field -> torch.optim per-parameter state key, per optimizer.
FIELDS = {
    "adam": {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"},
    "sgd": {"momentum_buffer": "momentum_buffer"},
    "rmsprop": {
        "step": "step",
        "square_avg": "square_avg",
        "momentum_buffer": "momentum_buffer",
        "grad_avg": "grad_avg",
    },
}


def torch_optimizer(kind: str, module: nn.Module, lr: float) -> torch.optim.Optimizer:
    params = module.parameters()
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.8, 0.99), weight_decay=1e-2, amsgrad=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, dampening=0.1, weight_decay=1e-2)
    return torch.optim.RMSprop(params, lr=lr, alpha=0.9, momentum=0.5, centered=True)


def fe_transform(kind: str, lr: torch.Tensor) -> fe.optim.GradientTransformation:
    if kind == "adam":
        return fe.optim.adam(lr=lr, betas=(0.8, 0.99), weight_decay=1e-2, amsgrad=True)
    if kind == "sgd":
        return fe.optim.sgd(lr=lr, momentum=0.9, dampening=0.1, weight_decay=1e-2)
    return fe.optim.rmsprop(lr=lr, alpha=0.9, momentum=0.5, centered=True)


class Loop:
    """The reference: modules and their own torch.optim optimizers."""

    def __init__(self, kind: str, modules: list[nn.Module], lrs: list[float]) -> None:
        self.kind = kind
        self.modules = modules
        self.opts = [torch_optimizer(kind, m, lr) for m, lr in zip(modules, lrs, strict=True)]

    def step(self, step: int) -> None:
        for i, (m, o) in enumerate(zip(self.modules, self.opts, strict=True)):
            o.zero_grad(set_to_none=True)
            optim_loss(m, step, i).backward()
            o.step()

    def copied(self, i: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Member i by hand: a deep copy of the module, and a new optimizer over it
        loaded with a deep copy of member i's optimizer state_dict (lr included)."""
        module = copy.deepcopy(self.modules[i])
        opt = torch_optimizer(self.kind, module, 0.0)
        opt.load_state_dict(copy.deepcopy(self.opts[i].state_dict()))
        return module, opt

    def select(self, indices: list[int]) -> None:
        pairs = [self.copied(i) for i in indices]
        self.modules, self.opts = [m for m, _ in pairs], [o for _, o in pairs]

    def copy(self, src: list[int], dst: list[int]) -> None:
        pairs = [self.copied(i) for i in src]
        for j, (m, o) in zip(dst, pairs, strict=True):
            self.modules[j], self.opts[j] = m, o

    def append(self, modules: list[nn.Module], lrs: list[float]) -> None:
        for m, lr in zip(modules, lrs, strict=True):
            self.modules.append(m)
            self.opts.append(torch_optimizer(self.kind, m, lr))

    def set_lr(self, member: int, lr: float) -> None:
        for group in self.opts[member].param_groups:
            group["lr"] = lr


def ensemble_step(ens: fe.Ensemble, opt: fe.optim.EnsembleOptimizer, step: int) -> None:
    opt.zero_grad()
    dtype = ens.stacked.fc1.weight.dtype
    xs, ys = zip(*[optim_batch(step, i, dtype=dtype) for i in range(len(ens))], strict=True)
    out = ens(torch.stack(xs), in_dims=0)
    ((out - torch.stack(ys)) ** 2).mean(dim=(1, 2)).sum().backward()
    opt.step()


def assert_same(ens: fe.Ensemble, opt: fe.optim.EnsembleOptimizer, loop: Loop) -> None:
    tol = TOL[ens.stacked.fc1.weight.dtype]
    assert len(ens) == len(loop.modules)
    for i, m in enumerate(loop.modules):
        mine = ens.member(i)
        for name, t in m.state_dict().items():
            torch.testing.assert_close(mine.state_dict()[name], t, **tol, msg=f"{i} {name}")
    state = opt.state[0]
    for field, key in FIELDS[loop.kind].items():
        tree = getattr(state, field)
        for name in ens.stacked_params():
            ours = tree[name]
            theirs = [
                o.state[m.get_parameter(name)] for m, o in zip(loop.modules, loop.opts, strict=True)
            ]
            if not any(theirs):  # never stepped (the unused layer): no torch state
                assert ours is None or not bool(ours.any()), (field, name)
                continue
            # A member that joined and has not stepped yet has no torch state: zeros.
            if field in ("count", "step"):  # one per parameter, or one per member
                counts = ours.expand(len(theirs)).tolist()
                assert counts == [t[key].item() if t else 0.0 for t in theirs], (field, name)
                continue
            zeros = torch.zeros_like(ours[0])
            expected = torch.stack([t[key] if t else zeros for t in theirs])
            torch.testing.assert_close(ours, expected, **tol, msg=f"{field} {name}")


def start(kind: str, dtype: torch.dtype) -> tuple[fe.Ensemble, fe.optim.EnsembleOptimizer, Loop]:
    modules = optim_net_members(N, dtype=dtype)
    ens = fe.Ensemble(copy.deepcopy(modules))
    opt = fe.optim.EnsembleOptimizer(ens, fe_transform(kind, torch.tensor(LRS, dtype=dtype)))
    return ens, opt, Loop(kind, modules, LRS)


# --- the module face ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["adam", "sgd", "rmsprop"])
def test_copy_then_steps_equals_the_loop(kind, dtype):
    ens, opt, loop = start(kind, dtype)
    for step in range(3):
        loop.step(step)
        ensemble_step(ens, opt, step)
    params = ens.stacked_params()
    # Exploit: members 0 and 1 over 3 and 2, then explore: a new lr for member 2.
    ens.copy_members_([0, 1], [3, 2])
    opt.copy_members_([0, 1], [3, 2])
    loop.copy([0, 1], [3, 2])
    assert_same(ens, opt, loop)
    assert all(p is params[k] for k, p in ens.stacked_params().items())  # same tensors
    lr = torch.tensor([LRS[0], LRS[1], LRS[1] * 1.25, LRS[0]], dtype=dtype)
    opt.transform = fe_transform(kind, lr)
    loop.set_lr(2, LRS[1] * 1.25)
    for step in range(3, 6):
        loop.step(step)
        ensemble_step(ens, opt, step)
    assert_same(ens, opt, loop)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["adam", "sgd", "rmsprop"])
def test_select_then_steps_equals_the_loop(kind, dtype):
    ens, opt, loop = start(kind, dtype)
    for step in range(3):
        loop.step(step)
        ensemble_step(ens, opt, step)
    indices = [2, 0, -4, 1]  # drop member 3, member 0 twice (negative counts back)
    new = ens.select(indices)
    opt = opt.select(indices, new)
    loop.select([2, 0, 0, 1])
    assert_same(new, opt, loop)
    for step in range(3, 6):
        loop.step(step)
        ensemble_step(new, opt, step)
    assert_same(new, opt, loop)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["adam", "sgd", "rmsprop"])
@pytest.mark.parametrize("stepped", [0, 3])
def test_append_then_steps_equals_the_loop(kind, dtype, stepped):
    ens, opt, loop = start(kind, dtype)
    for step in range(stepped):
        loop.step(step)
        ensemble_step(ens, opt, step)
    extra = optim_net_members(2, dtype=dtype, seed=7)
    grown = ens.concat(copy.deepcopy(extra))
    lrs = [*LRS, 4e-2, 1e-3]
    opt = opt.concat(grown, transform=fe_transform(kind, torch.tensor(lrs, dtype=dtype)))
    loop.append(extra, lrs[N:])
    assert_same(grown, opt, loop)
    for step in range(stepped, stepped + 3):
        loop.step(step)
        ensemble_step(grown, opt, step)
    assert_same(grown, opt, loop)
    # Surgery goes on with per-member step counts: a new member over an old one.
    opt.copy_members_(5, 0)
    grown.copy_members_(5, 0)
    loop.copy([5], [0])
    kept = grown.select([0, 2, 5])
    opt = opt.select([0, 2, 5], kept)
    loop.select([0, 2, 5])
    for step in range(stepped + 3, stepped + 5):
        loop.step(step)
        ensemble_step(kept, opt, step)
    assert_same(kept, opt, loop)


def test_per_member_counts_survive_a_checkpoint(tmp_path):
    ens, opt, loop = start("adam", torch.float64)
    for step in range(2):
        loop.step(step)
        ensemble_step(ens, opt, step)
    extra = optim_net_members(1, seed=9)
    grown = ens.concat(copy.deepcopy(extra))
    transform = fe_transform("adam", torch.tensor([*LRS, 1e-2], dtype=torch.float64))
    opt = opt.concat(grown, transform=transform)
    loop.append(extra, [1e-2])
    torch.save({"ens": grown.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = fe.Ensemble(optim_net_members(5, seed=3))
    resumed.load_state_dict(saved["ens"])
    resumed_opt = fe.optim.EnsembleOptimizer(resumed, transform)  # shared counts at 0
    resumed_opt.load_state_dict(saved["opt"])
    assert resumed_opt.state[0].count["fc1.weight"].tolist() == [2.0] * 4 + [0.0]
    for step in range(2, 4):
        loop.step(step)
        ensemble_step(resumed, resumed_opt, step)
    assert_same(resumed, resumed_opt, loop)


def test_drop_then_append_keeps_float_hyperparameters():
    modules = optim_net_members(3)
    ens = fe.Ensemble(copy.deepcopy(modules))
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(lr=0.1))
    kept = ens.select([0, 2])
    opt = opt.select([0, 2], kept)
    ens = kept.concat(copy.deepcopy(modules[1:2]))
    opt = opt.concat(ens)  # a float lr: the same transform fits the grown ensemble
    loop = [modules[0], modules[2], modules[1]]
    torch_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in loop]
    for step in range(3):
        for i, (m, o) in enumerate(zip(loop, torch_opts, strict=True)):
            o.zero_grad()
            optim_loss(m, step, i).backward()
            o.step()
        ensemble_step(ens, opt, step)
    for i, m in enumerate(loop):
        for name, t in m.state_dict().items():
            torch.testing.assert_close(ens.member(i).state_dict()[name], t, **TOL[torch.float64])


def test_selected_parameters_are_fresh_leaves_keeping_requires_grad_dtype_and_flags():
    modules = optim_net_members(3)
    for m in modules:
        m.fc1.weight.requires_grad_(False)
        m.eval()
    ens = fe.Ensemble(modules, randomness="same", chunk_size=2)
    for new in (ens.select([1, 1]), ens.concat([copy.deepcopy(modules[0])])):
        params = new.stacked_params()
        assert all(p.is_leaf for p in params.values())
        assert not params["fc1.weight"].requires_grad and params["fc2.weight"].requires_grad
        assert params["fc2.weight"].dtype == torch.float64 and not new.training
        assert (new.randomness, new.chunk_size) == ("same", 2)
        assert params["fc2.weight"].data_ptr() != ens.stacked.fc2.weight.data_ptr()

    def hook(module, args, out):
        return out * 0

    ens.stacked.fc2.register_forward_hook(hook)
    x = torch.randn(5, 4, dtype=torch.float64)
    extra = copy.deepcopy(modules[0])
    with pytest.raises(ValueError, match="member 3 has 0 forward hook"):
        ens.concat([extra])  # a new member must have the ensemble's hooks too
    extra.fc2.register_forward_hook(hook)
    for new in (ens.select([2, 0]), ens.concat([extra])):
        assert not new(x).any()  # the hook came along
    twice = ens.select([1, 1])
    with torch.no_grad():
        twice.stacked.fc2.weight[0] += 1  # duplicates are independent copies
    assert not torch.equal(twice.stacked.fc2.weight[0], twice.stacked.fc2.weight[1])
    assert torch.equal(twice.stacked.fc2.weight[1], ens.stacked.fc2.weight[1])
    assert torch.equal(twice.stacked_buffers()["bn.num_batches_tracked"], torch.zeros(2).long())


def test_copy_takes_index_tensors_as_argsort_gives_them():
    ens, opt, loop = start("sgd", torch.float64)
    ensemble_step(ens, opt, 0)
    loop.step(0)
    ranked = torch.tensor([2, 0, 3, 1])
    ens.copy_members_(ranked[:2], ranked[-2:])
    opt.copy_members_(ranked[:2], ranked[-2:])
    loop.copy([2, 0], [3, 1])
    ens.copy_members_(ranked[0], ranked[1])  # 0-dim tensors: one member each
    opt.copy_members_(ranked[0], ranked[1])
    loop.copy([2], [0])
    assert_same(ens, opt, loop)


def test_numpy_indices_and_argmin_pick_members_as_ints_do():
    # Found by a new-user audit: ens.member(losses.argmin()), ens.member(np.int64),
    # ens.select(np.argsort(...)[:2]) and copy_members_ of NumPy integers were refused.
    ens, opt, loop = start("sgd", torch.float64)
    ensemble_step(ens, opt, 0)
    loop.step(0)
    scores = np.array([0.3, 0.1, 0.5, 0.2])
    best = np.argsort(scores)[:2]  # [1, 3], int64
    for index in (best[0], torch.tensor(scores).argmin(), np.array(1), torch.tensor(-3)):
        for name, p in ens.member(index).named_parameters():
            assert torch.equal(p, ens.stacked_params()[name][1])
    kept, ints = ens.select(best), ens.select([1, 3])
    assert_trees_equal(kept.stacked_params(), ints.stacked_params())
    assert_trees_equal(opt.select(best, kept).state, opt.select([1, 3], ints).state)
    assert_trees_equal(fe.select(opt.state, best.astype(np.uint8)), fe.select(opt.state, [1, 3]))
    ens.copy_members_(best[0], np.int32(0))
    opt.copy_members_(best[:1], np.array([0]))
    loop.copy([1], [0])
    assert_same(ens, opt, loop)
    hens = fe.HeteroEnsemble([nn.Linear(2, 1), nn.Linear(2, 3)])
    assert hens.member(np.int64(1)).out_features == 3
    with runtime_typecheck_off():
        for bad, match in [
            (np.array([True, False, True, False]), r"NumPy array must be 1-D of integers.*mask"),
            (np.array([[0]]), r"NumPy array must be 1-D of integers, got shape \(1, 1\)"),
            (np.array([0.0]), r"NumPy array must be 1-D of integers.*float64"),
        ]:
            with pytest.raises(TypeError, match=match):
                ens.select(bad)
        for bad in (np.bool_(True), torch.tensor(True), torch.tensor(1.0), np.array([1])):
            with pytest.raises(TypeError, match=r"index must be an int \(expected a member"):
                ens.member(bad)


def test_copy_swaps_and_leaves_grads_alone():
    ens = fe.Ensemble(optim_net_members(3))
    before = {k: v.detach().clone() for k, v in ens.stacked_params().items()}
    ens.stacked.fc2.weight.grad = torch.ones_like(ens.stacked.fc2.weight)
    ens.copy_members_([0, 1], [1, 0])
    for k, v in ens.stacked_params().items():
        assert torch.equal(v[0], before[k][1]) and torch.equal(v[1], before[k][0])
        assert torch.equal(v[2], before[k][2]) and v.is_leaf
    assert torch.equal(ens.stacked.fc2.weight.grad, torch.ones_like(ens.stacked.fc2.weight))


# --- the functional face ------------------------------------------------------------------


def test_functional_select_then_update_equals_the_loop():
    modules = optim_net_members(N)
    fmodel, params, buffers = fe.stack(copy.deepcopy(modules))
    transform = fe_transform("adam", torch.tensor(LRS, dtype=torch.float64))
    state = transform.init(params)
    loop = Loop("adam", modules, LRS)

    def step(k):
        n = params["fc1.weight"].shape[0]
        xs, ys = zip(*[optim_batch(k, i) for i in range(n)], strict=True)
        grads, new_buffers = _grads(fmodel, params, buffers, torch.stack(xs), torch.stack(ys))
        return new_buffers, transform.update_(grads, state, params)

    for k in range(3):
        loop.step(k)
        buffers, state = step(k)
    idx = [3, 3, 1]
    params, buffers = fe.select(params, idx), fe.select(buffers, idx)
    transform, state = fe.optim.select(transform, state, idx)
    loop.select(idx)
    for k in range(3, 6):
        loop.step(k)
        buffers, state = step(k)
    for i, m in enumerate(loop.modules):
        for name, t in m.named_parameters():
            torch.testing.assert_close(params[name][i], t.detach(), **TOL[torch.float64])
        for name, t in m.named_buffers():
            torch.testing.assert_close(buffers[name][i], t, **TOL[torch.float64])
    for name in params:
        theirs = [
            o.state[m.get_parameter(name)] for m, o in zip(loop.modules, loop.opts, strict=True)
        ]
        if theirs[0]:
            mu = torch.stack([t["exp_avg"] for t in theirs])
            torch.testing.assert_close(state[0].mu[name], mu, **TOL[torch.float64])
            assert state[0].count[name].item() == theirs[0]["step"].item()


def _grads(fmodel, params, buffers, xs, ys):
    """Each member's gradient of its own loss; BatchNorm's buffers update in place."""
    out = fe.vmap(fmodel, in_dims=0)(params, buffers, xs)
    total = ((out - ys) ** 2).mean(dim=(1, 2)).sum()
    names = [k for k, v in params.items() if v.requires_grad]
    grads = torch.autograd.grad(total, [params[k] for k in names], allow_unused=True)
    return dict(zip(names, grads, strict=True)), buffers


def test_optim_select_picks_every_per_member_hyperparameter():
    params = {"w": torch.zeros(3, 2, dtype=torch.float64)}
    betas = (torch.tensor([0.5, 0.8, 0.9]), 0.99)
    eps = torch.tensor([1e-8, 1e-6, 1e-4])
    lr = torch.tensor([0.1, 0.2, 0.3])
    transform = fe.optim.chain(
        fe.optim.clip_by_global_norm(torch.tensor([1.0, 2.0, 3.0])),
        fe.optim.adamw(lr=lr, betas=betas, eps=eps, weight_decay=torch.tensor([0.0, 0.1, 0.2])),
    )
    state = transform.init(params)
    idx = [2, 0]
    mine, mine_state = fe.optim.select(transform, state, idx)
    theirs = fe.optim.chain(
        fe.optim.clip_by_global_norm(torch.tensor([3.0, 1.0])),
        fe.optim.adamw(
            lr=lr[idx],
            betas=(betas[0][idx], 0.99),
            eps=eps[idx],
            weight_decay=torch.tensor([0.2, 0.0]),
        ),
    )
    grads = {"w": torch.randn(2, 2, dtype=torch.float64) * 10}
    sub = fe.select(params, idx)
    ours = mine.update(grads, mine_state, sub)
    assert_trees_equal(ours, theirs.update(grads, theirs.init(sub), sub))
    lr[0] = 5.0  # the user's tensor, edited after building: the selection is unaffected
    again, again_state = fe.optim.select(transform, state, [0])
    one = fe.select(params, [0])
    alone = again.update({"w": grads["w"][1:]}, again_state, one)[0]["w"]
    torch.testing.assert_close(alone, ours[0]["w"][1:], rtol=1e-12, atol=0)


def test_fe_select_and_concat_on_trees():
    tree = {"a": torch.arange(6.0).reshape(3, 2), "count": torch.tensor(4.0), "none": None}
    out = fe.select(tree, torch.tensor([2, 0]))
    assert torch.equal(out["a"], torch.tensor([[4.0, 5.0], [0.0, 1.0]]))
    assert out["count"].item() == 4.0 and out["count"] is not tree["count"] and out["none"] is None
    both = fe.concat([tree, out])
    assert torch.equal(both["a"][3:], out["a"]) and both["count"].item() == 4.0
    frozen = {"w": torch.zeros(2, 3, requires_grad=True)}
    assert fe.select(frozen, [1])["w"].is_leaf and fe.select(frozen, [1])["w"].requires_grad


# --- refused before anything changes ------------------------------------------------------


def snapshot(ens, opt):
    return (
        {k: v.detach().clone() for k, v in ens.state_dict().items()},
        [None if s is None else s.clone() for s in _leaves(opt.state)],
        opt.transform,
    )


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree, none_is_leaf=True)


@pytest.mark.parametrize(
    ("src", "dst", "error", "match"),
    [
        (0, 4, IndexError, r"copy_members_: dst\[0\] is 4, out of range for 4 members"),
        ([0, 1], [2, 2], ValueError, "dst names member 2 more than once"),
        ([0, 1], [2], ValueError, "src and dst must pair up"),
        (True, 1, TypeError, r"src must be a sequence of ints"),
        (
            [0.0],
            [1],
            TypeError,
            r"src\[0\] must be an int \(expected a member index, got float 0\.0\)",
        ),
        ([], [], ValueError, "src is empty"),
        (-5, 0, IndexError, r"src\[0\] is -5"),
    ],
)
def test_bad_copies_raise_before_anything_changes(src, dst, error, match):
    ens, opt, _ = start("adam", torch.float64)
    ensemble_step(ens, opt, 0)
    before = snapshot(ens, opt)
    for call in (ens.copy_members_, opt.copy_members_):
        with runtime_typecheck_off(), pytest.raises(error, match=match):
            call(src, dst)
    after = snapshot(ens, opt)
    assert_trees_equal(before[0], after[0])
    assert_trees_equal(before[1], after[1])
    assert before[2] is after[2]


@pytest.mark.parametrize(
    ("indices", "error", "match"),
    [
        ([], ValueError, "indices is empty"),
        ([0, 4], IndexError, r"indices\[1\] is 4"),
        (torch.tensor([[0]]), TypeError, "1-D integer tensor"),
        (torch.tensor([True, False, True, True]), TypeError, "boolean mask"),
        ("01", TypeError, "sequence of ints"),
    ],
)
def test_bad_selections_raise(indices, error, match):
    ens, opt, _ = start("sgd", torch.float64)
    with runtime_typecheck_off():  # as a user runs it: the library's own checks speak
        for call in (ens.select, lambda i: opt.select(i, ens), lambda i: fe.select(opt.state, i)):
            with pytest.raises(error, match=match):
                call(indices)
        with pytest.raises(error, match=match):
            fe.optim.select(opt.transform, opt.state, indices)


def test_the_optimizer_refuses_parameters_that_do_not_fit_the_selection():
    ens, opt, _ = start("adam", torch.float64)
    with pytest.raises(
        ValueError, match=r"EnsembleOptimizer.select: params has 4 members, but 2 are selected"
    ):
        opt.select([0, 1], ens)  # the old, 4-member ensemble


def test_a_stepped_schedule_refuses_new_members():
    ens = fe.Ensemble(optim_net_members(2))
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=lambda count: 0.1 / (1 + count)))
    ensemble_step(ens, opt, 0)
    grown = ens.concat(optim_net_members(1))
    state = [s.clone() for s in _leaves(opt.state) if s is not None]
    with pytest.raises(ValueError, match="schedule has been called 1 times"):
        opt.concat(grown)
    assert_trees_equal(state, [s for s in _leaves(opt.state) if s is not None])


def test_old_per_member_values_do_not_fit_new_members():
    ens, opt, _ = start("adam", torch.float64)
    grown = ens.concat(optim_net_members(1))
    with pytest.raises(ValueError, match=r"lr has 4 per-member values but .* leading size 5"):
        opt.concat(grown)


def test_concat_refuses_another_architecture_naming_the_member():
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(2)])
    with pytest.raises(ValueError, match="member 3"):
        ens.concat([nn.Linear(3, 2), nn.Linear(3, 4)])
    with pytest.raises(ValueError, match="member 2"):
        ens.concat([nn.Linear(3, 2).double()])
    with pytest.raises(TypeError, match="single Linear"):
        ens.concat(nn.Linear(3, 2))


def test_a_transform_of_your_own_needs_an_explicit_one():
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(3)])
    mine = fe.optim.GradientTransformation(
        lambda params: fe.optim.EmptyState(),
        lambda updates, state, params=None: (updates, state),
    )
    opt = fe.optim.EnsembleOptimizer(ens, mine)
    with pytest.raises(TypeError, match="built by your own code"):
        opt.copy_members_(0, 1)
    opt.copy_members_(0, 1, transform=mine)
    with pytest.raises(TypeError, match="built by your own code"):
        fe.optim.select(fe.optim.chain(fe.optim.sgd(0.1), mine), (), [0])


def test_a_schedule_of_per_member_values_is_refused_but_a_shared_one_is_kept():
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(3)])
    base = torch.tensor([0.1, 0.2, 0.3])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=lambda count: base * 0.9**count))
    with pytest.raises(TypeError, match=r"adam\(lr=...\) is a schedule returning per-member"):
        opt.copy_members_(0, 1)
    with pytest.raises(TypeError, match="schedule returning per-member"):
        opt.select([0], ens.select([0]))
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(lr=lambda count: 0.1 * 0.9**count))
    ens(torch.randn(4, 3)).sum().backward()
    opt.step()
    kept = opt.select([2, 0], ens.select([2, 0]))
    assert kept.state[-1].count.item() == 1  # the schedule's count, shared, goes along


def test_concat_of_two_ensembles_keeps_every_member_in_order():
    a = fe.Ensemble(optim_net_members(2))
    b = fe.Ensemble(optim_net_members(3, seed=5))
    both = a.concat(b)
    assert len(both) == 5
    for i, ens_i in enumerate([(a, 0), (a, 1), (b, 0), (b, 1), (b, 2)]):
        ens, j = ens_i
        assert_trees_equal(both.member(i).state_dict(), ens.member(j).state_dict())
    with pytest.raises(ValueError, match="member 2 has parameter `weight`"):
        fe.Ensemble([nn.Linear(3, 2) for _ in range(2)]).concat(fe.Ensemble([nn.Linear(3, 4)]))


@pytest.mark.parametrize(
    ("trees", "error", "match"),
    [
        ([], ValueError, r"trees is empty \(expected at least one pytree, got 0\)"),
        ([{"w": torch.zeros(2, 3)}, {"v": torch.zeros(2, 3)}], ValueError, "structure"),
        ([{"w": torch.zeros(2, 3)}, {"w": torch.zeros(2, 4)}], ValueError, r"shape \(\*, \(3,\)\)"),
        (
            [{"w": torch.zeros(2, 3)}, {"w": torch.zeros(2, 3, dtype=torch.float64)}],
            ValueError,
            "torch.float64",
        ),
        (
            [
                {"c": torch.tensor(1.0), "w": torch.zeros(2)},
                {"c": torch.tensor(2.0), "w": torch.zeros(1)},
            ],
            ValueError,
            "one value shared by all members",
        ),
        ([{"w": torch.zeros(2)}, {"w": None}], TypeError, "is a NoneType"),
        ([{"w": torch.zeros(2, 3), "v": torch.zeros(3)}], ValueError, "leading size 2, but"),
    ],
)
def test_bad_concats_raise(trees, error, match):
    with pytest.raises(error, match=match):
        fe.concat(trees)


def test_select_and_concat_keep_the_ensembles_own_hooks():
    """Forward (pre-)hooks and full backward hooks registered on the Ensemble itself
    come along, as copies: a handle from the old ensemble removes its hook there only."""
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))  # noqa: E731
    ens = fe.Ensemble([make() for _ in range(3)])
    seen = []
    handles = [
        ens.register_forward_pre_hook(lambda m, args: seen.append("pre")),
        ens.register_forward_hook(lambda m, args, out: out * 2),
        ens.register_forward_hook(lambda m, args, kwargs, out: seen.append("kw"), with_kwargs=True),
        ens.register_full_backward_hook(lambda m, gi, go: seen.append("backward")),
    ]
    x = torch.randn(5, 3, requires_grad=True)  # a full backward hook warns without
    plain = fe.Ensemble([make() for _ in range(3)])  # no hooks: the forward hook doubles
    for new, members in ((ens.select([2, 0]), [2, 0]), (ens.concat([make()]), [0, 1, 2])):
        seen.clear()
        out = new(x)
        with torch.no_grad():
            want = torch.stack([ens.member(i)(x) for i in members]) * 2
        torch.testing.assert_close(out[: len(members)], want)
        out.sum().backward()
        assert seen == ["pre", "kw", "backward"]
    kept = ens.select([0])
    for handle in handles:
        handle.remove()
    seen.clear()
    kept(x).sum().backward()
    assert seen == ["pre", "kw", "backward"]  # removed from ens only
    seen.clear()
    ens(x).sum().backward()
    assert seen == []
    assert plain.select([0])._forward_hooks == {}


def test_select_does_not_carry_state_dict_hooks_on_the_ensemble_itself():
    """surgery.md: state-dict hooks registered on the Ensemble itself stay behind."""
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(2)])
    ens.register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)
    assert ens._state_dict_pre_hooks
    assert not ens.select([1, 0])._state_dict_pre_hooks


@pytest.mark.parametrize(
    "transform",
    [
        lambda n: fe.optim.adam(lr=1e-2),
        lambda n: fe.optim.sgd(lr=0.1, momentum=0.9),
        lambda n: fe.optim.rmsprop(lr=1e-2, momentum=0.5, centered=True),
        lambda n: fe.optim.adam(lr=torch.linspace(1e-2, 3e-2, n)),
    ],
    ids=["adam", "sgd-momentum", "rmsprop", "adam-per-member-lr"],
)
def test_stepping_what_select_and_concat_return_leaves_their_inputs_as_they_were(transform):
    """surgery.md: select and concat return new objects and leave their inputs as they
    were; the old optimizer is unchanged. Checked after stepping the new ones in place
    (an aliased tensor, such as a 0-dim step count kept as it is, would change too)."""
    import optree

    torch.manual_seed(0)
    ens = fe.Ensemble([nn.Linear(4, 2).double() for _ in range(3)])
    opt = fe.optim.EnsembleOptimizer(ens, transform(3))
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        ens(x, in_dims=0).pow(2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    leaves = lambda tree: optree.tree_leaves(tree, none_is_leaf=True)  # noqa: E731
    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in leaves(opt.state)]
    params = {k: v.detach().clone() for k, v in ens.stacked_params().items()}
    for index in ([0, 1, 2], [2, 1]):
        new = ens.select(index)
        new_opt = opt.select(index, new)
        for _ in range(2):
            new_opt.zero_grad()
            new(x[index], in_dims=0).pow(2).mean(dim=(1, 2)).sum().backward()
            new_opt.step()
    # The functional face's concat: the grown state, stepped in place (one value more
    # for a per-member rate: the transform that steps the grown ensemble).
    added = {k: v.detach() for k, v in fe.stack([nn.Linear(4, 2).double()])[1].items()}
    grown_params = fe.concat([params, added])
    grown_tx = transform(4)
    grown = fe.optim.concat(grown_tx, opt.state, grown_params)
    grown_tx.update_({k: torch.randn_like(v) for k, v in grown_params.items()}, grown, grown_params)
    for got, want in zip(leaves(opt.state), before, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
    for k, v in ens.stacked_params().items():
        assert torch.equal(v, params[k]), k


def test_optimizer_states_of_different_step_counts_join_as_the_refusal_advises():
    # fe.concat refuses two Adam states whose shared step counts differ; it advised
    # fe.optim.concat, which gives the joining members a fresh state (their moments
    # lost). Its advice now: per-member counts first; then each member goes on as
    # its own loop member.
    torch.manual_seed(0)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()

    first, second = [make() for _ in range(2)], [make() for _ in range(3)]
    loops = copy.deepcopy(first), copy.deepcopy(second)
    x = torch.randn(6, 3, dtype=torch.float64)
    opt = fe.optim.adam(1e-2)

    def train(mods, steps):
        fmodel, params, buffers = fe.stack(mods)
        state = opt.init(params)
        step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).pow(2).mean())
        for _ in range(steps):
            _, grads, buffers = step(params, buffers, x)
            state = opt.update_(grads, state, params)
        return step, params, buffers, state

    step, p1, b1, s1 = train(first, 3)
    _, p2, b2, s2 = train(second, 2)
    with pytest.raises(ValueError, match=r"count.expand\(n\).clone\(\)"):
        fe.concat([s1, s2])

    def per_member(state, n):
        adam = state[0]
        counts = {k: c.expand(n).clone() for k, c in adam.count.items()}
        return (adam._replace(count=counts), *state[1:])

    params, buffers = fe.concat([p1, p2]), fe.concat([b1, b2])
    state = fe.concat([per_member(s1, 2), per_member(s2, 3)])
    for _ in range(3):
        _, grads, buffers = step(params, buffers, x)
        state = opt.update_(grads, state, params)
    expected = []
    for mods, steps in zip(loops, (3, 2), strict=True):
        for m in mods:
            torch_opt = torch.optim.Adam(m.parameters(), lr=1e-2)
            for _ in range(steps + 3):
                torch_opt.zero_grad()
                m(x).pow(2).mean().backward()
                torch_opt.step()
            expected.append(m)
    for name in params:
        torch.testing.assert_close(
            params[name],
            torch.stack([m.get_parameter(name).detach() for m in expected]),
            rtol=1e-12,
            atol=1e-12,
        )
