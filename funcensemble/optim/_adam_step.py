"""Adam's step over aligned lists of tensors: torch's fused kernel, or multi-tensor ops.

Nothing here validates: the caller (``_adam``) has checked every list against the
parameters, so these functions only compute, in place or into fresh tensors.
"""

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _torch_compat
from ._hyper import Hyper, is_per_member, one_minus, per_leaf
from ._protocol import updates_to_

# The dtypes torch.optim.Adam(fused=True) accepts.
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Elements that fill whole SIMD vectors of the CPU fused kernel for every dtype and
# vector width up to 1,024 bits (see `_fused_fresh`).
_WHOLE_VECTORS = 64


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


def _wide(device: torch.device) -> torch.dtype:
    """The dtype of torch.optim's Python-float arithmetic: float64, where the device has it."""
    return torch.float32 if device.type == "mps" else torch.float64


def _in_double(h: Hyper) -> float | Tensor:
    """``h``'s value in double precision, on its own device (a float stays a float)."""
    v = h.value
    return v.to(_wide(v.device)) if isinstance(v, Tensor) else v


def complement(h: Hyper, like: list[Tensor]) -> float | list[Tensor]:
    """``1 - h`` per leaf, computed in double precision and rounded to each leaf's dtype."""
    return per_leaf(one_minus(h), like)


def _shrink(lr: Hyper, weight_decay: Hyper, like: list[Tensor]) -> float | list[Tensor]:
    """AdamW's factor ``1 - lr * weight_decay`` per leaf, in double precision as torch.optim."""
    lr_, wd = _in_double(lr), _in_double(weight_decay)
    if isinstance(lr_, Tensor) and isinstance(wd, Tensor):
        wd = wd.to(lr_.device)
    return per_leaf(Hyper("1 - lr * weight_decay", 1.0 - lr_ * wd), like)  # type: ignore[operator]


def _on(h: Hyper, device: torch.device, dtype: torch.dtype) -> float | Tensor:
    """``h``'s value on ``device`` in ``dtype`` (a float stays a float)."""
    v = h.value
    return v.to(device=device, dtype=dtype) if isinstance(v, Tensor) else v


def step_factors(
    lr: Hyper, b1: Hyper, b2: Hyper, counts: list[Tensor], like: list[Tensor]
) -> tuple[list[Tensor], list[Tensor]]:
    """Per leaf, torch.optim's ``-lr / (1 - b1**t)`` and ``sqrt(1 - b2**t)``.

    torch.optim computes both from Python floats, in double precision, and the kernel
    that uses each rounds it once to the parameter's dtype. In float32, ``1 - b2**t``
    would keep only a few digits (b2 = 0.99999, t = 1: 1e-5 known to about 1e-7) and the
    step would drift from torch.optim's by ~1e-3 of its size. So these are computed in
    float64 on the leaves' devices, without reading the step count back to Python (no
    device sync; traceable by torch.compile), and rounded once to each leaf's dtype:
    one ``[leaves, members]`` computation per device and dtype, then a view per leaf.
    """
    step: list[Tensor] = [None] * len(like)  # type: ignore[list-item]
    bc2_sqrt: list[Tensor] = [None] * len(like)  # type: ignore[list-item]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, p in enumerate(like):
        groups.setdefault((p.device, p.dtype), []).append(k)
    for (device, dtype), ks in groups.items():
        wide = _wide(device)
        beta1, beta2, rate = (_on(h, device, wide) for h in (b1, b2, lr))
        cs = [counts[k].to(device) for k in ks]
        if all(c.dim() == 0 for c in cs):  # one count per leaf, shared by the members
            t = torch.stack(cs).to(wide).unsqueeze(1)  # [leaves, 1]
        else:  # [N] counts once members joined after steps (member surgery)
            t = torch.stack(torch.broadcast_tensors(*[c.reshape(-1) for c in cs])).to(wide)
        neg_bc1 = torch.pow(beta1, t) - 1.0  # b1**t - 1 = -(1 - b1**t)
        root = (1.0 - torch.pow(beta2, t)).sqrt()
        # [2, leaves, members or 1]: both factors, rounded once to the leaves' dtype.
        both = torch.stack(torch.broadcast_tensors(rate / neg_bc1, root)).to(dtype)
        n = both.shape[2]
        views: dict[int, tuple[Tensor, ...]] = {}
        for row, k in enumerate(ks):
            rank = like[k].dim()
            if rank not in views:  # one view per rank: [n, 1, ..., 1], or all ones
                shape = (n, *[1] * (rank - 1)) if n > 1 else (1,) * rank
                views[rank] = both.reshape(2 * len(ks), *shape).unbind(0)
            step[k], bc2_sqrt[k] = views[rank][row], views[rank][len(ks) + row]
    return step, bc2_sqrt


