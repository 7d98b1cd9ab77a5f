"""RMSprop as in ``torch.optim.RMSprop``, over pytrees of stacked ``[N, ...]`` parameters."""

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._hyper import (
    Hyper,
    PerMember,
    check_members,
    hyperparameter,
    is_per_member,
    one_minus,
)
from ._protocol import (
    GradientTransformation,
    PyTree,
    chain,
    check_like,
    flatten,
    leaves_like,
    scatter,
    state_leaves,
    trainable,
    updates_to_,
    with_traits,
)
from ._recipes import rebuildable
from ._sgd import _flag
from ._transforms import Schedule, checked_learning_rate, fold_learning_rate, learning_rate


class RMSpropState(NamedTuple):
    """The state of [`rmsprop`][funcensemble.optim.rmsprop]'s direction (its first entry).

    Each field is a pytree shaped like the parameters, holding ``None`` for leaves that
    are not floating point. The names are ``torch.optim.RMSprop``'s.

    Attributes:
        step: Per leaf, how many updates it has received (a 0-dim float32 tensor;
            ``[N]``, one per member, once members join an optimizer that has stepped).
        square_avg: The running average of the squared gradient.
        momentum_buffer: The momentum buffer; all None when ``momentum`` is the float 0.
        grad_avg: With ``centered``, the running average of the gradient; else all None.

    Example:
        >>> import torch, funcensemble as fe
        >>> state, _ = fe.optim.rmsprop(centered=True).init({"w": torch.zeros(4, 3)})
        >>> state.square_avg["w"].shape, state.momentum_buffer["w"], state.step["w"]
        (torch.Size([4, 3]), None, tensor(0.))
    """

    step: PyTree
    square_avg: PyTree
    momentum_buffer: PyTree
    grad_avg: PyTree


def _view(h: Hyper, like: Tensor) -> float | Tensor:
    """``h`` as a float, or as ``[N, 1, ..., 1]`` in ``like``'s dtype and device."""
    if not isinstance(h.value, Tensor):
        return h.value
    shape = [-1] + [1] * (like.dim() - 1)
    return h.value.to(device=like.device, dtype=like.dtype).reshape(shape)


