"""fe.optim.partition against torch.optim's param groups, run per member."""

import copy

import pytest
import torch
from helpers import assert_trees_close, runtime_typecheck_off
from torch import nn

import funcensemble as fe

N, STEPS = 4, 5
TOLS = {torch.float64: {"rtol": 1e-12, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


def no_decay(name: str) -> str:
    return "no_decay" if name.endswith("bias") else "decay"


def members(dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)
    out = [nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype) for _ in range(N)]
    for m in out:
        m[0].bias.requires_grad_(False)  # frozen: no gradient, no state, as in torch.optim
    return out


def torch_groups(m: nn.Module, lr: float) -> torch.optim.AdamW:
    named = list(m.named_parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for k, p in named if no_decay(k) == "decay"], "weight_decay": 0.1},
            {"params": [p for k, p in named if no_decay(k) == "no_decay"], "weight_decay": 0.0},
        ],
        lr=lr,
    )


def ours(lr) -> fe.optim.GradientTransformation:
    return fe.optim.chain(
        fe.optim.clip_by_global_norm(0.5),
        fe.optim.partition(
            {
                "decay": fe.optim.adamw(lr, weight_decay=0.1),
                "no_decay": fe.optim.adamw(lr, weight_decay=0.0),
            },
            no_decay,
        ),
    )


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(N, 16, 5, generator=g, dtype=dtype), torch.randn(
        N, 16, 2, generator=g, dtype=dtype
    )


def loop_steps(modules, opts, dtype) -> None:
    for step in range(STEPS):
        x, y = batch(step, dtype)
        for i, (m, o) in enumerate(zip(modules, opts, strict=True)):
            o.zero_grad()
            ((m(x[i]) - y[i]) ** 2).mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("face", ["EnsembleOptimizer", "update", "update_"])
def test_matches_torch_param_groups_per_member(dtype, face):
    """AdamW with weight decay on weights only, clipped over each member's whole
    gradient, a frozen bias, per-member learning rates: each member as its own
    torch.optim.AdamW with two param groups and clip_grad_norm_."""
    lrs = torch.tensor([1e-2, 2e-2, 5e-3, 1e-3], dtype=dtype)
    loop = members(dtype)
    opts = [torch_groups(m, lrs[i].item()) for i, m in enumerate(loop)]
    loop_steps(loop, opts, dtype)

    ens = fe.Ensemble(members(dtype))
    transform = ours(lrs)
    if face == "EnsembleOptimizer":
        opt = fe.optim.EnsembleOptimizer(ens, transform)
    else:
        params = {
            k: v.detach().clone().requires_grad_(v.requires_grad)
            for k, v in ens.stacked_params().items()
        }
        state = transform.init(params)

    def loss(p, b, xi, yi):
        return ((ens.fmodel(p, b, xi) - yi) ** 2).mean()

    for step in range(STEPS):
        x, y = batch(step, dtype)
        if face == "EnsembleOptimizer":
            opt.zero_grad()
            ((ens(x, in_dims=0) - y) ** 2).mean(dim=(1, 2)).sum().backward()
            opt.step()
            continue
        _, grads, _ = fe.value_and_grad(loss, in_dims=0)(params, ens.stacked_buffers(), x, y)
        grads = {k: grads.get(k) if params[k].requires_grad else None for k in params}
        if face == "update_":
            state = transform.update_(grads, state, params)
        else:
            updates, state = transform.update(grads, state, params)
            params = fe.optim.apply_updates(params, updates)
    got = ens.stacked_params() if face == "EnsembleOptimizer" else params
    want = {k: torch.stack([dict(m.named_parameters())[k] for m in loop]) for k in got}
    assert_trees_close({k: v.detach() for k, v in got.items()}, want, **TOLS[dtype])
    state = opt.state if face == "EnsembleOptimizer" else state
    moments = state[1]["decay"][0].mu["2.weight"]
    torch.testing.assert_close(
        moments,
        torch.stack([o.state[m[2].weight]["exp_avg"] for m, o in zip(loop, opts, strict=True)]),
        **TOLS[dtype],
    )
    assert state[1]["no_decay"][0].mu["2.weight"] is None  # the other group's: no state
    assert state[1]["decay"][0].mu["0.bias"] is None  # frozen


