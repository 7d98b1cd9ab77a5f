"""fe.HeteroEnsemble against the plain loop over its members with torch.optim, per member.

The members mix four architectures in an interleaved order: two MLP widths, an MLP with
BatchNorm (buffers), and a single Linear (a group of one). Every test compares with the
loop over ordinary copies of the members: outputs, losses, gradients, parameters,
buffers and optimizer state, over several steps.
"""

import copy
import functools

import optree
import pytest
import torch
from helpers import assert_trees_close, runtime_typecheck_off
from torch import nn
from torch.nn import functional as F

import funcensemble as fe

STEPS = 3
# float64: the same math through batched and per-member kernels agrees to rounding.
# float32: a few ulps per operation, carried through the steps (explicit, generous).
TOLS = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
}


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))


def bn_mlp() -> nn.Module:
    # No bias before BatchNorm: it cancels it, its gradient is rounding noise, and Adam
    # would turn that noise into full-size steps that differ between equal computations.
    return nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


# Member order -> architecture: groups (0, 3, 6), (1, 5), (2, 4), (7,).
KINDS = ("a", "b", "bn", "a", "bn", "b", "a", "lin")
GROUPS = ((0, 3, 6), (1, 5), (2, 4), (7,))
N = len(KINDS)


def members(dtype: torch.dtype, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    build = {"a": lambda: mlp(6), "b": lambda: mlp(10), "bn": bn_mlp}
    build["lin"] = lambda: nn.Linear(4, 2)
    return [build[k]().to(dtype) for k in KINDS]


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch per member: ``[N, 16, 4]`` inputs and ``[N, 16, 2]`` targets."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(N, 16, 4, generator=g, dtype=dtype)
    return x, torch.randn(N, 16, 2, generator=g, dtype=dtype)


LRS = torch.linspace(0.01, 0.05, N, dtype=torch.float64)
BETA2 = torch.linspace(0.99, 0.999, N, dtype=torch.float64)


def loop_adam(modules: list[nn.Module]) -> list[torch.optim.Adam]:
    return [
        torch.optim.Adam(m.parameters(), lr=LRS[i].item(), betas=(0.9, BETA2[i].item()))
        for i, m in enumerate(modules)
    ]


def loop_step(modules, opts, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the loop; its outputs ``[N, ...]`` and losses ``[N]``."""
    outs, losses = [], []
    for i, (m, opt) in enumerate(zip(modules, opts, strict=True)):
        opt.zero_grad()
        out = m(x[i])
        loss = F.mse_loss(out, y[i])
        loss.backward()
        opt.step()
        outs.append(out.detach())
        losses.append(loss.detach())
    return torch.stack(outs), torch.stack(losses)


def member_grad(hens: fe.HeteroEnsemble, i: int, grads: dict) -> dict:
    """Member i's gradients from a flat dict of stacked ones, by its own names."""
    g = next(k for k, members in enumerate(hens.group_members) if i in members)
    position = hens.group_members[g].index(i)
    prefix = f"groups.{g}.stacked."
    return {
        k[len(prefix) :]: None if v is None else v[position]
        for k, v in grads.items()
        if k.startswith(prefix)
    }


def assert_members_match(hens, modules, opts, tol) -> None:
    """Parameters, buffers and Adam state of every member equal the loop's."""
    for i, m in enumerate(modules):
        assert_trees_close(hens.member(i).state_dict(), m.state_dict(), **tol)
    if opts is None:
        return
    hopt_state = opts[1]
    for i, (m, opt) in enumerate(zip(modules, opts[0], strict=True)):
        g = next(k for k, members in enumerate(hens.group_members) if i in members)
        position = hens.group_members[g].index(i)
        adam_state = hopt_state[g][0]
        for own, p in m.named_parameters():
            ref = opt.state[p]
            name = f"groups.{g}.stacked.{own}"
            assert float(adam_state.count[name]) == float(ref["step"])
            torch.testing.assert_close(adam_state.mu[name][position], ref["exp_avg"], **tol)
            torch.testing.assert_close(adam_state.nu[name][position], ref["exp_avg_sq"], **tol)


def test_groups_by_stacks_own_check():
    hens = fe.HeteroEnsemble(members(torch.float64))
    assert hens.group_members == GROUPS
    assert len(hens) == N and [len(g) for g in hens.groups] == [3, 2, 2, 1]
    assert all(isinstance(g, fe.Ensemble) for g in hens.groups)
    # What stack refuses to stack lands in another group: a different non-tensor
    # attribute (slope), another dtype.
    leaky = [nn.LeakyReLU(0.1), nn.LeakyReLU(0.2), nn.LeakyReLU(0.1)]
    assert fe.HeteroEnsemble([nn.Sequential(nn.Linear(2, 2), a) for a in leaky]).group_members == (
        (0, 2),
        (1,),
    )
    mixed = [nn.Linear(2, 2), nn.Linear(2, 2).double(), nn.Linear(2, 2)]
    assert fe.HeteroEnsemble(mixed).group_members == ((0, 2), (1,))
    for group in fe.HeteroEnsemble(mixed).group_members:
        fe.stack([mixed[i] for i in group])  # each group is what stack accepts
    # A member in eval mode among training ones: its own group, run as the loop runs it.
    modes = [bn_mlp().double(), bn_mlp().double().eval(), bn_mlp().double()]
    hens = fe.HeteroEnsemble(copy.deepcopy(modes))
    assert hens.group_members == ((0, 2), (1,))
    x = torch.randn(6, 4, dtype=torch.float64)
    torch.testing.assert_close(hens(x), torch.stack([m(x) for m in modes]), **TOLS[torch.float64])
    for i, m in enumerate(modes):  # running statistics: updated in train mode only
        assert_trees_close(hens.member(i).state_dict(), m.state_dict(), **TOLS[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("face", ["EnsembleOptimizer", "torch.optim"])
def test_module_face_matches_loop(dtype, face):
    """Forward, backward and Adam steps (per-member lr and beta2), BatchNorm in train mode."""
    tol = TOLS[dtype]
    modules = members(dtype)
    hens = fe.HeteroEnsemble(copy.deepcopy(modules))
    if face == "EnsembleOptimizer":
        lrs, beta2 = LRS.to(dtype), BETA2.to(dtype)
        opt = fe.optim.EnsembleOptimizer(
            hens, hens.optimizer(fe.optim.adam, lr=lrs, betas=(0.9, beta2))
        )
        opts = loop_adam(modules)
    else:  # torch.optim over the stacked parameters: one lr for all
        opt = torch.optim.Adam(hens.parameters(), lr=0.02)
        opts = [torch.optim.Adam(m.parameters(), lr=0.02) for m in modules]
    for step in range(STEPS):
        x, y = batch(step, dtype)
        out = hens(x, in_dims=0)
        losses = ((out - y) ** 2).mean(dim=(1, 2))
        opt.zero_grad()
        losses.sum().backward()
        grads = {k: p.grad for k, p in hens.stacked_params().items()}
        opt.step()
        ref_out, ref_losses = loop_step(modules, opts, x, y)
        torch.testing.assert_close(out.detach(), ref_out, **tol)
        torch.testing.assert_close(losses.detach(), ref_losses, **tol)
        for i, m in enumerate(modules):
            # The loop's grads are those of this step (its zero_grad comes before).
            ref = {k: p.grad for k, p in m.named_parameters()}
            assert_trees_close(member_grad(hens, i, grads), ref, **tol)
    state = (opts, opt.state) if face == "EnsembleOptimizer" else None
    assert_members_match(hens, modules, state, tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("in_place", [False, True])
def test_functional_face_matches_loop(dtype, in_place):
    """value_and_grad, then update + apply_updates or update_, against the loop."""
    tol = TOLS[dtype]
    modules = members(dtype)
    hens = fe.HeteroEnsemble(copy.deepcopy(modules))
    opts = loop_adam(modules)
    opt = hens.optimizer(fe.optim.adam, lr=LRS.to(dtype), betas=(0.9, BETA2.to(dtype)))
    params = {k: v.detach().clone().requires_grad_() for k, v in hens.stacked_params().items()}
    buffers = {k: v.clone() for k, v in hens.stacked_buffers().items()}
    state = opt.init(params)

    def loss_fn(fmodel, p, b, x, y):
        out = fmodel(p, b, x)
        return F.mse_loss(out, y), out

    step_fn = hens.value_and_grad(loss_fn, in_dims=0, has_aux=True)
    for step in range(STEPS):
        x, y = batch(step, dtype)
        before = {k: v.clone() for k, v in buffers.items()}
        losses, grads, new_buffers, out = step_fn(params, buffers, x, y)
        assert_trees_close(buffers, before, rtol=0, atol=0)  # pure: inputs untouched
        buffers = new_buffers
        if in_place:
            state = opt.update_(grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            params = fe.optim.apply_updates(params, updates)
        ref_out, ref_losses = loop_step(modules, opts, x, y)
        torch.testing.assert_close(losses, ref_losses, **tol)
        torch.testing.assert_close(out, ref_out, **tol)
        for i, m in enumerate(modules):
            ref = {k: p.grad for k, p in m.named_parameters()}
            assert_trees_close(member_grad(hens, i, grads), ref, **tol)
    with torch.no_grad():
        for k, v in hens.stacked_params().items():
            v.copy_(params[k])
        for k, v in hens.stacked_buffers().items():
            v.copy_(buffers[k])
    assert_members_match(hens, modules, (opts, state), tol)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_wholly_frozen_member_gets_no_gradients_and_stays(in_place):
    """A member with every parameter frozen (a pretrained member kept fixed) forms a
    group of its own. Which leaves are trainable is decided over the whole ensemble,
    as the loop's torch.autograd.grad over its trainable parameters: that group gets
    None gradients and no step, and the other members train as in the loop."""
    torch.manual_seed(0)
    modules = [
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double() for _ in range(3)
    ]
    modules[2].requires_grad_(False)
    hens = fe.HeteroEnsemble(copy.deepcopy(modules))
    assert len(hens.groups) == 2
    params = {
        k: v.detach().clone().requires_grad_(v.requires_grad)
        for k, v in hens.stacked_params().items()
    }
    frozen = {k: v.clone() for k, v in params.items() if not v.requires_grad}
    opt = hens.optimizer(fe.optim.adam, lr=0.1)
    state = opt.init(params)
    ref_opt = torch.optim.Adam(
        [p for m in modules for p in m.parameters() if p.requires_grad], lr=0.1
    )

    def loss_fn(fmodel, p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    step_fn = hens.value_and_grad(loss_fn, in_dims=(None, 0))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 4, generator=g, dtype=torch.float64)
        y = torch.randn(3, 16, 2, generator=g, dtype=torch.float64)
        losses, grads, _ = step_fn(params, hens.stacked_buffers(), x, y)
        for k in frozen:
            assert grads[k] is None, k
        if in_place:
            state = opt.update_(grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            params = fe.optim.apply_updates(params, updates)
        ref_opt.zero_grad()
        ref = torch.stack([F.mse_loss(m(x), y[i]) for i, m in enumerate(modules)])
        ref.sum().backward()
        ref_opt.step()
        torch.testing.assert_close(losses, ref.detach(), rtol=1e-12, atol=1e-14)
    for k, v in frozen.items():
        assert torch.equal(params[k], v), k
    with torch.no_grad():
        for k, v in hens.stacked_params().items():
            v.copy_(params[k])
    for i, m in enumerate(modules):
        x = torch.randn(5, 4, dtype=torch.float64)
        torch.testing.assert_close(hens.member(i)(x), m(x), rtol=1e-12, atol=1e-14)


def test_shared_input_eval_and_reduce():
    modules = [m.eval() for m in members(torch.float64)]
    hens = fe.HeteroEnsemble(modules)
    assert not hens.training
    x = torch.randn(5, 4, dtype=torch.float64)
    out = hens(x)
    ref = torch.stack([m(x) for m in modules])
    torch.testing.assert_close(out, ref, **TOLS[torch.float64])
    torch.testing.assert_close(fe.reduce.mean(out), ref.mean(0), **TOLS[torch.float64])
    torch.testing.assert_close(fe.reduce.std(out), ref.std(0), **TOLS[torch.float64])
    listed = hens(x, stack=False)
    assert len(listed) == N
    for got, want in zip(listed, ref, strict=True):
        torch.testing.assert_close(got, want, **TOLS[torch.float64])


def test_clip_by_global_norm_clips_each_member_alone():
    """Two groups of two: the plain transform over the flat dict would mix member k of
    one group with member k of the other; per group it is clip_grad_norm_ per member."""
    torch.manual_seed(0)
    modules = [mlp(3), mlp(7), mlp(3), mlp(7)]
    hens = fe.HeteroEnsemble(copy.deepcopy(modules))
    assert hens.group_members == ((0, 2), (1, 3))
    scales = (1e-3, 1e2, 1.0, 30.0)
    opt = fe.optim.EnsembleOptimizer(
        hens, fe.optim.chain(fe.optim.clip_by_global_norm(1.0), fe.optim.adam(lr=0.01))
    )
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in modules]
    for step in range(STEPS):
        x = torch.randn(4, 8, 4)
        opt.zero_grad()
        out = hens(x, in_dims=0)
        (out.pow(2).mean(dim=(1, 2)) * torch.tensor(scales)).sum().backward()
        opt.step()
        for i, (m, o) in enumerate(zip(modules, opts, strict=True)):
            o.zero_grad()
            (scales[i] * m(x[i]).pow(2).mean()).backward()
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
        del step
    for i, m in enumerate(modules):
        assert_trees_close(hens.member(i).state_dict(), m.state_dict(), rtol=1e-5, atol=1e-6)


def test_per_member_work_across_groups_of_one_size_is_refused():
    """Given the flat dict instead of the HeteroEnsemble, a clip (one norm per member)
    or a per-member value would pair member k of one group with member k of another:
    with groups of one size no leading size differs, so it is refused by name, before
    anything is written."""
    torch.manual_seed(0)
    hens = fe.HeteroEnsemble([mlp(3), mlp(7), mlp(3), mlp(7)])
    assert hens.group_members == ((0, 2), (1, 3))
    params = hens.stacked_params()
    clip = fe.optim.chain(fe.optim.clip_by_global_norm(1.0), fe.optim.sgd(lr=0.1))
    message = r"params\['groups\.0\.stacked\..*'\] and params\['groups\.1\.stacked\..*different"
    with pytest.raises(
        ValueError, match=r"clip_by_global_norm: .*different groups.*hens\.optimizer"
    ):
        fe.optim.EnsembleOptimizer(params, clip)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    with pytest.raises(ValueError, match=message):
        fe.optim.clip_by_global_norm(1.0).update(grads, fe.optim.EmptyState())
    lr = torch.tensor([0.1, 0.2])  # as long as each group: passes the size check
    with pytest.raises(ValueError, match=r"one per-member lr would combine unrelated members"):
        fe.optim.sgd(lr=lr).init(params)
    before = copy.deepcopy(hens.state_dict())
    tau = torch.tensor([0.5, 0.5])
    with pytest.raises(ValueError, match=r"polyak_update_: .*different groups.*hens\.groups\[g\]"):
        fe.optim.polyak_update_(hens, fe.HeteroEnsemble([mlp(3), mlp(7), mlp(3), mlp(7)]), tau)
    assert_trees_close(hens.state_dict(), before, rtol=0, atol=0)
    # Each group on its own is one member axis: accepted.
    group = {k: v for k, v in params.items() if k.startswith("groups.0.")}
    fe.optim.EnsembleOptimizer(group, clip)
    fe.optim.sgd(lr=lr).init(group)
    # Group 0 of two HeteroEnsembles in one module holds unrelated members too (found by
    # an audit: the groups were told apart by their number alone).
    both = nn.ModuleDict({"a": hens, "b": fe.HeteroEnsemble([mlp(3), mlp(3)])})
    flat = dict(both.named_parameters())
    grads = {k: torch.ones_like(v) for k, v in flat.items()}
    message = r"params\['a\.groups\.0\.stacked\..*'\] and params\['a\.groups\.1\."
    with pytest.raises(ValueError, match=message):
        fe.optim.clip_by_global_norm(1.0).update(grads, fe.optim.EmptyState())
    zeros = {k: v for k, v in grads.items() if ".groups.0." in k}
    message = r"params\['a\.groups\.0\.stacked\..*'\] and params\['b\.groups\.0\."
    with pytest.raises(ValueError, match=message):
        fe.optim.clip_by_global_norm(1.0).update(zeros, fe.optim.EmptyState())
    nested = {"a": group, "b": {k: v for k, v in params.items() if k.startswith("groups.1.")}}
    with pytest.raises(ValueError, match=r"params\['a'\]\['groups\.0\..*params\['b'\]"):
        fe.optim.sgd(lr=lr).init(nested)


def test_schedule_values_are_routed():
    """A schedule returning [N] per-member values, against SGD with LambdaLR per member."""
    modules = members(torch.float64)
    hens = fe.HeteroEnsemble(copy.deepcopy(modules))
    base = LRS
    opt = fe.optim.EnsembleOptimizer(
        hens, hens.optimizer(fe.optim.sgd, lr=lambda count: base * 0.5**count, momentum=0.9)
    )
    opts = [
        torch.optim.SGD(m.parameters(), lr=base[i].item(), momentum=0.9)
        for i, m in enumerate(modules)
    ]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda c: 0.5**c) for o in opts]
    for step in range(STEPS):
        x, y = batch(step, torch.float64)
        opt.zero_grad()
        ((hens(x, in_dims=0) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        loop_step(modules, opts, x, y)
        for s in scheds:
            s.step()
    assert_members_match(hens, modules, None, TOLS[torch.float64])


def test_checkpoint_round_trip_and_export(tmp_path):
    dtype = torch.float64
    modules = members(dtype)
    hens = fe.HeteroEnsemble(copy.deepcopy(modules))
    opt = fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam, lr=LRS))
    x, y = batch(0, dtype)
    opt.zero_grad()
    ((hens(x, in_dims=0) - y) ** 2).mean(dim=(1, 2)).sum().backward()
    opt.step()
    fe.save(tmp_path / "hens.safetensors", hens)
    fe.save(tmp_path / "opt.safetensors", opt.state)

    fresh = fe.HeteroEnsemble(members(dtype, seed=1))
    fresh_opt = fe.optim.EnsembleOptimizer(fresh, fresh.optimizer(fe.optim.adam, lr=LRS))
    assert fe.load(tmp_path / "hens.safetensors", fresh) is fresh
    fresh_opt.state = fe.load(tmp_path / "opt.safetensors", fresh_opt.state)
    assert_trees_close(fresh.state_dict(), hens.state_dict(), rtol=0, atol=0)
    assert_trees_close(fresh_opt.state, opt.state, rtol=0, atol=0)
    # Both go on alike.
    for o, h in ((opt, hens), (fresh_opt, fresh)):
        x, y = batch(1, dtype)
        o.zero_grad()
        ((h(x, in_dims=0) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        o.step()
    assert_trees_close(fresh.state_dict(), hens.state_dict(), rtol=0, atol=0)

    # Per-member state_dicts, in member order, load into the ordinary modules.
    exported = fe.export_state_dicts(hens)
    assert len(exported) == N
    for i, sd in enumerate(exported):
        plain = copy.deepcopy(modules[i])
        plain.load_state_dict(sd)
        assert_trees_close(plain.state_dict(), hens.member(i).state_dict(), rtol=0, atol=0)
    # And back: into another HeteroEnsemble of the same members, every group checked first.
    other = fe.HeteroEnsemble(members(dtype, seed=3))
    assert fe.import_state_dicts(other, exported) is other
    assert_trees_close(other.state_dict(), hens.state_dict(), rtol=0, atol=0)
    target = fe.HeteroEnsemble(members(dtype, seed=4))  # differs from `exported`
    before = copy.deepcopy(target.state_dict())
    swapped = list(exported)
    swapped[7] = {"weight": torch.zeros(2, 4, dtype=dtype), "bias": torch.zeros(3, dtype=dtype)}
    with pytest.raises(ValueError, match=r"member 7 has `bias` with shape \(3,\)"):
        fe.import_state_dicts(target, swapped)  # the last group is wrong
    swapped = list(exported)
    swapped[4] = exported[0]  # member 0's dict (an MLP) where a BatchNorm MLP belongs
    with pytest.raises(ValueError, match=r"member 4 is missing"):
        fe.import_state_dicts(target, swapped)
    assert_trees_close(target.state_dict(), before, rtol=0, atol=0)  # no group written


def test_load_state_dict_checks_every_group_first():
    hens = fe.HeteroEnsemble(members(torch.float64))
    other = fe.HeteroEnsemble(members(torch.float64, seed=1))
    assert hens.load_state_dict(other.state_dict()) is not None
    assert_trees_close(hens.state_dict(), other.state_dict(), rtol=0, atol=0)
    bad = fe.HeteroEnsemble(members(torch.float64, seed=2)).state_dict()
    bad["groups.3.stacked.bias"] = torch.zeros(2, 2, dtype=torch.float64)  # group 3 has 1
    before = copy.deepcopy(hens.state_dict())
    with pytest.raises(ValueError, match=r"group 3.*`stacked.bias` has 2 members"):
        hens.load_state_dict(bad)
    assert_trees_close(hens.state_dict(), before, rtol=0, atol=0)  # groups 0-2 too
    with pytest.raises(ValueError, match=r"unexpected keys \['stacked.weight'\]"):
        hens.load_state_dict({**other.state_dict(), "stacked.weight": torch.zeros(1)})
    # EnsembleOptimizer's state_dict round trip over the groups' states.
    opt = fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam, lr=LRS))
    x, y = batch(0, torch.float64)
    ((hens(x, in_dims=0) - y) ** 2).sum().backward()
    opt.step()
    fresh = fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam, lr=LRS))
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert_trees_close(fresh.state, opt.state, rtol=0, atol=0)


def test_load_refuses_another_grouping(tmp_path):
    hens = fe.HeteroEnsemble([mlp(3), mlp(5), mlp(3)])
    path = tmp_path / "h.safetensors"
    fe.save(path, hens)
    other = fe.HeteroEnsemble([mlp(3), mlp(3), mlp(5)])  # same architectures, other order
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"groups of members \[\[0, 2\], \[1\]\]"):
        fe.load(path, other)
    assert_trees_close(other.state_dict(), before, rtol=0, atol=0)
    with pytest.raises(
        ValueError, match=r"holds an fe\.HeteroEnsemble of 3 members; got an Ensemble to load"
    ):
        fe.load(path, fe.Ensemble([mlp(3) for _ in range(3)]))
    fe.save(tmp_path / "e.safetensors", fe.Ensemble([mlp(3) for _ in range(3)]))
    with pytest.raises(ValueError, match=r"holds an fe\.Ensemble; got an fe\.HeteroEnsemble"):
        fe.load(tmp_path / "e.safetensors", other)


# -- bad inputs: clear errors, nothing changed ---------------------------------------------


def test_bad_modules():
    with pytest.raises(
        ValueError,
        match=r"HeteroEnsemble: modules is empty \(expected at least one module, got 0\)",
    ):
        fe.HeteroEnsemble([])
    with runtime_typecheck_off():  # the library's own messages, as a user sees them
        with pytest.raises(
            TypeError, match=r"HeteroEnsemble: modules is a single module .*got a single Linear\)"
        ):
            fe.HeteroEnsemble(nn.Linear(2, 2))
        with pytest.raises(TypeError, match="member 1 is a str"):
            fe.HeteroEnsemble([nn.Linear(2, 2), "x"])


def test_outputs_of_other_shapes_refused_before_buffers_change():
    modules = [bn_mlp(), nn.Linear(4, 3), bn_mlp()]  # outputs 2 and 3 wide
    hens = fe.HeteroEnsemble(modules)
    before = copy.deepcopy(hens.state_dict())
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"member 1's output has shape \(6, 3\).*member 0's"):
        hens(x)
    assert_trees_close(hens.state_dict(), before, rtol=0, atol=0)  # BN statistics too
    listed = hens(x, stack=False)  # asked for a list instead: runs, in member order
    assert [tuple(o.shape) for o in listed] == [(6, 2), (6, 3), (6, 2)]
    with pytest.raises(ValueError, match=r"member 1's aux has shape \(6, 3\)"):
        hens.value_and_grad(lambda f, p, b, x: (f(p, b, x).sum(), f(p, b, x)), has_aux=True)(
            hens.stacked_params(), hens.stacked_buffers(), x
        )


