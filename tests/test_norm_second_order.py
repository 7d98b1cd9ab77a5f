"""Second derivatives through normalization layers, written per member with
``torch.func.grad`` inside ``fe.value_and_grad``, against the loop's double backward.

torch's batching rules for the LayerNorm/BatchNorm backward kernels give wrong second
derivatives under vmap (pytorch/functorch#534); funcensemble runs those norms as
elementary ops there (``_kernels/norm_decomposed.py``).
"""

import pytest
import torch
from torch import nn
from torch.func import grad

import funcensemble as fe

N = 3


def models() -> dict[str, callable]:
    return {
        "layernorm": lambda: nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4)),
        "layernorm-no-affine": lambda: nn.Sequential(
            nn.Linear(8, 6), nn.Tanh(), nn.LayerNorm(6, elementwise_affine=False), nn.Linear(6, 4)
        ),
        "layernorm-2d": lambda: nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4)),
        "batchnorm-batch-stats": lambda: nn.Sequential(
            nn.Linear(8, 4), nn.BatchNorm1d(4, track_running_stats=False)
        ),
        "batchnorm-eval": lambda: nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)).eval(),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(models()))
def test_gradient_penalty_through_a_norm_matches_the_loops_double_backward(name, dtype):
    torch.manual_seed(0)
    members = [models()[name]().to(dtype) for _ in range(N)]
    fmodel, params, buffers = fe.stack(members)
    x = torch.randn(*((2,) if name == "layernorm-2d" else ()), 5, 8, dtype=dtype)
    y = torch.randn(N, *x.shape[:-1], 4, dtype=dtype)

    def penalty(p, b, target):  # one member: the squared norm of its loss gradient
        g = grad(lambda q: ((fmodel(q, b, x) - target) ** 2).mean())(p)
        return sum((v**2).sum() for v in g.values())

    losses, got, _ = fe.value_and_grad(penalty, in_dims=(0,))(params, buffers, y)
    tol = {"rtol": 1e-9, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    for i, m in enumerate(members):
        loss = ((m(x) - y[i]) ** 2).mean()
        gs = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        value = sum((v**2).sum() for v in gs)
        want = torch.autograd.grad(value, list(m.parameters()))
        torch.testing.assert_close(losses[i], value.detach(), **tol)
        for (k, _), w in zip(m.named_parameters(), want, strict=True):
            scale = w.abs().max().clamp(min=1.0)
            torch.testing.assert_close(got[k][i] / scale, w / scale, **tol)