def test_labels_may_be_a_dict_and_select_keeps_each_members_values():
    lrs = torch.tensor([1e-2, 2e-2, 3e-2, 4e-2], dtype=torch.float64)
    ens = fe.Ensemble(members(torch.float64))
    labels = {k: no_decay(k) for k in ens.stacked_params()}
    parts = {"decay": fe.optim.adamw(lrs, weight_decay=0.1), "no_decay": fe.optim.sgd(lrs, 0.9)}
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.partition(parts, labels))
    twin = fe.Ensemble(members(torch.float64))
    twin_opt = fe.optim.EnsembleOptimizer(twin, fe.optim.partition(parts, no_decay))
    for step in range(2):
        for e, o in ((ens, opt), (twin, twin_opt)):
            x, y = batch(step, torch.float64)
            o.zero_grad()
            ((e(x, in_dims=0) - y) ** 2).mean(dim=(1, 2)).sum().backward()
            o.step()
    assert_trees_close(ens.stacked_params(), twin.stacked_params(), rtol=0, atol=0)
    # Member surgery rebuilds each group's transform with the selected members' lr.
    idx = [2, 0]
    sub = ens.select(idx)
    sub_opt = opt.select(idx, sub)
    x, y = batch(9, torch.float64)
    sub_opt.zero_grad()
    ((sub(x[:2], in_dims=0) - y[:2]) ** 2).mean(dim=(1, 2)).sum().backward()
    sub_opt.step()
    full_x, full_y = torch.zeros_like(x), torch.zeros_like(y)
    full_x[idx], full_y[idx] = x[:2], y[:2]
    opt.zero_grad()
    ((ens(full_x, in_dims=0) - full_y) ** 2).mean(dim=(1, 2)).sum().backward()
    opt.step()
    for k, v in sub.stacked_params().items():
        assert torch.equal(v, ens.stacked_params()[k][idx]), k


