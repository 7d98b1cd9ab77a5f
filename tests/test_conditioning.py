"""training.md, "Comparing with your own loop": a train-mode BatchNorm with two values
per channel magnifies float32 rounding; the ensemble is then no further from the exact
(float64) gradients than the float32 loop itself is, and float64 matches the loop."""

import copy

import torch
from torch import nn

import funcensemble as fe

N, SEEDS = 4, range(6)


def members(seed: int) -> tuple[list[nn.Module], torch.Tensor, torch.Tensor]:
    """InstanceNorm -> Conv1d to length 1 -> BatchNorm over a batch of 2: 2 values per channel."""
    torch.manual_seed(seed)
    ms = []
    for _ in range(N):
        m = nn.Sequential(
            nn.InstanceNorm1d(3, affine=True),
            nn.Conv1d(3, 5, 2, stride=2, bias=False),
            nn.BatchNorm1d(5, affine=False, track_running_stats=False),
        )
        with torch.no_grad():
            m[0].weight.uniform_(0.5, 1.5)
            m[0].bias.normal_(0, 0.2)
        ms.append(m)
    return ms, torch.randn(2, 3, 3), torch.randn(N, 2, 5, 1)


def loop_grads(ms: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    grads = []
    for i, m in enumerate(ms):
        loss = ((m(x) - y[i]) ** 2).mean()
        grads.append(torch.autograd.grad(loss, list(m.parameters())))
    names = [n for n, _ in ms[0].named_parameters()]
    return {n: torch.stack([g[k] for g in grads]) for k, n in enumerate(names)}


def ensemble_grads(
    ms: list[nn.Module], x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    ens = fe.Ensemble(copy.deepcopy(ms))
    ((ens(x) - y) ** 2).flatten(1).mean(1).sum().backward()
    return {n: p.grad for n, p in ens.stacked.named_parameters()}


def error(got: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> float:
    scale = max(v.abs().max().item() for v in exact.values())
    return max((got[n].double() - exact[n]).abs().max().item() for n in exact) / scale


def test_float32_ensemble_is_as_close_to_exact_as_the_float32_loop_and_float64_matches():
    ours, loops, apart, moves = [], [], [], []
    for seed in SEEDS:
        ms, x, y = members(seed)
        wide = [copy.deepcopy(m).double() for m in ms]
        exact = loop_grads(wide, x.double(), y.double())
        assert error(ensemble_grads(wide, x.double(), y.double()), exact) < 1e-11
        loop = loop_grads(ms, x, y)
        loops.append(error(loop, exact))
        ours.append(error(ensemble_grads(ms, x, y), exact))
        # The loop's own answer when every input moves by one rounding (the next float up).
        nudged = loop_grads(ms, torch.nextafter(x, torch.full_like(x, float("inf"))), y)
        scale = max(v.abs().max().item() for v in exact.values())
        apart.append(error(ensemble_grads(ms, x, y), loop) * _scale(loop) / scale)
        moves.append(max((nudged[n] - loop[n]).abs().max().item() for n in loop) / scale)
    assert max(loops) > 1e-5  # the magnification the page describes, on the loop alone
    assert max(ours) < 2 * max(loops), (ours, loops)
    assert max(apart) < 2e-4 and max(apart) <= max(moves), (apart, moves)


def _scale(grads: dict[str, torch.Tensor]) -> float:
    return max(v.abs().max().item() for v in grads.values())
