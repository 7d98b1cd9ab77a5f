"""Inside ``torch.nn.utils.parametrize.cached()``: torch caches a parametrized tensor
under its module's id, and the skeleton stands for every member. Each call keeps a
cache of its own, so chunks, selections and copies of an ensemble compute what the
loop computes there."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import funcensemble as fe


def members(n: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh()).double()
        for _ in range(n)
    ]


def loop(ms: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    with parametrize.cached():
        return torch.stack([m(x) for m in ms])


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_chunks_compute_their_own_members(chunk_size):
    ms = members()
    x = torch.randn(8, 4, dtype=torch.float64)
    ens = fe.Ensemble(ms, chunk_size=chunk_size)
    fmodel, params, buffers = fe.stack(ms)
    with parametrize.cached():
        got = ens(x)
        got_fn = fe.vmap(fmodel, chunk_size=chunk_size)(params, buffers, x)
    torch.testing.assert_close(got, loop(ms, x), rtol=0, atol=1e-14)
    torch.testing.assert_close(got_fn, loop(ms, x), rtol=0, atol=1e-14)


def test_selections_and_copies_do_not_read_each_others_weights():
    ms = members()
    x = torch.randn(8, 4, dtype=torch.float64)
    online = fe.Ensemble(ms)
    target = copy.deepcopy(online)
    perm = online.select([2, 0, 1])
    with torch.no_grad():
        for p in online.parameters():
            p.add_(1.0)
    with parametrize.cached():
        moved, t, p = online(x), target(x), perm(x)
    torch.testing.assert_close(t, loop(ms, x), rtol=0, atol=1e-14)
    torch.testing.assert_close(p, loop(ms, x)[[2, 0, 1]], rtol=0, atol=1e-14)
    assert (moved - t).abs().max() > 0.1  # online's own, moved weights


def test_gradients_and_steps_inside_cached_match_the_loop():
    ms = members()
    ref = copy.deepcopy(ms)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(3, 8, 5, dtype=torch.float64)
    fmodel, params, buffers = fe.stack(ms)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    with parametrize.cached():
        out = fe.vmap(fmodel)(params, buffers, x)
        _, grads, _ = fe.value_and_grad(loss_fn, in_dims=(None, 0), chunk_size=1)(
            params, buffers, x, y
        )
        for i, m in enumerate(ref):
            F.mse_loss(m(x), y[i]).backward()
    torch.testing.assert_close(out, loop(ref, x), rtol=0, atol=1e-14)
    for k, g in grads.items():
        want = torch.stack([m.get_parameter(k).grad for m in ref])
        torch.testing.assert_close(g, want, rtol=0, atol=1e-14)
    assert not parametrize._cache  # nothing of ours outlives the block's own cache