def test_hyperparameters_of_wrong_length():
    hens = fe.HeteroEnsemble(members(torch.float64))
    with pytest.raises(ValueError, match=r"lr has 3 per-member values; this ensemble has 8"):
        hens.optimizer(fe.optim.adam, lr=torch.ones(3))
    with pytest.raises(ValueError, match=r"betas\[1\] has 2 per-member values"):
        hens.optimizer(fe.optim.adam, betas=(0.9, torch.full((2,), 0.99)))
    # A built transform with per-member values cannot be split: refused, with the fix;
    # also when the values are as many as a group's members, which once gave value k to
    # the k-th member of every group.
    fix = r"holds per-member values .*hens.optimizer\(fe.optim.adam, lr=lrs\)"
    with pytest.raises(ValueError, match=fix):
        fe.optim.EnsembleOptimizer(hens, fe.optim.adam(lr=LRS))
    sizes = {len(g) for g in hens.group_members}
    with pytest.raises(ValueError, match=fix):
        fe.optim.EnsembleOptimizer(hens, fe.optim.sgd(lr=torch.ones(min(sizes))))
    with pytest.raises(ValueError, match=fix):
        hens.optimizer(fe.optim.sgd(lr=torch.ones(min(sizes))))
    # A schedule's [N] values of the wrong length: refused on the step, nothing stepped.
    opt = fe.optim.EnsembleOptimizer(
        hens, hens.optimizer(fe.optim.sgd, lr=lambda count: torch.ones(5))
    )
    x, y = batch(0, torch.float64)
    ((hens(x, in_dims=0) - y) ** 2).sum().backward()
    after_forward = copy.deepcopy(hens.state_dict())
    with pytest.raises(ValueError, match="the value of the lr schedule has 5 per-member values"):
        opt.step()
    assert_trees_close(hens.state_dict(), after_forward, rtol=0, atol=0)


