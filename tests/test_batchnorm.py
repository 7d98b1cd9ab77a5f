"""BatchNorm folded into one batch_norm over N * C channels equals the loop."""

import copy

import pytest
import torch
from torch import nn

import funcensemble as fe
from funcensemble import _batchnorm

TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture
def folded(monkeypatch):
    """Records, per F.batch_norm call under vmap, whether the fold ran it."""
    calls = []
    original = _batchnorm._fold

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_batchnorm, "_fold", spy)
    return calls


def cnn(affine: bool = True, track: bool = True) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4, affine=affine, track_running_stats=track),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
        nn.BatchNorm1d(5, momentum=0.3, affine=affine, track_running_stats=track),
        nn.Linear(5, 2),
    ).double()


def members(n: int = 3, **kwargs) -> list[nn.Module]:
    torch.manual_seed(0)
    out = [cnn(**kwargs) for _ in range(n)]
    for i, m in enumerate(out):  # members with different statistics already
        with torch.no_grad():
            for b in m.buffers():
                if b.is_floating_point():
                    b.add_(0.1 * (i + 1))
    return out


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize(("affine", "track"), [(True, True), (False, False)])
def test_module_face_folds_and_equals_the_loop(train, affine, track, folded):
    modules = [m.train(train) for m in members(affine=affine, track=track)]
    loop = copy.deepcopy(modules)
    ens = fe.Ensemble(modules)
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    for _ in range(2):  # the second call sees the statistics the first one updated
        out = ens(x)
        ref = torch.stack([m(x) for m in loop])
        torch.testing.assert_close(out, ref, **TOL)
    assert folded and all(folded)
    for name, buf in ens.stacked_buffers().items():
        torch.testing.assert_close(buf, torch.stack([dict(m.named_buffers())[name] for m in loop]))
    out.sum().backward()
    ref.sum().backward()
    for name, p in ens.stacked_params().items():
        expected = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
        torch.testing.assert_close(p.grad, expected, **TOL)


def test_value_and_grad_folds_per_member_batches(folded):
    modules = [m.train() for m in members()]
    loop = copy.deepcopy(modules)
    fmodel, params, buffers = fe.stack(modules)
    xs = torch.randn(3, 6, 3, 6, 6, dtype=torch.float64)

    def loss_fn(p, b, x):
        return fmodel(p, b, x).pow(2).mean()

    losses, grads, new_buffers = fe.value_and_grad(loss_fn, in_dims=0)(params, buffers, xs)
    assert folded and all(folded)
    for i, m in enumerate(loop):
        loss = m(xs[i]).pow(2).mean()
        loss.backward()
        torch.testing.assert_close(losses[i], loss.detach(), **TOL)
        for name, p in m.named_parameters():
            torch.testing.assert_close(grads[name][i], p.grad, **TOL)
        for name, b in m.named_buffers():
            torch.testing.assert_close(new_buffers[name][i], b)


def test_a_shared_input_into_batch_norm_is_left_to_vmap(folded):
    # The input is not batched (every member sees the same tensor): vmap's rule runs.
    torch.manual_seed(1)
    modules = [nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2)).double() for _ in range(3)]
    loop = copy.deepcopy(modules)
    ens = fe.Ensemble(modules)
    x = torch.randn(8, 4, dtype=torch.float64)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]), **TOL)
    assert folded == [False]
