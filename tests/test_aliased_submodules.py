"""A submodule registered under two names computes, trains and stays as the loop's.

``torch.func.functional_call(..., tie_weights=True)`` used to leave one member's
batched tensor in such a module after the call: the ``Ensemble``'s stacked parameters
vanished from ``parameters()`` (an optimizer built before kept stepping tensors the
ensemble no longer used) and the next call failed inside ``vmap``.
"""

import copy

import pytest
import torch
from torch import nn

import funcensemble as fe

TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


class TwoNames(nn.Module):
    """One Linear under two attribute names, used once by each."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3, bias=False)
        self.c = self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) + 0.5 * self.b(torch.tanh(self.c(x)) ** 2)


def _twice_in_sequential() -> nn.Module:
    """One layer at two places of a Sequential, with a LayerNorm (the general path)."""
    layer = nn.Linear(4, 4)
    return nn.Sequential(layer, nn.LayerNorm(4), layer, nn.Linear(4, 3))


def _twice_in_mlp() -> nn.Module:
    """The same, as a Linear-Tanh chain (the MLP fast path)."""
    layer = nn.Linear(4, 4)
    return nn.Sequential(layer, nn.Tanh(), layer, nn.Tanh(), nn.Linear(4, 3))


MAKERS = {"two_names": TwoNames, "sequential": _twice_in_sequential, "mlp": _twice_in_mlp}


def _members(make, dtype: torch.dtype, n: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    return [make().to(dtype) for _ in range(n)]


def _batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g, dtype=dtype), torch.randn(8, 3, generator=g, dtype=dtype)


def _loop(members: list[nn.Module], steps: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Each member with its own torch.optim.Adam; returns the outputs of every step."""
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in members]
    outs = []
    for step in range(steps):
        x, y = _batch(step, dtype)
        step_outs = []
        for m, opt in zip(members, opts, strict=True):
            opt.zero_grad()
            out = m(x)
            nn.functional.mse_loss(out, y).backward()
            opt.step()
            step_outs.append(out.detach())
        outs.append(step_outs)
    return outs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_module_face_trains_as_the_loop(name: str, dtype: torch.dtype) -> None:
    members = _members(MAKERS[name], dtype)
    ens = fe.Ensemble(copy.deepcopy(members))
    params_before = list(ens.parameters())
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
    want = _loop(members, 4, dtype)
    for step in range(4):
        x, y = _batch(step, dtype)
        opt.zero_grad()
        out = ens(x)
        torch.testing.assert_close(out.detach(), torch.stack(want[step]), **TOL[dtype])
        ((out - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
    # The stacked parameters are still the ensemble's own, the ones the optimizer steps.
    assert all(p is q for p, q in zip(ens.parameters(), params_before, strict=True))
    assert len(ens) == 3
    for i, member in enumerate(members):
        mine = ens.member(i).state_dict()
        assert mine.keys() == member.state_dict().keys()
        for k, v in member.state_dict().items():
            torch.testing.assert_close(mine[k], v, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_functional_face_trains_as_the_loop(name: str, dtype: torch.dtype) -> None:
    members = _members(MAKERS[name], dtype)
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))
    skeleton_params = dict(fmodel.skeleton.named_parameters())

    def loss_fn(p, b, x, y):
        return nn.functional.mse_loss(fmodel(p, b, x), y)

    value_and_grad = fe.value_and_grad(loss_fn)
    tx = fe.optim.adam(1e-2)
    state = tx.init(params)
    _loop(members, 4, dtype)
    for step in range(4):
        x, y = _batch(step, dtype)
        _, grads, buffers = value_and_grad(params, buffers, x, y)
        updates, state = tx.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
        # fe.vmap of the same function, called twice, as the loop's forward.
        for _ in range(2):
            out = fe.vmap(fmodel)(params, buffers, x)
            assert out.shape == (3, 8, 3)
    for k, v in params.items():
        want = torch.stack([dict(m.named_parameters())[k] for m in members]).detach()
        torch.testing.assert_close(v, want, **TOL[dtype])
    assert dict(fmodel.skeleton.named_parameters()) == skeleton_params