_GROUP_LRS = None  # read by _global_schedule


def _global_schedule(count):
    return _GROUP_LRS * 0.5**count


class _Scheduled:
    def __init__(self, lrs):
        self.lrs = lrs

    def __call__(self, count):
        return self.lrs * 0.5**count


def _member_shaped_mask(params: dict) -> fe.optim.GradientTransformation:
    """Multiplies each update by a mask shaped like one member's leaf."""
    masks = {k: torch.ones(v.shape[1:], dtype=v.dtype) for k, v in params.items()}

    def init(params):
        return fe.optim.EmptyState()

    def update(updates, state, params=None):
        return {k: None if u is None else u * masks[k] for k, u in updates.items()}, state

    return fe.optim.GradientTransformation(init, update)


def test_per_member_values_a_built_transform_hides_are_refused():
    """A schedule returning as many values as a group has members, held where the
    closure scan cannot see (a partial, a callable object, a default argument, a
    global), gave value k to the k-th member of every group: member 1 stepped with
    member 0's lr, silently."""
    global _GROUP_LRS
    hens = fe.HeteroEnsemble(members(torch.float64))
    assert sorted(len(g) for g in hens.group_members) == [1, 2, 2, 3]
    lrs = torch.tensor([0.1, 0.2], dtype=torch.float64)  # as many as two groups have
    _GROUP_LRS = lrs
    hidden = {
        "partial": functools.partial(lambda v, count: v * 0.5**count, lrs),
        "callable object": _Scheduled(lrs),
        "default argument": lambda count, v=lrs: v * 0.5**count,
        "global": _global_schedule,
    }
    for schedule in hidden.values():
        before = copy.deepcopy(hens.state_dict())
        with pytest.raises(ValueError, match=r"holds per-member values.*lr=lrs"):
            fe.optim.EnsembleOptimizer(hens, fe.optim.sgd(lr=schedule))
        assert_trees_close(hens.state_dict(), before, rtol=0, atol=0)
        opt = fe.optim.EnsembleOptimizer(hens, fe.optim.sgd(lr=0.1))
        with pytest.raises(ValueError, match=r"holds per-member values.*lr=lrs"):
            opt.transform = fe.optim.sgd(lr=schedule)  # assigned later: checked alike
    # In a partition's group whose parameters only another architecture group has.
    labels = {k: ("odd" if k.startswith("groups.1.") else "rest") for k in hens.stacked_params()}
    hidden_group = {
        "odd": fe.optim.sgd(lr=functools.partial(lambda v, c: v, lrs)),
        "rest": fe.optim.sgd(lr=0.1),
    }
    with pytest.raises(ValueError, match=r"holds per-member values"):
        fe.optim.EnsembleOptimizer(hens, fe.optim.partition(hidden_group, labels))
    # Shared values, a schedule's included, are still one transform for every group, and
    # a transform of the user's own that the tiny probe tensors trip (a member-shaped
    # mask) is not taken for one holding per-member values.
    fe.optim.EnsembleOptimizer(hens, fe.optim.sgd(lr=_Scheduled(0.1)))
    masked = fe.optim.chain(
        _member_shaped_mask(hens.stacked_params()), fe.optim.sgd(0.1, momentum=0.9)
    )
    fe.optim.EnsembleOptimizer(hens, masked)
    fe.optim.EnsembleOptimizer(hens, fe.optim.adam(lr=functools.partial(lambda v, c: v, 0.1)))