def test_over_a_hetero_ensemble_each_group_is_partitioned():
    def mlp(width: int) -> nn.Module:
        return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 2)).double()

    torch.manual_seed(1)
    modules = [mlp(4), mlp(6), mlp(4)]
    loop = copy.deepcopy(modules)
    opts = [torch_groups(m, 1e-2) for m in loop]
    hens = fe.HeteroEnsemble(copy.deepcopy(modules))
    opt = fe.optim.EnsembleOptimizer(hens, ours(1e-2))
    for step in range(3):
        x, y = batch(step, torch.float64)
        for i, (m, o) in enumerate(zip(loop, opts, strict=True)):
            o.zero_grad()
            ((m(x[i]) - y[i]) ** 2).mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
        opt.zero_grad()
        ((hens(x[:3], in_dims=0) - y[:3]) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    for i, m in enumerate(loop):
        assert_trees_close(hens.member(i).state_dict(), m.state_dict(), **TOLS[torch.float64])


def test_bad_labels_and_transforms_are_refused_before_anything_changes():
    ens = fe.Ensemble(members(torch.float64))
    adam = fe.optim.adam(1e-3)
    with pytest.raises(ValueError, match=r"parameter `0\.weight` has no label"):
        fe.optim.EnsembleOptimizer(ens, fe.optim.partition({"a": adam}, {"2.bias": "a"}))
    with pytest.raises(ValueError, match=r"`0\.weight` has the label 'b', which transforms lacks"):
        fe.optim.EnsembleOptimizer(ens, fe.optim.partition({"a": adam}, lambda name: "b"))
    with runtime_typecheck_off():
        with pytest.raises(TypeError, match=r"transforms must be a non-empty dict"):
            fe.optim.partition([adam], no_decay)
        with pytest.raises(TypeError, match=r"transforms\['a'\] is not a GradientTransformation"):
            fe.optim.partition({"a": fe.optim.adam}, no_decay)
        with pytest.raises(TypeError, match=r"labels must be a dict of parameter name"):
            fe.optim.partition({"a": adam}, ["a"])
    # A later group that refuses its step leaves the earlier group's parameters and
    # state as they were.
    bad = fe.optim.partition(
        {"decay": fe.optim.adam(1e-2), "no_decay": fe.optim.sgd(torch.ones(3))}, no_decay
    )
    params = {k: v.detach().clone() for k, v in ens.stacked_params().items()}
    with pytest.raises(ValueError, match="lr has 3 per-member values"):
        state = bad.init(params)
    good = fe.optim.partition(
        {"decay": fe.optim.adam(1e-2), "no_decay": fe.optim.sgd(lambda c: torch.ones(3))},
        no_decay,
    )
    state = good.init(params)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    before = copy.deepcopy((params, state))
    with pytest.raises(ValueError, match="lr has 3 per-member values"):
        good.update_(grads, state, params)
    assert_trees_close((params, state), before, rtol=0, atol=0)


def no_decay_ab(name: str) -> str:
    return "b" if name.endswith("bias") else "a"


def test_a_parameter_moved_to_another_group_is_refused_and_labels_are_copied():
    """A state built with one labelling, stepped with another (opt.transform assigned),
    and a later edit of the caller's labels dict: the parameter's new group had no state
    for it and skipped it, so it stopped training (moved 0.0) without a word."""
    ens = fe.Ensemble(members(torch.float64))
    labels = {k: no_decay(k) for k in ens.stacked_params()}
    parts = {"decay": fe.optim.adam(1e-2), "no_decay": fe.optim.sgd(1e-2, momentum=0.9)}
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.partition(parts, labels))
    labels["2.bias"] = "decay"  # the partition keeps its own copy
    x, y = batch(0, torch.float64)
    for _ in range(2):
        opt.zero_grad()
        ((ens(x, in_dims=0) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        before = ens.stacked_params()["2.bias"].detach().clone()
        opt.step()
        assert not torch.equal(ens.stacked_params()["2.bias"], before)  # still training
    opt.transform = fe.optim.partition(parts, lambda name: "decay")
    kept = copy.deepcopy((ens.state_dict(), opt.state_dict()))
    with pytest.raises(ValueError, match=r"`2\.bias` has the label 'decay', but group 'decay'"):
        opt.step()
    assert_trees_close((ens.state_dict(), opt.state_dict()), kept, rtol=0, atol=0)
    # Out of a group that keeps no state per parameter (SGD without momentum) too.
    stateless = {"a": fe.optim.sgd(1e-2), "b": fe.optim.adam(1e-2)}
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.partition(stateless, no_decay_ab))
    opt.step()
    opt.transform = fe.optim.partition(stateless, lambda name: "b")
    with pytest.raises(ValueError, match=r"`0\.weight` has the label 'b', but group 'b'"):
        opt.step()


def test_select_takes_groups_whose_step_counts_differ_in_shape():
    """SGD with per-member momentum keeps [N] step counts, Adam 0-dim ones: select
    expanded every count to [N] and refused Adam's."""
    ens = fe.Ensemble([nn.Linear(3, 2).double() for _ in range(4)])
    momentum = torch.tensor([0.0, 0.5, 0.9, 0.9], dtype=torch.float64)
    parts = {"w": fe.optim.adam(1e-2), "b": fe.optim.sgd(0.1, momentum=momentum)}
    opt = fe.optim.EnsembleOptimizer(
        ens, fe.optim.partition(parts, lambda k: "b" if k.endswith("bias") else "w")
    )
    ens(torch.randn(4, 8, 3, dtype=torch.float64), in_dims=0).sum().backward()
    opt.step()
    sub = opt.select([1, 0], ens.select([1, 0]))
    assert torch.equal(
        sub.state["b"][0].momentum_buffer["bias"], opt.state["b"][0].momentum_buffer["bias"][[1, 0]]
    )


def test_a_label_function_over_a_hetero_ensemble_gets_the_stacked_names():
    """partition's docstring: over a HeteroEnsemble the label function is called with
    hens.stacked_params()'s names, groups.<g>.stacked.<member's name>."""
    hens = fe.HeteroEnsemble([nn.Linear(3, 2), nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))])
    seen = []

    def label(name: str) -> str:
        seen.append(name)
        return "all"

    fe.optim.EnsembleOptimizer(hens, fe.optim.partition({"all": fe.optim.sgd(0.1)}, label))
    assert set(seen) == set(hens.stacked_params())
    assert "groups.1.stacked.0.weight" in seen
