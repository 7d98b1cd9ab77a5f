"""Module backward hooks do not run inside vmap: refused, never silently dropped.

The loop runs a member's backward hooks; inside ``torch.func.vmap`` torch leaves them
out, so an ensemble of members carrying one would compute other gradients without a
word. Each route that could meet one refuses it before anything changes.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod

import funcensemble as fe


def _triple(module, grad_input, grad_output):
    return (grad_input[0] * 3.0,)


def _triple_pre(module, grad_output):
    return (grad_output[0] * 3.0,)


def _triple_legacy(module, grad_input, grad_output):
    return tuple(None if g is None else g * 3.0 for g in grad_input)


HOOKS = {
    "full": lambda m: m.register_full_backward_hook(_triple),
    "pre": lambda m: m.register_full_backward_pre_hook(_triple_pre),
    "legacy": lambda m: m.register_backward_hook(_triple_legacy),
}
KIND = {"full": "backward hook", "pre": "backward pre-hook", "legacy": "backward hook"}


def _members(n: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double() for _ in range(n)]


def _x() -> torch.Tensor:
    return torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("hook", sorted(HOOKS))
@pytest.mark.parametrize("build", ["Ensemble", "stack", "HeteroEnsemble", "concat"])
def test_a_member_with_a_backward_hook_is_refused(hook: str, build: str) -> None:
    members = _members()
    HOOKS[hook](members[1][2])
    before = copy.deepcopy([m.state_dict() for m in members])
    index = 2 if build == "concat" else 1  # concat counts the members it joins onto
    message = rf"member {index} has a {KIND[hook]} on submodule `2`\. Module backward hooks"
    with pytest.raises(ValueError, match=message):
        if build == "Ensemble":
            fe.Ensemble(members)
        elif build == "stack":
            fe.stack(members)
        elif build == "HeteroEnsemble":
            fe.HeteroEnsemble(members)
        else:
            fe.Ensemble(_members(1)).concat(members)
    for m, state in zip(members, before, strict=True):
        for k, v in m.state_dict().items():
            assert torch.equal(v, state[k])


def test_the_refusal_says_what_to_do_instead() -> None:
    members = _members()
    for m in members:
        m.register_full_backward_hook(_triple)
    with pytest.raises(ValueError, match=r"member 0 has a backward hook on the root") as info:
        fe.Ensemble(members)
    assert "do not run inside torch.func.vmap" in str(info.value)
    assert "out.register_hook" in str(info.value)


def test_a_hook_added_to_the_ensemble_module_later_is_refused_at_the_call() -> None:
    ens = fe.Ensemble(_members())
    handle = ens.stacked[2].register_full_backward_hook(_triple)
    with pytest.raises(ValueError, match=r"Ensemble: the ensemble's module has a backward hook"):
        ens(_x())
    fmodel, params, buffers = fe.stack(_members())
    fmodel.skeleton[0].register_full_backward_pre_hook(_triple_pre)
    with pytest.raises(ValueError, match=r"has a backward pre-hook on submodule `0`"):
        fe.vmap(fmodel)(params, buffers, _x())
    handle.remove()
    assert ens(_x()).shape == (3, 5, 2)


@pytest.mark.parametrize("register", ["full", "pre", "legacy"])
def test_a_global_backward_hook_is_refused_at_the_call(
    register: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch remembers whether the last global backward hook was a full one, even once
    # removed, and refuses the other kind after it: start this test afresh.
    monkeypatch.setattr(module_mod, "_global_is_full_backward_hook", None)
    ens = fe.Ensemble(_members())
    fmodel, params, buffers = fe.stack(_members())

    def loss_fn(p, b, x):
        return fmodel(p, b, x).pow(2).mean()

    add = {
        "full": lambda: module_mod.register_module_full_backward_hook(_triple),
        "pre": lambda: module_mod.register_module_full_backward_pre_hook(_triple_pre),
        "legacy": lambda: module_mod.register_module_backward_hook(_triple_legacy),
    }[register]
    handle = add()
    try:
        for where, call in (
            ("Ensemble", lambda: ens(_x())),
            ("vmap", lambda: fe.vmap(fmodel)(params, buffers, _x())),
            ("value_and_grad", lambda: fe.value_and_grad(loss_fn)(params, buffers, _x())),
        ):
            with pytest.raises(ValueError, match=rf"{where}: a global module backward hook"):
                call()
    finally:
        handle.remove()
    losses, grads, _ = fe.value_and_grad(loss_fn)(params, buffers, _x())
    assert losses.shape == (3,) and grads["0.weight"].shape == (3, 8, 4)


def test_a_hook_on_the_ensemble_itself_runs_as_the_refusal_suggests() -> None:
    """The suggested replacement: a backward pre-hook on the Ensemble scales the
    stacked output's gradient, as the same hook on each plain member does."""
    members = _members()
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members)
    ens.register_full_backward_pre_hook(_triple_pre)
    x = _x().requires_grad_()  # a full hook with no input requiring grad warns
    ens(x).pow(2).mean(dim=(1, 2)).sum().backward()
    for m in loop:
        m.register_full_backward_pre_hook(_triple_pre)
        m(x).pow(2).mean().backward()
    for name, g in ens.stacked_params().items():
        expected = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
        torch.testing.assert_close(g.grad, expected, rtol=1e-12, atol=1e-14)


