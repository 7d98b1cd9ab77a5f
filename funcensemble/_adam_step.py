"""Adam's in-place step over aligned lists of tensors: the fused kernel, or multi-tensor ops.

Nothing here validates: the caller (``_adam``) has checked every list against the
parameters, so these functions only compute, writing into the tensors they are given.
"""

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from ._hyper import Hyper, hyper_map, is_per_member, per_leaf

# The dtypes torch.optim.Adam(fused=True) accepts.
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Moments(NamedTuple):
    """Adam's per-leaf state as aligned lists (``nu_max`` empty without amsgrad)."""

    mu: list[Tensor]
    nu: list[Tensor]
    nu_max: list[Tensor]
    counts: list[Tensor]


class Options(NamedTuple):
    """Validated hyperparameters and flags of one Adam or AdamW."""

    lr: Hyper
    b1: Hyper
    b2: Hyper
    eps: Hyper
    weight_decay: Hyper
    amsgrad: bool
    maximize: bool
    decoupled: bool


@functools.cache
def _fused_devices() -> frozenset[str]:
    """Device types with ``torch._fused_adam_`` kernels (CPU since torch 2.4)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # older torch: no fused CPU kernel to rely on
        return frozenset()
    return frozenset(_get_fused_kernels_supported_devices())


def bias_corrections(beta: Hyper, counts: list[Tensor], like: list[Tensor]) -> list[Tensor]:
    """``1 - beta ** count`` per leaf, computed in at least float32."""
    dtypes = [torch.promote_types(x.dtype, torch.float32) for x in like]
    exponents = [c.to(d) for c, d in zip(counts, dtypes, strict=True)]
    out = list(torch._foreach_pow(per_leaf(beta, like, dtypes), exponents))
    torch._foreach_neg_(out)
    torch._foreach_add_(out, 1.0)
    return out


def _fused_lr(lr: Hyper, device: torch.device) -> float | Tensor | None:
    """``lr`` as the fused kernel takes it, or None if it cannot."""
    value = lr.value
    if not isinstance(value, Tensor):
        return value
    if value.dim() != 0:
        return None
    if value.device.type == "cpu":
        return float(value)  # torch.optim passes a CPU lr as a scalar as well
    if not hasattr(torch.ops.aten._fused_adam_, "tensor_lr"):
        return None
    return value.to(device=device, dtype=torch.promote_types(value.dtype, torch.float32))


def adam_step_(params: list[Tensor], grads: list[Tensor], state: Moments, options: Options) -> None:
    """One Adam(W) step, in place on ``params`` and ``state``; lists aligned and checked."""
    o = options
    shared = not any(is_per_member(h) for h in (o.b1, o.b2, o.eps, o.weight_decay))
    kernel = getattr(torch, "_fused_adamw_" if o.decoupled else "_fused_adam_", None)
    lrs: dict[torch.device, float | Tensor | None] = {}
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    rest = []
    # Under torch.compile the fused kernel fails functionalization (an internal assert in
    # torch); the multi-tensor ops trace, and inductor fuses them anyway.
    devices = frozenset() if torch.compiler.is_compiling() else _fused_devices()
    for k, p in enumerate(params):
        if p.device not in lrs:
            fusable = shared and kernel is not None and p.device.type in devices
            lrs[p.device] = _fused_lr(o.lr, p.device) if fusable else None
        count = state.counts[k]
        if (
            lrs[p.device] is not None
            and p.dtype in _FUSED_DTYPES
            and count.device == p.device
            and count.dtype == torch.float32
            # The CPU kernel walks raw memory: a transposed gradient gives wrong numbers.
            and p.is_contiguous()
            and grads[k].is_contiguous()
            and state.mu[k].is_contiguous()
            and state.nu[k].is_contiguous()
            and (not o.amsgrad or state.nu_max[k].is_contiguous())
        ):
            groups.setdefault((p.device, p.dtype), []).append(k)
        else:
            rest.append(k)
    for (device, _), ks in groups.items():
        if len(ks) == len(params):  # the usual case: one device and dtype, all fusable
            ps, gs, group = params, grads, state
        else:
            ps, gs = [params[k] for k in ks], [grads[k] for k in ks]
            group = Moments(*([field[k] for k in ks] if field else [] for field in state))
        torch._foreach_add_(group.counts, 1.0)
        kernel(  # type: ignore[misc]
            ps,
            gs,
            group.mu,
            group.nu,
            group.nu_max,
            group.counts,
            lr=lrs[device],
            beta1=o.b1.value,
            beta2=o.b2.value,
            weight_decay=o.weight_decay.value,
            eps=o.eps.value,
            amsgrad=o.amsgrad,
            maximize=o.maximize,
        )
    if rest:
        pick = [params[k] for k in rest], [grads[k] for k in rest]
        moments = Moments(*([field[k] for k in rest] if field else [] for field in state))
        _foreach_step_(*pick, moments, o)


def _product(a: Hyper, b: Hyper, like: list[Tensor]) -> float | list[Tensor]:
    """``a * b`` per leaf, each factor in the leaf's dtype (as the pure path rounds)."""
    x, y = per_leaf(a, like), per_leaf(b, like)
    if isinstance(x, float) and isinstance(y, float):
        return x * y
    if isinstance(x, float):
        return list(torch._foreach_mul(y, x))  # type: ignore[arg-type]
    return list(torch._foreach_mul(x, y))