def _fused_lr(lr: Hyper, device: torch.device) -> float | Tensor | None:
    """``lr`` as the fused kernel takes it, or None if it cannot."""
    value = lr.value
    if not isinstance(value, Tensor):
        return value
    if value.dim() != 0:
        return None
    if value.device.type == "cpu":
        return float(value)  # torch.optim passes a CPU lr as a scalar as well
    if not _torch_compat.fused_adam_takes_tensor_lr():
        return None
    return value.to(device=device, dtype=torch.promote_types(value.dtype, torch.float32))


class _Fused(NamedTuple):
    """Which leaves of one Adam step torch's fused kernel takes, grouped, and which not."""

    kernel: Any  # torch._fused_adam_ or torch._fused_adamw_
    lrs: dict[torch.device, float | Tensor]  # the learning rate as the kernel takes it
    groups: dict[tuple[torch.device, torch.dtype], list[int]]  # one kernel call each
    rest: list[int]  # leaves for the multi-tensor ops


def _fused_split(
    params: list[Tensor], grads: list[Tensor], state: Moments, o: Options, *, pure: bool
) -> _Fused:
    """Split the leaves between torch's fused kernel and the multi-tensor ops.

    The kernel takes float hyperparameters, one float32 step count per tensor, the
    dtypes and devices ``torch.optim.Adam(fused=True)`` accepts, and contiguous tensors
    (the CPU kernel walks raw memory: a transposed gradient gives wrong numbers). Under
    torch.compile it fails functionalization (an internal assert in torch), and the
    ``pure`` step does not run it on the wrapped tensors of a ``torch.func`` transform:
    the multi-tensor ops trace and batch, and inductor fuses them anyway.
    """
    shared = not any(is_per_member(h) for h in (o.b1, o.b2, o.eps, o.weight_decay))
    kernel = _torch_compat.fused_adam_kernel(decoupled=o.decoupled)
    lrs: dict[torch.device, float | Tensor | None] = {}
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    rest = []
    off = torch.compiler.is_compiling() or (pure and _torch_compat.inside_transform())
    devices = frozenset() if off else _torch_compat.fused_adam_devices()
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
            and count.dim() == 0  # the kernel takes one step per tensor
            and p.is_contiguous()
            and grads[k].is_contiguous()
            and state.mu[k].is_contiguous()
            and state.nu[k].is_contiguous()
            and (not o.amsgrad or state.nu_max[k].is_contiguous())
        ):
            groups.setdefault((p.device, p.dtype), []).append(k)
        else:
            rest.append(k)
    return _Fused(kernel, lrs, groups, rest)  # type: ignore[arg-type]


def _pick(xs: list[Tensor], ks: list[int], everything: bool) -> list[Tensor]:
    return xs if everything else [xs[k] for k in ks]


def _picked(state: Moments, ks: list[int], everything: bool) -> Moments:
    return Moments(*(_pick(field, ks, everything) if field else [] for field in state))


def adam_step_(params: list[Tensor], grads: list[Tensor], state: Moments, options: Options) -> None:
    """One Adam(W) step, in place on ``params`` and ``state``; lists aligned and checked."""
    o = options
    fused = _fused_split(params, grads, state, o, pure=False)
    for (device, _), ks in fused.groups.items():
        everything = len(ks) == len(params)  # the usual case: one device and dtype
        group = _picked(state, ks, everything)
        torch._foreach_add_(group.counts, 1.0)
        fused.kernel(
            _pick(params, ks, everything),
            _pick(grads, ks, everything),
            group.mu,
            group.nu,
            group.nu_max,
            group.counts,
            lr=fused.lrs[device],
            beta1=o.b1.value,
            beta2=o.b2.value,
            weight_decay=o.weight_decay.value,
            eps=o.eps.value,
            amsgrad=o.amsgrad,
            maximize=o.maximize,
        )
        if not torch.compiler.is_compiling():
            # The fused kernel writes without bumping version counters, which the
            # multi-tensor ops (torch.optim's default) bump: a graph saved before the
            # step must stop backward ("modified by an inplace operation"), not run on
            # the stepped values.
            for p in _pick(params, ks, everything):
                torch.autograd.graph.increment_version(p)
    if fused.rest:
        ks = fused.rest
        foreach_adam(
            _pick(params, ks, False),
            _pick(grads, ks, False),
            _picked(state, ks, False),
            o,
            in_place=True,
        )