def test_a_transform_assigned_between_steps_runs_group_by_group():
    """surgery.md's `opt.transform = fe.optim.adam(lr=...)` over a HeteroEnsemble: the
    plain transform met the grouped state and step() raised 'the state is not this
    transform's' without a word of what to do. It now runs group by group, as one given
    when the optimizer was built, and the loop's Adam with the new lr is matched."""
    dtype = torch.float64
    modules = members(dtype)
    hens = fe.HeteroEnsemble(copy.deepcopy(modules))
    opt = fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam, lr=LRS))
    loop = [torch.optim.Adam(m.parameters(), lr=LRS[i].item()) for i, m in enumerate(modules)]
    for step in range(4):
        if step == 2:
            opt.transform = fe.optim.adam(lr=0.003)  # shared: every group takes it
            for o in loop:
                o.param_groups[0]["lr"] = 0.003
        x, y = batch(step, dtype)
        loop_step(modules, loop, x, y)
        opt.zero_grad()
        F.mse_loss(hens(x, in_dims=0), y, reduction="none").mean(dim=(1, 2)).sum().backward()
        opt.step()
    assert_members_match(hens, modules, (loop, opt.state), TOLS[dtype])
    kept = opt.transform
    with pytest.raises(ValueError, match=r"holds per-member values.*hens\.optimizer"):
        opt.transform = fe.optim.adam(lr=LRS)  # [N] values: routed only by hens.optimizer
    assert opt.transform is kept
    opt.transform = hens.optimizer(fe.optim.adam, lr=LRS * 0.5)  # which it takes as it is
    with runtime_typecheck_off(), pytest.raises(TypeError, match=r"is not a GradientTransf"):
        opt.transform = fe.optim.adam


