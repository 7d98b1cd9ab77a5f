"""Run by tests/test_compile.py in a fresh interpreter.

The test run wraps every funcensemble function in jaxtyping+beartype checkers, which
Dynamo cannot trace; users compile the plain library, as this script does.
"""

import copy
import sys

import torch
from torch import nn
from torch.nn import functional as F

import funcensemble as fe


def make_members(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    # No bias before BatchNorm: its gradient is pure round-off, which Adam's
    # normalisation amplifies, so compiled and eager could not be compared there.
    return [
        nn.Sequential(nn.Linear(4, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))
        for _ in range(n)
    ]


def functional_training_step() -> None:
    fmodel, params, buffers = fe.stack(make_members(3))
    opt = fe.optim.adam(lr=1e-2, weight_decay=1e-3)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    def train_step(params, buffers, state, x, y):
        losses, grads, buffers = fe.value_and_grad(loss_fn)(params, buffers, x, y)
        updates, state = opt.update(grads, state, params)
        return fe.optim.apply_updates(params, updates), buffers, state, losses

    compiled = torch.compile(train_step, fullgraph=True)
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    eager = (params, buffers, opt.init(params))
    comp = (
        {k: v.detach().clone() for k, v in params.items()},
        {k: v.clone() for k, v in buffers.items()},
        opt.init(params),
    )
    for _ in range(3):
        *eager, eager_losses = train_step(*eager, x, y)
        *comp, comp_losses = compiled(*comp, x, y)
        torch.testing.assert_close(comp_losses, eager_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(comp[:2], eager[:2], strict=True):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert comp[1]["1.num_batches_tracked"].tolist() == [3, 3, 3]


def module_face_training_step() -> None:
    modules = make_members(3)
    ens = fe.Ensemble(copy.deepcopy(modules))
    ref = fe.Ensemble(copy.deepcopy(modules))
    compiled = torch.compile(ens, fullgraph=True)
    opt = torch.optim.Adam(ens.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    for _ in range(3):
        for model, o in ((compiled, opt), (ref, ref_opt)):
            o.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            o.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ens.state_dict()[k], v, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    {"functional": functional_training_step, "module": module_face_training_step}[sys.argv[1]]()
    print("OK")