def adam_step(
    params: list[Tensor], grads: list[Tensor], state: Moments, options: Options
) -> tuple[Moments, list[Tensor]]:
    """One Adam(W) step into fresh tensors: the new state and the updates; nothing written.

    Where torch's fused kernel applies (see ``_fused_split``) it runs on new tensors:
    copies of the moments become the new state, and the "parameters" it steps are
    ``-0.0`` (Adam without weight decay, which never reads them) or a copy of the
    parameters (weight decay reads them). From ``-0.0`` the kernel's ``p + (-step * m /
    denom)`` leaves exactly its step ``-step * m / denom``, so ``params + updates``
    rounds as the kernel's in-place step does: ``apply_updates`` then gives bit for
    bit what ``update_`` gives (on leaves ``_fused_fresh`` need not pad). With weight
    decay the updates are ``new - params``: exact wherever the new value is within a
    factor 2 of the old (Sterbenz), so ``params + updates`` gives ``new`` back there,
    and within a rounding of the larger of the two elsewhere (a parameter crossing
    zero). The other leaves take the multi-tensor ops of ``foreach_adam``.
    """
    o = options
    fused = _fused_split(params, grads, state, o, pure=True)
    n = len(params)
    parts = []  # (leaf indices, new moments, updates)
    for (device, _), ks in fused.groups.items():
        everything = len(ks) == n
        new, updates = _fused_fresh(
            fused.kernel,
            fused.lrs[device],
            _pick(params, ks, everything),
            _pick(grads, ks, everything),
            _picked(state, ks, everything),
            o,
        )
        if everything:  # the usual case: one device and dtype, all fusable
            return new, updates
        parts.append((ks, new, updates))
    if fused.rest:
        ks = fused.rest
        picked = _pick(params, ks, False), _pick(grads, ks, False), _picked(state, ks, False)
        if len(ks) == n:
            return foreach_adam(*picked, o, in_place=False)
        parts.append((ks, *foreach_adam(*picked, o, in_place=False)))
    new = Moments([None] * n, [None] * n, [None] * n if o.amsgrad else [], [None] * n)  # type: ignore[list-item]
    updates: list[Tensor] = [None] * n  # type: ignore[list-item]
    for ks, moments, ups in parts:
        for field, values in zip((*new, updates), (*moments, ups), strict=True):
            for k, v in zip(ks, values, strict=False):  # nu_max: empty without amsgrad
                field[k] = v
    return new, updates


def _fused_fresh(
    kernel: Any,
    lr: float | Tensor,
    params: list[Tensor],
    grads: list[Tensor],
    state: Moments,
    o: Options,
) -> tuple[Moments, list[Tensor]]:
    """torch's fused kernel on fresh copies of the state: the new state and the updates.

    A leaf whose size is not a multiple of ``_WHOLE_VECTORS`` runs flattened and padded
    to one (its gradient copied too): the CPU kernel rounds a tensor's last ``numel %
    vector width`` elements in scalar code, unlike the others, so without the padding
    which elements land there would depend on how many members the tensor stacks, and
    a member's numbers would change when the ensemble is split across devices or
    members are selected. 64 elements make whole vectors for every dtype and vector
    width up to 1,024 bits, and whole cache-line chunks of ``parallel_for``.
    """
    counts = list(torch._foreach_add(state.counts, 1.0))
    pads = [-p.numel() % _WHOLE_VECTORS for p in params]
    decays = o.weight_decay.value != 0  # a float here: the kernel takes no tensor
    mu = [_fresh(m, pad) for m, pad in zip(state.mu, pads, strict=True)]
    nu = [_fresh(v, pad) for v, pad in zip(state.nu, pads, strict=True)]
    nu_max = [_fresh(v, pad) for v, pad in zip(state.nu_max, pads, strict=False)]
    if decays:
        out = [_fresh(p, pad) for p, pad in zip(params, pads, strict=True)]
    else:  # -0.0 + x is x for every x, -0.0 and +0.0 included: the kernel leaves its step
        out = [
            torch.full((p.numel() + pad,), -0.0, dtype=p.dtype, device=p.device)
            if pad
            else torch.full_like(p, -0.0)
            for p, pad in zip(params, pads, strict=True)
        ]
    gs = [_fresh(g, pad) if pad else g for g, pad in zip(grads, pads, strict=True)]
    kernel(
        out,
        gs,
        mu,
        nu,
        nu_max,
        counts,
        lr=lr,
        beta1=o.b1.value,
        beta2=o.b2.value,
        weight_decay=o.weight_decay.value,
        eps=o.eps.value,
        amsgrad=o.amsgrad,
        maximize=o.maximize,
    )
    for k, pad in enumerate(pads):
        if pad:  # back to the leaf's shape: a view of the padded tensor's first elements
            n, shape = params[k].numel(), params[k].shape
            for ts in (mu, nu, nu_max, out) if o.amsgrad else (mu, nu, out):
                ts[k] = ts[k][:n].view(shape)
    if decays:
        updates_to_(out, params)
    return Moments(mu, nu, nu_max, counts), out