def test_bad_trees_refused_before_any_group_steps():
    hens = fe.HeteroEnsemble(members(torch.float64))
    opt = hens.optimizer(fe.optim.adam, lr=0.1)
    params = {k: v.detach().clone() for k, v in hens.stacked_params().items()}
    state = opt.init(params)
    snapshot = copy.deepcopy((params, state))
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    last = list(grads)[-1]
    grads[last] = torch.ones(3)  # the last group's gradient is wrong
    with pytest.raises(ValueError, match=rf"the gradient of `{last}` has shape \(3,\)"):
        opt.update_(grads, state, params)
    assert_trees_close((params, state), snapshot, rtol=0, atol=0)
    del grads[last]
    with pytest.raises(ValueError, match=r"missing \['groups.3.stacked.bias'\]"):
        opt.update(grads, state, params)
    with pytest.raises(ValueError, match="missing"):
        hens.value_and_grad(lambda f, p, b: f(p, b, torch.ones(1, 4)).sum())(grads, {})
    with (
        runtime_typecheck_off(),
        pytest.raises(
            TypeError,
            match=r"transform is neither a GradientTransformation nor a function .*got float\)",
        ),
    ):
        hens.optimizer(0.1)
    with pytest.raises(TypeError, match="got a built transform and arguments"):
        hens.optimizer(fe.optim.adam(), lr=0.1)


def test_member_and_unstack():
    modules = members(torch.float64)
    hens = fe.HeteroEnsemble(modules)
    for i, m in enumerate(hens.unstack()):
        assert type(m) is type(modules[i])
        assert_trees_close(m.state_dict(), modules[i].state_dict(), rtol=0, atol=0)
    assert_trees_close(hens.member(-1).state_dict(), modules[-1].state_dict(), rtol=0, atol=0)
    with pytest.raises(IndexError, match="index 8 is out of range"):
        hens.member(8)


def test_polyak_update_over_all_groups():
    targets, onlines = members(torch.float64, seed=1), members(torch.float64, seed=2)
    target, online = fe.HeteroEnsemble(targets), fe.HeteroEnsemble(onlines)
    fe.optim.polyak_update_(target, online, 0.25)
    for i, (t, o) in enumerate(zip(targets, onlines, strict=True)):
        want = {
            k: 0.25 * v + 0.75 * t.state_dict()[k] if v.is_floating_point() else v
            for k, v in o.state_dict().items()
        }
        assert_trees_close(target.member(i).state_dict(), want, **TOLS[torch.float64])
    # Per-member tau is not routed: refused (every group is shorter than N), unchanged.
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match="tau has 8 per-member values"):
        fe.optim.polyak_update_(target, online, torch.full((N,), 0.5, dtype=torch.float64))
    assert_trees_close(target.state_dict(), before, rtol=0, atol=0)


def test_member_surgery_on_a_hetero_layout_is_refused_not_done_within_each_group():
    # Two groups of two: every leaf has leading size 2, so indices would silently pick
    # members within each group (and pair one group's state with another's members).
    a = lambda: nn.Linear(3, 2)  # noqa: E731
    b = lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # noqa: E731
    torch.manual_seed(0)
    hens = fe.HeteroEnsemble([a(), b(), a(), b()])
    opt = fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam, lr=1e-2))
    hens(torch.randn(5, 3)).pow(2).sum().backward()
    opt.step()
    before = copy.deepcopy(opt.state)
    groups = r"holds a HeteroEnsemble's groups .* fe.HeteroEnsemble\(\[hens.member\(i\)"
    with pytest.raises(ValueError, match="select: tree " + groups):
        fe.select(hens.stacked_params(), [1, 0])
    with pytest.raises(ValueError, match="concat: .*" + groups):
        fe.concat([hens.stacked_params(), hens.stacked_params()])
    # An optimizer of a HeteroEnsemble, of any number of groups: before its transform
    # is looked at (concat without transform= blamed "another HeteroEnsemble's
    # optimizer(...)" for a plain fe.optim.adam; one group's select raised a TypeError
    # calling the grouped transform "built by your own code").
    steps = r"this optimizer steps a HeteroEnsemble, .* fe.HeteroEnsemble\(\[hens.member\(i\)"
    plain = fe.optim.EnsembleOptimizer(hens, fe.optim.adam(1e-2))
    one_group = fe.HeteroEnsemble([a(), a(), a()])
    single = fe.optim.EnsembleOptimizer(one_group, one_group.optimizer(fe.optim.adam, lr=1e-2))
    for o in (opt, plain, single):
        with pytest.raises(ValueError, match="EnsembleOptimizer.select: " + steps):
            o.select([1, 0], hens, transform=hens.optimizer(fe.optim.adam, lr=1e-2))
        with pytest.raises(ValueError, match="EnsembleOptimizer.select: " + steps):
            o.select([1, 0], fe.Ensemble([a(), a()]))
        with pytest.raises(ValueError, match="EnsembleOptimizer.copy_members_: " + steps):
            o.copy_members_(0, 1)
        with pytest.raises(ValueError, match="EnsembleOptimizer.concat: " + steps):
            o.concat(fe.HeteroEnsemble([*hens.unstack(), a()]))
    with pytest.raises(ValueError, match=groups):
        fe.optim.select(opt.transform, opt.state, [1, 0])
    assert_trees_close(opt.state, before, rtol=0, atol=0)