def _foreach_step_(params: list[Tensor], grads: list[Tensor], state: Moments, o: Options) -> None:
    """``torch.optim``'s multi-tensor Adam, with any hyperparameter per member.

    Per-member values are ``[N, 1, ..., 1]`` views broadcast over each leaf. Full-size
    temporaries are those of ``torch.optim.Adam(foreach=True)``: the denominator, and
    the gradient when ``maximize`` or L2 weight decay change it.
    """
    mu, nu = state.mu, state.nu
    torch._foreach_add_(state.counts, 1.0)
    if o.maximize:
        grads = list(torch._foreach_neg(grads))
    decay = is_per_member(o.weight_decay) or o.weight_decay.value != 0
    if decay and o.decoupled:
        shrink = _product(o.lr, o.weight_decay, params)
        if isinstance(shrink, float):
            torch._foreach_mul_(params, 1.0 - shrink)
        else:
            torch._foreach_neg_(shrink)
            torch._foreach_add_(shrink, 1.0)
            torch._foreach_mul_(params, shrink)
    elif decay:
        wd = per_leaf(o.weight_decay, params)
        if isinstance(wd, float):
            grads = list(torch._foreach_add(grads, params, alpha=wd))
        else:
            grads = list(torch._foreach_addcmul(grads, params, wd))
    torch._foreach_lerp_(mu, grads, per_leaf(hyper_map(o.b1, lambda b: 1 - b), mu))
    b2 = per_leaf(o.b2, nu)
    if isinstance(b2, float):
        torch._foreach_mul_(nu, b2)
        torch._foreach_addcmul_(nu, grads, grads, 1.0 - b2)
    else:
        scaled = torch._foreach_mul(grads, per_leaf(hyper_map(o.b2, lambda b: 1 - b), nu))
        torch._foreach_mul_(nu, b2)
        torch._foreach_addcmul_(nu, scaled, grads)
        del scaled  # freed before the denominator is allocated: one temporary at a time
    if o.amsgrad:
        torch._foreach_maximum_(state.nu_max, nu)
    denom = list(torch._foreach_sqrt(state.nu_max if o.amsgrad else nu))
    # As in the pure path: lr * m / (sqrt(v) * bc1 / sqrt(bc2) + eps * bc1), which is
    # torch.optim's (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
    bc1 = bias_corrections(o.b1, state.counts, params)
    bc2 = bias_corrections(o.b2, state.counts, params)
    torch._foreach_sqrt_(bc2)
    torch._foreach_mul_(denom, torch._foreach_div(bc1, bc2))
    eps = per_leaf(o.eps, denom)
    torch._foreach_add_(
        denom,
        torch._foreach_mul(bc1, eps) if isinstance(eps, float) else torch._foreach_mul(eps, bc1),
    )
    lr = per_leaf(o.lr, params)
    if isinstance(lr, float):
        torch._foreach_addcdiv_(params, mu, denom, -lr)
    else:
        # Dividing by -lr, as torch.optim's capturable path does: a member with lr 0
        # gets an infinite denominator, hence a zero step.
        torch._foreach_div_(denom, torch._foreach_neg(lr))
        torch._foreach_addcdiv_(params, mu, denom)