def _fresh(t: Tensor, pad: int) -> Tensor:
    """A copy of ``t``: flattened with ``pad`` zeros after it if ``pad``."""
    return torch.constant_pad_nd(t.view(-1), (0, pad)) if pad else t.clone()


def foreach_adam(
    params: list[Tensor],
    grads: list[Tensor],
    state: Moments,
    o: Options,
    *,
    in_place: bool,
    apply: bool | None = None,
) -> tuple[Moments, list[Tensor]]:
    """``torch.optim.Adam(foreach=True)``'s step, with any hyperparameter per member.

    The operations of torch's multi-tensor Adam (and, elementwise, of its for-loop
    Adam) in its order, with a per-member value as an ``[N, 1, ..., 1]`` view where
    torch has a Python float, and the bias corrections and step size computed in double
    precision as torch's are (see ``step_factors``). A kernel gives the same result for
    a float32 scalar and a float32 tensor holding it, so each member's arithmetic is
    torch.optim's, with one difference in place (below).

    Not ``in_place``: nothing is written; the new state is made of fresh tensors, and
    the updates are what ``params`` must add to become torch.optim's new parameters,
    computed as torch's float-hyperparameter path does (``(-step * m) / denom``). For
    AdamW with weight decay they are ``new - params``, which ``params + updates``
    gives back up to one rounding.

    ``in_place`` without ``apply`` (the in-place form of ``scale_by_adam``): the
    state is written, the new state is ``state`` itself, and the updates are
    computed as above, by the same operations: the pure and in-place forms agree
    bit for bit.

    ``apply`` (by default ``in_place``): ``params`` and the state are written, the
    new state is ``state`` itself and the updates returned are empty. The last step
    is the one torch.optim
    takes for tensor hyperparameters (``capturable=True``): ``m / (denom / -step)``,
    which needs no buffer for ``-step * m``; it differs from the other order by a
    rounding per step. Full-size temporaries: the gradient when ``maximize`` or L2
    weight decay change it (freed after the moments) and the denominator, as in
    ``torch.optim.Adam(foreach=True)``.
    """
    mu, nu, nu_max, counts = state
    if apply is None:
        apply = in_place
    if in_place:
        torch._foreach_add_(counts, 1.0)
    else:
        counts = list(torch._foreach_add(counts, 1.0))
    if o.maximize:
        grads = list(torch._foreach_neg(grads))
    base = params  # what the Adam step is added to
    decay = is_per_member(o.weight_decay) or o.weight_decay.value != 0
    if decay and o.decoupled:
        shrink = _shrink(o.lr, o.weight_decay, params)
        if apply:
            torch._foreach_mul_(params, shrink)
        else:
            base = list(torch._foreach_mul(params, shrink))
    elif decay:
        wd = per_leaf(o.weight_decay, params)
        if isinstance(wd, float):
            grads = list(torch._foreach_add(grads, params, alpha=wd))
        else:
            grads = list(torch._foreach_addcmul(grads, params, wd))
    weight = complement(o.b1, mu)
    if in_place:
        torch._foreach_lerp_(mu, grads, weight)
    else:
        mu = list(torch._foreach_lerp(mu, grads, weight))
    b2, rest = per_leaf(o.b2, nu), complement(o.b2, nu)
    if in_place:
        torch._foreach_mul_(nu, b2)
    else:
        nu = list(torch._foreach_mul(nu, b2))
    if isinstance(rest, float):
        torch._foreach_addcmul_(nu, grads, grads, rest)
    else:
        torch._foreach_addcmul_(nu, torch._foreach_mul(grads, rest), grads)
    del grads  # freed before the denominator is allocated, as torch.optim does
    if o.amsgrad:
        if in_place:
            torch._foreach_maximum_(nu_max, nu)
        else:
            nu_max = list(torch._foreach_maximum(nu_max, nu))
    denom = list(torch._foreach_sqrt(nu_max if o.amsgrad else nu))
    neg_step, bc2_sqrt = step_factors(o.lr, o.b1, o.b2, counts, params)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, per_leaf(o.eps, denom))
    new_state = Moments(mu, nu, nu_max, counts)
    if apply:
        # torch.optim's order for tensor hyperparameters (capturable=True): the step
        # size divides the denominator, then one addcdiv_; no second full-size buffer.
        torch._foreach_div_(denom, neg_step)
        torch._foreach_addcdiv_(params, mu, denom)
        return new_state, []
    # Its order for float ones: addcdiv_(m, denom, value=-step) is (-step * m) / denom + p.
    step = list(torch._foreach_mul(mu, neg_step))
    torch._foreach_div_(step, denom)
    if base is not params:
        torch._foreach_add_(step, base)
        updates_to_(step, params)
    return new_state, step