def test_a_later_groups_refusal_leaves_every_group_unchanged():
    """The groups step one after another: group 1's refusal (its state no longer
    matches its parameters' dtype) once came after group 0 had stepped."""
    torch.manual_seed(0)
    hens = fe.HeteroEnsemble([nn.Linear(3, 2), nn.Linear(3, 4), nn.Linear(3, 2), nn.Linear(3, 4)])
    opt = fe.optim.EnsembleOptimizer(hens, fe.optim.adam(lr=0.1))
    hens.groups[1].double()  # after the optimizer was built: its state is float32
    x = torch.randn(8, 3)
    sum(g(x.to(next(g.parameters()).dtype)).pow(2).mean() for g in hens.groups).backward()
    params = {k: v.detach().clone() for k, v in hens.stacked_params().items()}
    state = optree.tree_map(torch.clone, opt.state)
    with pytest.raises(ValueError, match=r"adam: state.mu for params\['groups.1.stacked.bias'\]"):
        opt.step()
    for k, v in hens.stacked_params().items():
        assert torch.equal(v, params[k]), k
    assert optree.tree_all(optree.tree_map(torch.equal, opt.state, state))


def test_a_later_groups_failure_puts_back_an_earlier_groups_renormalised_rows():
    """Embedding(max_norm) renormalises the rows it looks up in its weight, in place.
    Group 0 ran (its rows renormalised) before group 1 failed or the outputs could not
    be stacked: the rows stayed changed (up to 2.15) where hetero.md says nothing
    changes. One transaction over the groups puts them back, on the module face and
    in value_and_grad (whose params are the caller's)."""
    torch.manual_seed(0)
    renorm = lambda: nn.Embedding(10, 3, max_norm=0.5)  # noqa: E731
    hens = fe.HeteroEnsemble([renorm(), nn.Embedding(5, 3), renorm()])
    wide = fe.HeteroEnsemble([renorm(), nn.Embedding(10, 4), renorm()])
    for ens, idx, error in (
        (hens, torch.tensor([7, 8]), IndexError),  # out of range for group 1's table
        (wide, torch.tensor([1, 2]), ValueError),  # outputs of widths 3 and 4
    ):
        before = {k: v.detach().clone() for k, v in ens.state_dict().items()}
        with pytest.raises(error):
            ens(idx)
        for k, v in ens.state_dict().items():
            assert torch.equal(v, before[k]), k

    def failing_loss(fmodel, p, b, idx):
        out = fmodel(p, b, idx)
        if p["weight"].shape[0] == 5:
            raise RuntimeError("group 1's loss fails")
        return out.sum()

    params = {k: v.detach().clone().requires_grad_() for k, v in hens.stacked_params().items()}
    given = {k: v.detach().clone() for k, v in params.items()}
    for loss_fn, idx in (
        (lambda fmodel, p, b, idx: fmodel(p, b, idx).sum(), [7, 8]),
        (failing_loss, [3, 4]),
    ):
        with pytest.raises((IndexError, RuntimeError)):
            hens.value_and_grad(loss_fn)(params, hens.stacked_buffers(), torch.tensor(idx))
        for k, v in params.items():
            assert torch.equal(v, given[k]), k


@pytest.mark.parametrize("route", ["state_dict", "fe.save"])
def test_per_member_counts_of_groups_of_different_sizes_resume(route, tmp_path):
    """A per-member momentum holding 0 gives each group one count per member ([3] and
    [2]); loading into a fresh optimizer once took group 0's size for every group and
    refused group 1's counts as "saved with a different member count"."""
    torch.manual_seed(0)
    members = [nn.Linear(3, 2), nn.Linear(3, 4), nn.Linear(3, 2), nn.Linear(3, 4), nn.Linear(3, 2)]
    hens, twin = fe.HeteroEnsemble(members), fe.HeteroEnsemble(copy.deepcopy(members))
    momentum = torch.tensor([0.0, 0.0, 0.9, 0.5, 0.0])

    def optimizer(ens):
        return fe.optim.EnsembleOptimizer(
            ens, ens.optimizer(fe.optim.sgd, lr=0.1, momentum=momentum)
        )

    x = torch.randn(8, 3)

    def step(ens, opt):
        opt.zero_grad()
        sum(o.pow(2).mean() for o in ens(x, stack=False)).backward()
        opt.step()

    opt, twin_opt = optimizer(hens), optimizer(twin)
    for ens, o in ((hens, opt), (twin, twin_opt)):
        step(ens, o)
    assert opt.state[1][0].count["groups.1.stacked.bias"].shape == (2,)
    resumed = optimizer(twin)
    if route == "state_dict":
        resumed.load_state_dict(opt.state_dict())
    else:
        fe.save(tmp_path / "opt.safetensors", opt)
        fe.load(tmp_path / "opt.safetensors", resumed)
    for _ in range(3):
        step(hens, opt)
        step(twin, resumed)
    for k, v in hens.stacked_params().items():
        assert torch.equal(v, twin.stacked_params()[k]), k


def test_a_functional_group_state_with_per_member_counts_loads_into_its_template(tmp_path):
    """The functional face's state (a pytree): fe.load once took one member count for
    every group's counts, and refused group 0's [3] counts."""
    torch.manual_seed(0)
    members = [nn.Linear(3, 2), nn.Linear(3, 4), nn.Linear(3, 2), nn.Linear(3, 4), nn.Linear(3, 2)]
    hens = fe.HeteroEnsemble(members)
    opt = hens.optimizer(fe.optim.sgd, lr=0.1, momentum=torch.tensor([0.0, 0.0, 0.9, 0.5, 0.0]))
    params = {k: v.detach() for k, v in hens.stacked_params().items()}
    state = opt.update_(
        {k: torch.randn_like(v) for k, v in params.items()}, opt.init(params), params
    )
    assert [s[0].count[f"groups.{g}.stacked.bias"].shape for g, s in enumerate(state)] == [
        (3,),
        (2,),
    ]
    fe.save(tmp_path / "state.safetensors", state)
    loaded = fe.load(tmp_path / "state.safetensors", opt.init(params))
    assert optree.tree_all(optree.tree_map(torch.equal, loaded, state))


def test_polyak_between_ensembles_grouped_differently_is_refused():
    """Online A B A and target A A B hold the same names and shapes group by group,
    so target member 1 once took online member 2, and member 2 took member 1."""

    def arch(kind: str) -> nn.Module:
        return nn.Linear(3, 2) if kind == "A" else nn.Sequential(nn.Linear(3, 2))

    online = fe.HeteroEnsemble([arch(k) for k in "ABA"])
    target = fe.HeteroEnsemble([arch(k) for k in "AAB"])
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"target and online group their members differently"):
        fe.optim.polyak_update_(target, online, 0.5)
    assert_trees_close(target.state_dict(), before, rtol=0, atol=0)


def test_randomness_same_is_shared_within_each_group():
    """randomness.md and the docstring: "same" gives one group's members the same
    draws; each group draws its own."""

    class Dropped(nn.Module):
        def __init__(self, extra: int) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))
            self.other = nn.Parameter(torch.zeros(extra))  # only makes architectures differ
            self.dropout = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dropout(x * self.scale)

    torch.manual_seed(0)
    hens = fe.HeteroEnsemble([Dropped(1), Dropped(2), Dropped(1)], randomness="same")
    kept = hens(torch.ones(1, 256)) != 0
    assert hens.group_members == ((0, 2), (1,))
    assert torch.equal(kept[0], kept[2]) and not torch.equal(kept[0], kept[1])