def _rmsprop_direction(
    where: str,
    alpha: Hyper,
    eps: Hyper,
    weight_decay: Hyper,
    momentum: Hyper,
    centered: bool,
    maximize: bool,
) -> GradientTransformation:
    """torch.optim.RMSprop's step before the learning rate."""
    per_member = [h for h in (alpha, eps, weight_decay, momentum) if is_per_member(h)]
    buffered = is_per_member(momentum) or momentum.value != 0.0
    decays = is_per_member(weight_decay) or weight_decay.value != 0.0
    one_minus_alpha = one_minus(alpha)

    def init(params: PyTree) -> RMSpropState:
        leaves, spec = flatten(params)
        indices = trainable(leaves)
        for h in per_member:
            check_members(h, where, spec, leaves, indices)
        none = [None] * len(leaves)
        steps = [torch.zeros((), dtype=torch.float32, device=leaves[i].device) for i in indices]

        def zeros(keep: bool) -> PyTree:
            if not keep:
                return spec.unflatten(none)
            z = [torch.zeros_like(leaves[i], memory_format=torch.preserve_format) for i in indices]
            return spec.unflatten(scatter(none, indices, z))

        return RMSpropState(
            spec.unflatten(scatter(none, indices, steps)),
            zeros(True),
            zeros(buffered),
            zeros(centered),
        )

    def step(
        updates: PyTree,
        state: Any,
        params: PyTree,
        lr: tuple[str, Hyper] | None,
        *,
        apply: bool = False,
    ) -> tuple[PyTree, RMSpropState]:
        """The direction, or with ``lr`` (where it comes from, its value) folded in, the
        step torch.optim takes: ``param.addcdiv_(g, avg, value=-lr)`` rounds ``(-lr * g)
        / avg``; ``param.add_(buf, alpha=-lr)`` (one rounding where the kernel fuses the
        multiply and add) is done as such with ``apply`` (the parameters stepped in place,
        no updates returned), and otherwise returned as what it makes the parameters less
        the parameters (which adds back exactly while they are within a factor 2).
        """
        spec, steps, grads, fields, active = state_leaves(
            where, state, RMSpropState, updates, RMSpropState._fields[1:]
        )
        sq, bufs, gavg = fields["square_avg"], fields["momentum_buffer"], fields["grad_avg"]
        if not active:
            return spec.unflatten([None] * len(steps)), state
        check_like(where, "the update", spec, active, grads, sq, "state.square_avg")
        # A state made without momentum stepped by a [N] momentum of zeros: no member
        # has momentum, so it steps on without a buffer, as torch.optim.RMSprop does
        # (which reads a buffer only for a momentum above 0).
        moving = buffered and not (
            is_per_member(momentum)
            and all(bufs[i] is None for i in active)
            and not bool(momentum.value.ne(0).any())
        )
        if moving:
            check_like(where, "the update", spec, active, grads, bufs, "state.momentum_buffer")
        if centered:
            check_like(where, "the update", spec, active, grads, gavg, "state.grad_avg")
        ps: list[Any] = []
        if decays:
            if params is None:
                raise ValueError(
                    f"{where}: weight decay needs the parameters; call "
                    "update(grads, state, params)."
                )
            ps = leaves_like(where, "params", spec, params)
            check_like(where, "the update", spec, active, grads, ps)
        for h in per_member:
            check_members(h, where, spec, grads, active)
        if lr is not None:
            check_members(lr[1], lr[0], spec, grads, active)
            if params is not None and (moving or apply) and not decays:
                ps = leaves_like(where, "params", spec, params)
                check_like(where, "the update", spec, active, grads, ps)
        out = [None] * len(steps)
        new_steps, new_sq, new_bufs, new_gavg = list(steps), list(sq), list(bufs), list(gavg)
        with torch.no_grad():
            for i in active:
                g = -grads[i] if maximize else grads[i]
                if decays:
                    wd = _view(weight_decay, g)
                    g = g.add(ps[i], alpha=wd) if isinstance(wd, float) else g.addcmul(ps[i], wd)
                a, oma = _view(alpha, g), _view(one_minus_alpha, g)
                if isinstance(a, float):
                    s = sq[i].mul(a).addcmul_(g, g, value=oma)
                else:
                    # torch's addcmul(g, g, value=1 - alpha) multiplies (value * g) * g.
                    s = sq[i].mul(a).addcmul_(g * oma, g)
                new_sq[i] = s
                if centered:
                    ga = gavg[i].lerp(g, oma)
                    new_gavg[i] = ga
                    avg = s.addcmul(ga, ga, value=-1).sqrt_()
                else:
                    avg = s.sqrt()
                avg = avg.add_(_view(eps, g))
                neg = None if lr is None else -_view(lr[1], g)
                if not moving:
                    out[i] = _plain(g, avg, neg, ps[i] if apply else None)
                    new_steps[i] = steps[i] + 1
                    continue
                m = _view(momentum, g)
                b = bufs[i].mul(m).addcdiv_(g, avg)
                if isinstance(m, Tensor):
                    # A member with momentum 0 steps along g / avg, and torch.optim
                    # leaves its buffer as it was (its momentum may come back).
                    still = m == 0
                    moved = _plain(g, avg, neg, None)
                    if apply and neg is not None:
                        # The moving members' param.add_(buf, alpha=-lr), one rounding.
                        stepped = (
                            ps[i].addcmul(b, neg)
                            if isinstance(neg, Tensor)
                            else ps[i].add(b, alpha=neg)
                        )
                        ps[i].copy_(torch.where(still, ps[i] + moved, stepped))
                        out[i] = None
                    else:
                        out[i] = torch.where(still, moved, b if neg is None else b * neg)
                        if apply:
                            ps[i].add_(out[i])
                            out[i] = None
                    b = torch.where(still, bufs[i], b)
                elif neg is None:
                    out[i] = b
                elif apply:
                    _add_scaled_(ps[i], b, neg)
                else:
                    out[i] = _scaled(b, neg, ps[i] if ps else None)
                new_bufs[i] = b
                new_steps[i] = steps[i] + 1
        new_state = RMSpropState(
            spec.unflatten(new_steps),
            spec.unflatten(new_sq),
            spec.unflatten(new_bufs),
            spec.unflatten(new_gavg),
        )
        return spec.unflatten(out), new_state

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, RMSpropState]:
        return step(updates, state, params, None)

    def fold(rate: GradientTransformation) -> GradientTransformation | None:
        """This direction and the learning rate after it, as one exact step."""
        return fold_learning_rate(init, step, rate)

    # The in-place form is derived: the same arithmetic, the new state copied into the old.
    return with_traits(GradientTransformation(init, update), fold=fold)


def _plain(g: Tensor, avg: Tensor, neg: float | Tensor | None, param: Tensor | None) -> Any:
    """The step without momentum, ``g / avg`` (no rate) or torch.optim's ``(-lr * g) /
    avg``; added to ``param`` in place (returning None) where it is given."""
    if neg is None:
        return g / avg
    if param is None:
        return (g * neg) / avg
    if isinstance(neg, Tensor):
        param.add_((g * neg) / avg)
    else:
        param.addcdiv_(g, avg, value=neg)
    return None


