"""``torch.optim`` on an Ensemble's stacked parameters, against the loop.

An optimizer whose step acts element by element (plus per-tensor step counts) steps
each member as its own optimizer would: the docs list those. One that looks across a
whole tensor (Adafactor's factored second moment, LBFGS's line search, Muon's
orthogonalization) mixes the
members, and the docs say so; both claims are checked here.
"""

import copy

import pytest
import torch
from torch import nn

import funcensemble as fe

ELEMENTWISE = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=1),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
}


def _members(n: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double() for _ in range(n)]


def _train_both(make_opt, steps: int = 6) -> tuple[fe.Ensemble, list[nn.Module]]:
    members = _members()
    ens = fe.Ensemble(copy.deepcopy(members))
    opt = make_opt(ens.parameters())
    opts = [make_opt(m.parameters()) for m in members]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 5, generator=g, dtype=torch.float64)
        y = torch.randn(16, 3, generator=g, dtype=torch.float64)

        def ensemble_loss(x=x, y=y):
            opt.zero_grad()
            loss = ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum()
            loss.backward()
            return loss

        opt.step(ensemble_loss)  # a closure, for LBFGS; the others call it once
        for m, o in zip(members, opts, strict=True):

            def member_loss(m=m, o=o, x=x, y=y):
                o.zero_grad()
                loss = nn.functional.mse_loss(m(x), y)
                loss.backward()
                return loss

            o.step(member_loss)
    return ens, members


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_an_elementwise_torch_optim_steps_each_member_as_its_own(name: str) -> None:
    ens, members = _train_both(ELEMENTWISE[name])
    for i, m in enumerate(members):
        for k, v in m.state_dict().items():
            torch.testing.assert_close(ens.member(i).state_dict()[k], v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["Adafactor", "LBFGS"])
def test_a_whole_tensor_torch_optim_mixes_members(name: str) -> None:
    if not hasattr(torch.optim, name):
        pytest.skip(f"torch.optim.{name} is not in this torch")
    if name == "LBFGS":
        ens, members = _train_both(lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=3), steps=2)
    else:
        ens, members = _train_both(lambda p: torch.optim.Adafactor(p, lr=1e-2))
    differ = [
        not torch.allclose(ens.member(i).state_dict()[k], v, rtol=1e-6, atol=1e-8)
        for i, m in enumerate(members)
        for k, v in m.state_dict().items()
    ]
    assert any(differ)


def test_muon_on_stacked_biases_mixes_members() -> None:
    """training.md: Muon takes 2-D parameters, which a stacked bias [N, out] is (a
    member's own 1-D bias is refused); it orthogonalizes across the member axis, so
    scaling only member 2's loss moves member 0's step."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is not in this torch")
    torch.manual_seed(0)
    members = [torch.nn.Linear(8, 4) for _ in range(3)]
    x = torch.randn(16, 8)
    steps = []
    for scale in (1.0, 100.0):
        ens = fe.Ensemble(copy.deepcopy(members))
        opt = torch.optim.Muon([ens.stacked.bias], lr=0.02)
        weights = torch.tensor([1.0, 1.0, scale])
        (weights * ens(x).pow(2).mean(dim=(1, 2))).sum().backward()
        opt.step()
        steps.append(ens.stacked.bias.detach()[0].clone())
    assert not torch.allclose(steps[0], steps[1], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="2D"):
        torch.optim.Muon([members[0].bias], lr=0.02)


def test_a_member_left_out_of_the_loss_gets_zero_gradients_and_still_steps() -> None:
    """As the training how-to says: zeros, not None; SGD leaves the member where it is,
    Adam moves it on its moments from earlier steps."""
    members = _members(3)
    x = torch.randn(16, 5, dtype=torch.float64)
    builders = {
        "SGD": (lambda ens: torch.optim.SGD(ens.parameters(), lr=0.1), False),
        "Adam": (lambda ens: torch.optim.Adam(ens.parameters(), lr=1e-2), True),
        "EnsembleOptimizer": (
            lambda ens: fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2)),
            True,
        ),
    }
    for name, (make, moves) in builders.items():
        ens = fe.Ensemble(copy.deepcopy(members))
        opt = make(ens)
        for active in (slice(None), slice(0, 2)):  # all members, then member 2 left out
            opt.zero_grad()
            ens(x).pow(2).mean(dim=(1, 2))[active].sum().backward()
            before = {k: v.detach()[2].clone() for k, v in ens.named_parameters()}
            opt.step()
        for p in ens.parameters():
            assert p.grad is not None and torch.all(p.grad[2] == 0), name
        moved = any(not torch.equal(v.detach()[2], before[k]) for k, v in ens.named_parameters())
        assert moved is moves, name


def test_tools_that_look_across_a_tensor_see_all_members_as_faces_md_says() -> None:
    # faces.md: parameters_to_vector is laid out parameter after parameter, one
    # member's vector is torch.cat([p[i].flatten() for p in ens.parameters()]); a
    # ReduceLROnPlateau on the summed loss gives every member one rate.
    torch.manual_seed(0)
    members = [nn.Linear(3, 2) for _ in range(3)]
    ens = fe.Ensemble(members)
    for i, m in enumerate(members):
        own = torch.nn.utils.parameters_to_vector(m.parameters())
        torch.testing.assert_close(torch.cat([p[i].flatten() for p in ens.parameters()]), own)
    whole = torch.nn.utils.parameters_to_vector(ens.parameters())
    assert not torch.equal(
        whole.view(3, -1)[1], torch.nn.utils.parameters_to_vector(members[1].parameters())
    )
    opt = torch.optim.SGD(ens.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    for loss in (3.0, 4.0, 5.0):
        sched.step(loss)
    assert [g["lr"] for g in opt.param_groups] == [0.25]  # one rate for every member


def test_ema_with_averaged_model_gives_each_member_the_loops_average() -> None:
    """faces.md: EMA with torch.optim.swa_utils.AveragedModel (parameters and, with
    use_buffers=True, BatchNorm statistics) on an Ensemble averages each member as the
    loop's AveragedModel of that member does."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double()
        for _ in range(3)
    ]
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members)
    ema = AveragedModel(ens, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    loop_ema = [
        AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True) for m in loop
    ]
    opt = torch.optim.Adam(ens.parameters(), lr=1e-2)
    loop_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in loop]
    for _ in range(4):
        x = torch.randn(8, 3, dtype=torch.float64)
        opt.zero_grad()
        ens(x).pow(2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        ema.update_parameters(ens)
        for m, o, e in zip(loop, loop_opts, loop_ema, strict=True):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
            e.update_parameters(m)
    averaged = {**ema.module.stacked_params(), **ema.module.stacked_buffers()}
    for name, got in averaged.items():
        want = torch.stack([e.module.state_dict()[name] for e in loop_ema])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
    x = torch.randn(5, 3, dtype=torch.float64)
    ema.eval()
    for e in loop_ema:
        e.eval()
    torch.testing.assert_close(ema(x), torch.stack([e(x) for e in loop_ema]))