def test_load_state_dict_cannot_see_the_member_order_but_fe_load_can(tmp_path):
    """hetero.md: a state dict names groups, not members; fe.save/fe.load check them."""

    def arch(kind: str) -> nn.Module:
        return nn.Linear(3, 2) if kind == "A" else nn.Sequential(nn.Linear(3, 2))

    source = fe.HeteroEnsemble([arch(k) for k in "ABA"])
    target = fe.HeteroEnsemble([arch(k) for k in "AAB"])
    target.load_state_dict(source.state_dict())  # loads: the same groups' sizes and keys
    assert torch.equal(target.member(1).weight, source.member(2).weight)  # another member
    fe.save(tmp_path / "source.safetensors", source)
    with pytest.raises(ValueError, match="group"):
        fe.load(tmp_path / "source.safetensors", fe.HeteroEnsemble([arch(k) for k in "AAB"]))


def test_an_optimizer_built_for_another_hetero_ensemble_is_refused_clearly():
    def arch(kind: str) -> nn.Module:
        return nn.Linear(3, 2) if kind == "A" else nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))

    first = fe.HeteroEnsemble([arch(k) for k in "ABA"])
    second = fe.HeteroEnsemble([arch(k) for k in "AAB"])
    built = first.optimizer(fe.optim.adam, lr=torch.tensor([0.1, 0.2, 0.3]))
    with pytest.raises(
        ValueError,
        match=r"built by another HeteroEnsemble's optimizer\(...\), for groups of members "
        r"\[\[0, 2\], \[1\]\] \(expected one built for this ensemble, whose groups are "
        r"\[\[0, 1\], \[2\]\]\)",
    ):
        fe.optim.EnsembleOptimizer(second, built)


def test_a_bad_per_member_value_is_named_by_its_member_in_the_ensemble():
    """A per-member value that one group's transform refuses was named by its position
    in that group ("member 0" for member 5 of the ensemble): the message names the
    group and the member's index in the ensemble."""
    hens = fe.HeteroEnsemble(members(torch.float64))
    lrs = LRS.clone()
    lrs[5] = -0.1  # group 1 holds members 1 and 5: its second member
    with pytest.raises(
        ValueError,
        match=r"HeteroEnsemble.optimizer: building group 1 \(members \[1, 5\]\): adam: "
        r"Invalid learning rate: -0.1 \(member 5 of the per-member lr\)",
    ):
        hens.optimizer(fe.optim.adam, lr=lrs)


def test_an_error_in_one_group_names_the_group_and_its_members() -> None:
    """Only group 1's architecture refused the input, and the message named a layer with
    no word of which of the ensemble's members it meant."""

    def narrow() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4, bias=False), nn.Linear(4, 2))

    def wide() -> nn.Module:
        return nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 2))

    hens = fe.HeteroEnsemble([narrow(), wide(), narrow(), wide()])
    x = torch.randn(8, 3)
    with pytest.raises(ValueError, match=r"^HeteroEnsemble: in group 1 \(members \[1, 3\]\): "):
        hens(x)
    loss = hens.value_and_grad(lambda f, p, b, x: f(p, b, x).sum())
    with pytest.raises(
        ValueError, match=r"^HeteroEnsemble\.value_and_grad: in group 1 \(members \[1, 3\]\): "
    ):
        loss(hens.stacked_params(), hens.stacked_buffers(), x)


def test_a_transform_failing_in_one_group_names_the_group_and_changes_nothing() -> None:
    """The optimizer's step runs group by group: an error of a later group's transform
    said nothing of which members it stepped (forward and value_and_grad did)."""
    torch.manual_seed(0)
    hens = fe.HeteroEnsemble([nn.Linear(3, 2), nn.Linear(3, 4), nn.Linear(3, 2)])

    def failing(lr):  # group 1's transform fails
        base = fe.optim.adam(lr)
        if failing.built == 1:

            def update_inplace(grads, state, params):
                raise RuntimeError("the custom rule failed")

            base = base._replace(update_inplace=update_inplace)
        failing.built += 1
        return base

    failing.built = 0
    opt = fe.optim.EnsembleOptimizer(
        hens, hens.optimizer(failing, lr=torch.tensor([0.1, 0.2, 0.3]))
    )
    sum(g(torch.randn(5, 3)).pow(2).sum() for g in hens.groups).backward()
    before = {k: v.detach().clone() for k, v in hens.stacked_params().items()}
    state = copy.deepcopy(opt.state)
    with pytest.raises(RuntimeError, match=r"in group 1 \(members \[1\]\): the custom rule failed"):
        opt.step()
    for k, v in hens.stacked_params().items():
        assert torch.equal(v, before[k]), k
    assert_trees_close(opt.state, state, rtol=0, atol=0)


def test_group_naming_leaves_other_errors_and_names_a_group_once() -> None:
    """A KeyError's argument is the key, not a message: it was rewritten; an exception
    object raised again gained one more prefix per call."""
    stored = ValueError("budget exhausted")

    class Fails(nn.Module):
        def __init__(self, width: int, error: Exception) -> None:
            super().__init__()
            self.l = nn.Linear(3, width)
            self.error = error

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise self.error

    hens = fe.HeteroEnsemble([Fails(2, KeyError("zz")), Fails(4, KeyError("zz"))])
    with pytest.raises(KeyError) as info:
        hens(torch.randn(5, 3))
    assert info.value.args == ("zz",)
    hens = fe.HeteroEnsemble([Fails(2, stored), Fails(4, stored)])
    for _ in range(3):  # the group's module raises its one (copied) exception again
        with pytest.raises(ValueError) as info:
            hens(torch.randn(5, 3))
    assert str(info.value) == "HeteroEnsemble: in group 0 (members [0]): budget exhausted"


def test_torch_swap_of_module_tensors_is_refused_by_a_hetero_ensemble() -> None:
    hens = fe.HeteroEnsemble([torch.nn.Linear(3, 2), torch.nn.Linear(3, 4)])
    state = {k: v + 1 for k, v in hens.state_dict().items()}
    before = {k: v.clone() for k, v in hens.state_dict().items()}
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for convert in (lambda: hens.double(), lambda: hens.load_state_dict(state)):
            with pytest.raises(RuntimeError, match="set_swap_module_params_on_conversion"):
                convert()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    for k, v in hens.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k


def test_a_group_left_out_of_the_loss_gets_zeros_when_stacked_and_none_from_the_list():
    """hetero.md: the stacked output joins every group's, so a group the loss leaves out
    gets zero gradients; from stack=False's list it gets none, as the loop's members."""
    torch.manual_seed(0)
    members = [nn.Linear(3, 2), nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))]
    x = torch.randn(5, 3)
    for stack in (True, False):
        hens = fe.HeteroEnsemble(copy.deepcopy(members))
        hens(x, stack=stack)[0].sum().backward()
        assert all(p.grad is not None for p in hens.groups[0].parameters())
        left_out = [p.grad for p in hens.groups[1].parameters()]
        if stack:
            assert all(g is not None and not g.any() for g in left_out)
        else:
            assert all(g is None for g in left_out)


def test_members_without_tensors_are_refused_naming_them():
    """They got Ensemble's own message, naming neither HeteroEnsemble nor the members."""
    members = [nn.Linear(3, 2), nn.Sequential(nn.Tanh()), nn.Linear(3, 2), nn.Sequential(nn.Tanh())]
    with pytest.raises(
        ValueError, match=r"HeteroEnsemble: members \[1, 3\] \(Sequential\) have no"
    ):
        fe.HeteroEnsemble(members)