def test_a_refused_call_changes_no_running_statistics() -> None:
    """The docs: the call refuses the hook "before anything is computed"."""
    torch.manual_seed(0)
    ens = fe.Ensemble([nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)) for _ in range(2)])
    before = {k: v.clone() for k, v in ens.stacked_buffers().items()}
    ens.stacked[1].register_full_backward_hook(_triple)
    with pytest.raises(ValueError, match=r"backward hook on submodule `1`, added after"):
        ens(torch.randn(6, 4))
    for k, v in ens.stacked_buffers().items():
        assert torch.equal(v, before[k]), k


def test_a_tensor_inside_forward_reports_no_grad_under_the_ensemble():
    """docs/how-to/unsupported.md: inside a member's forward under the ensemble's vmap,
    an intermediate reports ``requires_grad=False`` (a hook registered only ``if
    h.requires_grad`` is never registered), while the loop's reports True."""
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x):
            h = self.fc(x)
            seen.append(h.requires_grad)
            return h

    members = [Probe() for _ in range(2)]
    members[0](torch.randn(4, 3))
    assert seen == [True]
    seen.clear()
    fe.Ensemble(members)(torch.randn(4, 3))
    assert seen == [False]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def _bn() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.mark.parametrize("face", ["Ensemble", "chunked", "HeteroEnsemble"])
@pytest.mark.parametrize("make", [_mlp, _bn], ids=["mlp", "batchnorm"])
def test_global_forward_hooks_run_as_in_the_loop(face, make) -> None:
    """A global forward hook (or pre-hook) that changes what it is given ran on the
    members' modules and once more on the ensemble itself, which the loop never calls:
    outputs twice the loop's (a pre-hook adding 1: 0.43 off), without a word."""
    torch.manual_seed(0)
    members = [make().double() for _ in range(3)]
    if face == "HeteroEnsemble":  # two groups, each an Ensemble inside
        members += [nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double()]
    loop = copy.deepcopy(members)
    if face == "HeteroEnsemble":
        ens = fe.HeteroEnsemble(members)
    else:
        ens = fe.Ensemble(members, chunk_size=2 if face == "chunked" else None)
    x = torch.randn(5, 4, dtype=torch.float64)
    scale = module_mod.register_module_forward_hook(lambda m, args, out: out * 2)
    shift = module_mod.register_module_forward_pre_hook(lambda m, args: (args[0] + 1,))
    try:
        want = torch.stack([m(x) for m in loop])
        got = ens(x)
    finally:
        scale.remove()
        shift.remove()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_an_observing_global_hook_sees_the_members_modules() -> None:
    """torch's own tools hook every module globally (FlopCounterMode's module tracker):
    they keep working, and count the members' layers."""
    from torch.utils.flop_counter import FlopCounterMode

    ens = fe.Ensemble([_bn() for _ in range(3)])
    with FlopCounterMode(display=False) as counter:
        ens(torch.randn(5, 4))
    assert counter.get_total_flops() > 0


def test_a_global_forward_hook_with_hooks_on_the_ensemble_is_refused() -> None:
    ens = fe.Ensemble([_mlp() for _ in range(3)])
    own = ens.register_forward_hook(lambda m, args, out: out + 1)
    seen = []
    handle = module_mod.register_module_forward_hook(lambda m, args, out: seen.append(m))
    try:
        with pytest.raises(ValueError, match=r"global forward hook is set.*hooks of its own"):
            ens(torch.randn(5, 4))
        assert seen == []  # refused before anything ran
    finally:
        handle.remove()
    out = ens(torch.randn(5, 4))  # its own hook alone runs as torch runs it
    own.remove()
    assert out.shape == (3, 5, 2)
