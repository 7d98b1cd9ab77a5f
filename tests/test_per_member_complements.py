"""Per-member hyperparameters enter as torch.optim's Python floats would.

``1 - dampening`` (SGD) and ``1 - alpha`` (RMSprop) are computed in double precision
from a per-member value, as torch.optim computes them from a Python float, and rounded
once to the parameter's dtype: a float32 tensor of values on float64 parameters then
steps each member as torch.optim given that member's float32 value does. RMSprop's
square average adds ``((1 - alpha) * g) * g``, in the order of torch's ``addcmul``.
"""

import pytest
import torch

import funcensemble as fe

VALUES = torch.tensor([0.1, 0.2, 0.3, 0.05])  # float32: rounded values, as floats below


def _against_torch(cls, torch_kwargs, transform, dtype, steps: int = 10) -> float:
    """The largest difference from each member's own torch.optim, relative to the values."""
    g = torch.Generator().manual_seed(0)
    n = len(VALUES)
    start = torch.randn(n, 6, 5, generator=g, dtype=dtype)
    grads = [torch.randn(n, 6, 5, generator=g, dtype=dtype) for _ in range(steps)]
    members = [torch.nn.Parameter(start[i].clone()) for i in range(n)]
    opts = [cls([members[i]], **torch_kwargs(float(VALUES[i]))) for i in range(n)]
    params = {"w": start.clone()}
    state = transform.init(params)
    for grad in grads:
        state = transform.update_({"w": grad.clone()}, state, params)
        for i in range(n):
            members[i].grad = grad[i].clone()
            opts[i].step()
    want = torch.stack([p.detach() for p in members])
    return ((params["w"] - want).abs().max() / want.abs().max()).item()


CASES = {
    "sgd dampening": (
        torch.optim.SGD,
        lambda v: {"lr": 0.1, "momentum": 0.9, "dampening": v},
        lambda: fe.optim.sgd(lr=0.1, momentum=0.9, dampening=VALUES),
    ),
    "rmsprop alpha": (
        torch.optim.RMSprop,
        lambda v: {"lr": 0.01, "alpha": v},
        lambda: fe.optim.rmsprop(lr=0.01, alpha=VALUES),
    ),
    "rmsprop centered alpha": (
        torch.optim.RMSprop,
        lambda v: {"lr": 0.01, "alpha": v, "centered": True},
        lambda: fe.optim.rmsprop(lr=0.01, alpha=VALUES, centered=True),
    ),
    "adam betas": (
        torch.optim.Adam,
        lambda v: {"lr": 0.01, "betas": (v, v)},
        lambda: fe.optim.adam(lr=0.01, betas=(VALUES, VALUES)),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_per_member_values_on_float64_parameters(name: str) -> None:
    cls, kwargs, transform = CASES[name]
    assert _against_torch(cls, kwargs, transform(), torch.float64) < 1e-14


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_member_values_on_float32_parameters(name: str) -> None:
    """Each member as its own float32 torch.optim; with centered RMSprop's small alphas
    the multiplication order shows (it ended 3e-5 off when squared first)."""
    cls, kwargs, transform = CASES[name]
    assert _against_torch(cls, kwargs, transform(), torch.float32) < 1e-6


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_a_0_dim_float32_lr_steps_as_its_python_float(name: str) -> None:
    """As adam's docstring says: ``lr=t`` is ``torch.optim``'s ``lr=float(t)``."""
    lr = torch.tensor(3e-3)  # float32
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    make = {"adam": fe.optim.adam, "adamw": fe.optim.adamw}[name]
    g = torch.Generator().manual_seed(0)
    start = torch.randn(3, 4, generator=g, dtype=torch.float64)
    params = {"w": start.clone()}
    opt = make(lr=lr)
    state = opt.init(params)
    members = [torch.nn.Parameter(start[i].clone()) for i in range(3)]
    torch_opts = [cls([m], lr=float(lr)) for m in members]
    for _ in range(5):
        grad = torch.randn(3, 4, generator=g, dtype=torch.float64)
        state = opt.update_({"w": grad.clone()}, state, params)
        for i, o in enumerate(torch_opts):
            members[i].grad = grad[i].clone()
            o.step()
    torch.testing.assert_close(
        params["w"], torch.stack([m.detach() for m in members]), rtol=1e-15, atol=1e-16
    )


def test_float16_adam_is_the_fused_kernel_where_the_for_loop_gives_nan() -> None:
    """As adam's docstring says: eps=1e-8 is 0 in float16 for torch's for-loop Adam."""
    g = torch.Generator().manual_seed(0)
    start = (torch.randn(3, 8, generator=g) * 0.1).half()
    params = {"w": start.clone()}
    opt = fe.optim.adam(1e-3)
    state = opt.init(params)
    fused_params = [torch.nn.Parameter(start[i].clone()) for i in range(3)]
    loop_params = [torch.nn.Parameter(start[i].clone()) for i in range(3)]
    fused = [torch.optim.Adam([p], lr=1e-3, fused=True) for p in fused_params]
    loop = [torch.optim.Adam([p], lr=1e-3) for p in loop_params]
    for _ in range(5):
        grad = (torch.randn(3, 8, generator=g) * 1e-4).half()
        state = opt.update_({"w": grad.clone()}, state, params)
        for i in range(3):
            fused_params[i].grad = grad[i].clone()
            loop_params[i].grad = grad[i].clone()
            fused[i].step()
            loop[i].step()
    assert torch.equal(params["w"], torch.stack([p.detach() for p in fused_params]))
    assert torch.isnan(torch.stack([p.detach() for p in loop_params])).any()