@pytest.mark.parametrize("lr", ["shared", "per member"])
def test_optimizer_state_loads_into_another_member_order_as_hetero_md_says(tmp_path, lr):
    """hetero.md: the state follows each group's members in order; per-member
    hyperparameters are in member order, so another order is refused."""
    torch.manual_seed(0)

    def arch(kind):
        return nn.Linear(3, 2) if kind == "A" else nn.Sequential(nn.Linear(3, 2))

    src = fe.HeteroEnsemble([arch(k) for k in "ABA"])
    dst = fe.HeteroEnsemble([arch(k) for k in "AAB"])
    rate = 0.1 if lr == "shared" else torch.tensor([0.1, 0.2, 0.3])
    saved = fe.optim.EnsembleOptimizer(src, src.optimizer(fe.optim.adam, lr=rate))
    src(torch.randn(4, 3)).pow(2).sum().backward()
    saved.step()
    fe.save(tmp_path / "opt.safetensors", saved)
    opt = fe.optim.EnsembleOptimizer(dst, dst.optimizer(fe.optim.adam, lr=rate))
    if lr == "per member":
        with pytest.raises(ValueError, match=r"the state was saved by an optimizer whose"):
            fe.load(tmp_path / "opt.safetensors", opt)
        with pytest.raises(ValueError, match=r"the state was saved by an optimizer whose"):
            opt.load_state_dict(saved.state_dict())
        return
    fe.load(tmp_path / "opt.safetensors", opt)
    # Group A's second row (member 2 of ABA) is member 1 of AAB's.
    for got, want in zip(
        optree.tree_leaves(opt.state_dict()["state"]),
        optree.tree_leaves(saved.state_dict()["state"]),
        strict=True,
    ):
        assert torch.equal(got, want)


def test_a_loss_written_without_fmodel_says_what_it_is_given():
    """It got Python's bare "loss_fn() takes 4 positional arguments but 5 were given"
    (the call named twice before it)."""
    hens = fe.HeteroEnsemble(
        [nn.Linear(3, 1), nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))]
    )

    def loss_fn(params, buffers, x, y):
        return params["weight"].sum()

    step = hens.value_and_grad(loss_fn)
    with pytest.raises(
        TypeError,
        match=r"^HeteroEnsemble\.value_and_grad: in group 0 \(members \[0\]\): the function is "
        r"called for each member as loss_fn\(fmodel, params, buffers, \*inputs.*"
        r"def loss_fn\(fmodel, params, buffers, x, y\)",
    ):
        step(hens.stacked_params(), hens.stacked_buffers(), torch.randn(4, 3), torch.randn(4, 1))


def test_an_optimizer_file_loads_into_groups_of_the_same_order_only(tmp_path):
    """hetero.md: the optimizer state records no grouping; it loads into groups of the
    same sizes and architectures in the same group order (members interleaved
    otherwise included); groups met in another order are refused by their shapes where
    these differ, and load by group position where they agree."""
    torch.manual_seed(0)
    narrow = [nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)) for _ in range(2)]
    wide = [nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)) for _ in range(2)]
    hens = fe.HeteroEnsemble([narrow[0], wide[0], narrow[1], wide[1]])
    opt = fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam, lr=0.01))
    opt.zero_grad()
    hens(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    fe.save(tmp_path / "opt.safetensors", opt)
    for order, loads in (
        ([narrow[0], narrow[1], wide[0], wide[1]], True),
        ([wide[0], narrow[0], wide[1], narrow[1]], False),
    ):
        other = fe.HeteroEnsemble(copy.deepcopy(order))
        other_opt = fe.optim.EnsembleOptimizer(other, other.optimizer(fe.optim.adam, lr=0.01))
        before = copy.deepcopy(other_opt.state)
        if loads:
            fe.load(tmp_path / "opt.safetensors", other_opt)
            assert_trees_close(other_opt.state, opt.state, rtol=0, atol=0)
            continue
        with pytest.raises(ValueError, match="shape"):
            fe.load(tmp_path / "opt.safetensors", other_opt)
        assert_trees_close(other_opt.state, before, rtol=0, atol=0)
    # Groups of the same shapes swapped (Tanh first, then ReLU first): no shape tells
    # them apart, and the Tanh group's state goes to the ReLU group.
    relu = [nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)) for _ in range(2)]
    hens = fe.HeteroEnsemble([narrow[0], relu[0], narrow[1], relu[1]])
    opt = fe.optim.EnsembleOptimizer(hens, hens.optimizer(fe.optim.adam, lr=0.01))
    hens(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    fe.save(tmp_path / "same_shapes.safetensors", opt)
    other = fe.HeteroEnsemble(copy.deepcopy([relu[0], narrow[0], relu[1], narrow[1]]))
    other_opt = fe.optim.EnsembleOptimizer(other, other.optimizer(fe.optim.adam, lr=0.01))
    fe.load(tmp_path / "same_shapes.safetensors", other_opt)
    assert isinstance(other.groups[0].stacked[1], nn.ReLU)
    assert_trees_close(other_opt.state, opt.state, rtol=0, atol=0)


class _Head(nn.Module):
    """A member whose forward has parameters named like the HeteroEnsemble's keywords."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, width)

    def forward(self, x: torch.Tensor, stack: bool = False, in_dims: object = None) -> torch.Tensor:
        h = self.lin(x)[..., :3]
        scale = 10.0 if in_dims is not None else 1.0
        return scale * (torch.cat([h, h], -1) if stack else torch.cat([h, 2 * h], -1))


@pytest.mark.parametrize("keyword", [{"stack": True}, {"stack": False}, {"in_dims": None}])
def test_own_keyword_the_members_forward_also_takes_is_refused(keyword: dict) -> None:
    # Found by an audit: hens(x, stack=True) took `stack` for itself, so members whose
    # forward has a parameter `stack` ran with their default (0.76 off the loop).
    torch.manual_seed(0)
    members = [_Head(3), _Head(5), _Head(3)]
    loop = copy.deepcopy(members)
    hens = fe.HeteroEnsemble(members)
    x = torch.randn(2, 4)
    name = next(iter(keyword))
    with pytest.raises(ValueError, match=rf"{name}= is both the HeteroEnsemble's own keyword"):
        hens(x, **keyword)
    # Without the keywords the members' defaults apply, as in the loop; positionally
    # their parameters are passed as in the loop.
    torch.testing.assert_close(hens(x), torch.stack([m(x) for m in loop]))
    torch.testing.assert_close(hens(x, True), torch.stack([m(x, True) for m in loop]))


class _TakesInDims(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, in_dims: object = None) -> torch.Tensor:
        return self.lin(x) * (10.0 if in_dims is not None else 1.0)


def test_in_dims_not_given_is_not_passed_to_the_groups() -> None:
    # A group whose members' forward takes `in_dims` refuses it: the HeteroEnsemble
    # passes it on only where the call gave it.
    torch.manual_seed(0)
    members = [mlp(3), _TakesInDims(), mlp(5)]
    loop = copy.deepcopy(members)
    hens = fe.HeteroEnsemble(members)
    x = torch.randn(2, 4)
    for stack in (True, False):
        outs = hens(x, stack=stack)
        for out, m in zip(outs, loop, strict=True):
            torch.testing.assert_close(out, m(x))
    with pytest.raises(ValueError, match=r"in_dims= is both .*\(_TakesInDims.forward\)"):
        hens(x, in_dims=None)