def _add_scaled_(param: Tensor, buf: Tensor, neg: float | Tensor) -> None:
    """``param += -lr * buf`` as torch.optim does it, ``param.add_(buf, alpha=-lr)``."""
    if isinstance(neg, Tensor):
        param.addcmul_(buf, neg)  # (one rounding, as add_'s alpha: not buf * neg, then add)
    else:
        param.add_(buf, alpha=neg)


def _scaled(buf: Tensor, neg: float | Tensor, param: Tensor | None) -> Tensor:
    """The step ``-lr * buf`` as an update: given the parameter and a float rate, what
    ``param.add(buf, alpha=-lr)`` makes it less the parameter, which adds back exactly
    while the two are within a factor 2 (``buf * -lr`` alone rounds once more)."""
    if param is None or isinstance(neg, Tensor):
        return buf * neg
    return updates_to_([param.add(buf, alpha=neg)], [param])[0]


@rebuildable
def rmsprop(
    lr: float | PerMember | Schedule = 1e-2,
    alpha: float | PerMember = 0.99,
    eps: float | PerMember = 1e-8,
    weight_decay: float | PerMember = 0.0,
    momentum: float | PerMember = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """RMSprop, computing for each member what ``torch.optim.RMSprop`` computes for it alone.

    Per member and leaf, as ``torch.optim.RMSprop``: ``g = -grad`` if ``maximize``,
    then ``g += weight_decay * param``; ``square_avg = alpha * square_avg +
    (1 - alpha) * g * g``; with ``centered``, ``grad_avg`` is lerped towards ``g`` and
    ``avg = sqrt(square_avg - grad_avg**2) + eps``, else ``avg = sqrt(square_avg) +
    eps``; with momentum, ``buf = momentum * buf + g / avg`` and the step is
    ``-lr * buf``, else ``-lr * g / avg``.

    Any of ``lr``, ``alpha``, ``eps``, ``weight_decay`` and ``momentum`` may be a
    ``[N]`` tensor of per-member values; ``lr`` may also be a schedule ``lr(count)``.
    Leaves that are not floating point get no state and no update; a leaf whose
    gradient is None is skipped. With float hyperparameters, ``update_`` steps with
    torch.optim's own operations, bit for bit given the same gradients, and so does
    ``update`` without momentum (with it, exactly while a parameter stays within a factor
    2 of where it was); ``update_`` with a ``[N]`` ``lr`` and ``momentum`` steps bit for
    bit too (300 steps, float64 and float32), and the other ``[N]`` values are tested to
    1e-12 in float64.

    Args:
        lr: The learning rate: a float, a ``[N]`` tensor, or a schedule ``lr(count)``.
        alpha: Smoothing constant of the squared-gradient average.
        eps: Added to the denominator for numerical stability.
        weight_decay: L2 penalty added to the gradient.
        momentum: Momentum factor.
        centered: Normalize by an estimate of the gradient's variance.
        maximize: Maximize the objective instead of minimizing it.

    Returns:
        A [`GradientTransformation`][funcensemble.optim.GradientTransformation] whose
        state is ``(RMSpropState, lr state)``; see
        [`RMSpropState`][funcensemble.optim.RMSpropState].

    Raises:
        ValueError: A hyperparameter below 0 (``torch.optim``'s wording), or a
            per-member tensor not shaped ``[N]``.
        TypeError: A hyperparameter of the wrong type.

    Example:
        >>> import torch, funcensemble as fe
        >>> opt = fe.optim.rmsprop(lr=torch.tensor([0.01, 0.0]), alpha=0.0, eps=0.0)
        >>> params = {"w": torch.ones(2, 3)}
        >>> state = opt.update_({"w": torch.full((2, 3), 4.0)}, opt.init(params), params)
        >>> params["w"][:, 0]  # each step is -lr * g / |g|
        tensor([0.9900, 1.0000])
    """
    where = "rmsprop"
    lr_ = checked_learning_rate(where, lr)
    eps_ = hyperparameter(where, "eps", eps, label="epsilon value")
    m = hyperparameter(where, "momentum", momentum, label="momentum value")
    wd = hyperparameter(where, "weight_decay", weight_decay, label="weight_decay value")
    a = hyperparameter(where, "alpha", alpha, label="alpha value")
    centered = _flag(where, "centered", centered)
    maximize = _flag(where, "maximize", maximize)
    return chain(
        _rmsprop_direction(where, a, eps_, wd, m, centered, maximize),
        learning_rate(where, lr_),  # type: ignore[arg-type]
    )
