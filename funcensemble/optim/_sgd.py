"""SGD as in ``torch.optim.SGD``, over pytrees of stacked ``[N, ...]`` parameters."""

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._messages import boolean as _flag
from ._hyper import (
    Hyper,
    PerMember,
    check_members,
    hyper_map,
    hyperparameter,
    is_per_member,
    one_minus,
    per_leaf,
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
from ._transforms import Schedule, checked_learning_rate, fold_learning_rate, learning_rate


class SGDState(NamedTuple):
    """The state of [`sgd`][funcensemble.optim.sgd]'s direction (its first entry).

    Each field is a pytree shaped like the parameters, holding ``None`` for leaves that
    are not floating point, and for every leaf when ``momentum`` is the float 0.

    Attributes:
        count: Per leaf, how many momentum updates it has received (a 0-dim float32
            tensor on the leaf's device). At 0 the momentum buffer is not started yet:
            the first update sets it to the gradient itself, as ``torch.optim.SGD``
            does. A ``[N]`` tensor, one count per member, once members join an
            optimizer that has stepped ([`fe.optim.concat`][funcensemble.optim.concat])
            or once a per-member ``momentum`` holding 0 has stepped: a member whose
            momentum is 0 takes no momentum update, so its count and buffer stay (and
            a transform with momentum started later starts its buffer afresh, as
            torch.optim does when a group's momentum becomes non-zero).
        momentum_buffer: ``torch.optim.SGD``'s ``momentum_buffer``, like the parameters.

    Example:
        >>> import torch, funcensemble as fe
        >>> state, _ = fe.optim.sgd(lr=0.1, momentum=0.9).init({"w": torch.zeros(4, 3)})
        >>> state.count["w"], state.momentum_buffer["w"].shape
        (tensor(0.), torch.Size([4, 3]))
    """

    count: PyTree
    momentum_buffer: PyTree


def _sgd_direction(
    where: str,
    momentum: Hyper,
    dampening: Hyper,
    nesterov: bool,
    weight_decay: Hyper,
    maximize: bool,
) -> GradientTransformation:
    """torch.optim.SGD's step before the learning rate: sign, L2 decay, momentum."""
    per_member = [h for h in (momentum, dampening, weight_decay) if is_per_member(h)]
    buffered = is_per_member(momentum) or momentum.value != 0.0
    decays = is_per_member(weight_decay) or weight_decay.value != 0.0
    one_minus_d = one_minus(dampening)
    # A member with momentum 0 keeps no buffer in torch.optim: its direction is the
    # gradient itself (not (1 - dampening) * gradient, nor 0 * buffer + gradient).
    no_momentum = momentum.value == 0 if is_per_member(momentum) else None

    def init(params: PyTree) -> SGDState:
        leaves, spec = flatten(params)
        indices = trainable(leaves)
        for h in per_member:
            check_members(h, where, spec, leaves, indices)
        none = [None] * len(leaves)
        counts = [torch.zeros((), dtype=torch.float32, device=leaves[i].device) for i in indices]
        bufs = [torch.zeros_like(leaves[i], memory_format=torch.preserve_format) for i in indices]
        return SGDState(
            spec.unflatten(scatter(none, indices, counts)),
            spec.unflatten(scatter(none, indices, bufs) if buffered else none),
        )

    def step(
        updates: PyTree,
        state: Any,
        params: PyTree,
        lr: tuple[str, Hyper] | None,
        *,
        apply: bool = False,
    ) -> tuple[PyTree, SGDState]:
        """The direction, or with ``lr`` (where it comes from, its value) folded in, the
        step torch.optim takes (see ``_add_rate``): with ``apply``, added to the parameters in
        place, as torch.optim does, and no updates returned."""
        spec, counts, grads, fields, active = state_leaves(
            where, state, SGDState, updates, ("momentum_buffer",)
        )
        bufs = fields["momentum_buffer"]
        if not active:
            return (None if apply else spec.unflatten([None] * len(counts))), state
        if decays and params is None:
            raise ValueError(
                f"{where}: weight decay needs the parameters; call update(grads, state, params)."
            )
        ps: list[Any] | None = None
        if (decays or lr is not None) and (params is not None or apply):
            ps_all = leaves_like(where, "params", spec, params)
            check_like(where, "the update", spec, active, grads, ps_all)
            ps = [ps_all[i] for i in active]
        unstarted = set()  # leaves whose state holds no buffer: from momentum the float 0
        if buffered:
            for i in active:
                if bufs[i] is None:  # a transform with momentum after one without
                    unstarted.add(i)
                    bufs = [*bufs[:i], torch.zeros_like(grads[i]), *bufs[i + 1 :]]
            check_like(where, "the update", spec, active, grads, bufs, "state.momentum_buffer")
        for h in per_member:
            check_members(h, where, spec, grads, active)
        if lr is not None:
            check_members(lr[1], lr[0], spec, grads, active)
        gs = [grads[i] for i in active]
        with torch.no_grad():
            d = list(torch._foreach_neg(gs)) if maximize else gs
            if ps is not None and decays:
                wd = per_leaf(weight_decay, ps)
                if isinstance(wd, float):
                    d = list(torch._foreach_add(d, ps, alpha=wd))
                else:
                    d = list(torch._foreach_addcmul(d, ps, wd))
            if not buffered:
                # No momentum update: every count stays, so a member whose buffer never
                # started still starts it afresh under a transform with momentum later.
                direction, new_state = d, SGDState(state.count, state.momentum_buffer)
            else:
                direction, new_counts, new_bufs = momentum_step(
                    d, [counts[i] for i in active], [bufs[i] for i in active], active, unstarted
                )
                new_state = SGDState(
                    spec.unflatten(scatter(counts, active, new_counts)),
                    spec.unflatten(scatter(bufs, active, new_bufs)),
                )
            out = direction if lr is None else _add_rate(direction, lr[1], ps, apply=apply)
        if apply:
            return None, new_state
        return spec.unflatten(scatter([None] * len(counts), active, out)), new_state

    def momentum_step(
        d: list[Tensor],
        counts: list[Tensor],
        old: list[Tensor],
        active: list[int],
        unstarted: set[int],
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """torch.optim.SGD's momentum: the direction, the new counts and buffers."""
        if no_momentum is not None and bool(no_momentum.any()):
            # Members with momentum 0 take no momentum update: their buffer stays as
            # it was (unstarted, or as their last momentum left it), and so does
            # their count, one per member from here on (torch.optim keeps no buffer
            # for them and starts one afresh when their momentum becomes non-zero).
            new_counts = [c + (~no_momentum).to(c.device, c.dtype) for c in counts]
        else:
            new_counts = [c + 1 for c in counts]
        m = per_leaf(momentum, d)
        od = per_leaf(one_minus_d, d)
        blend = list(torch._foreach_mul(old, m))
        if isinstance(od, float):
            blend = list(torch._foreach_add(blend, d, alpha=od))
        else:
            blend = list(torch._foreach_addcmul(blend, d, od))
        new_bufs = []
        still = []  # per leaf, the [N, 1, ...] mask of members with momentum 0, or None
        for k, i in enumerate(active):
            shape = [-1] + [1] * (d[k].dim() - 1)
            # The count is 0-dim, or [N] once members with their own counts joined.
            fresh = (counts[k] == 0).reshape(shape) if counts[k].dim() else counts[k] == 0
            if i in unstarted:
                fresh = torch.ones_like(fresh)
            buf = torch.where(fresh, d[k], blend[k])
            if no_momentum is not None:
                still.append(no_momentum.to(d[k].device).reshape(shape))
                buf = torch.where(still[-1], old[k], buf)
            new_bufs.append(buf)
        if nesterov:
            if isinstance(m, float):
                direction = list(torch._foreach_add(d, new_bufs, alpha=m))
            else:
                direction = list(torch._foreach_addcmul(d, new_bufs, m))
        else:
            direction = new_bufs
        if still:  # a member with momentum 0 steps along its gradient itself
            direction = [
                torch.where(z, dk, x) for z, dk, x in zip(still, d, direction, strict=True)
            ]
        return direction, new_counts, new_bufs

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, SGDState]:
        return step(updates, state, params, None)

    def fold(rate: GradientTransformation) -> GradientTransformation | None:
        """This direction and the learning rate after it, as torch.optim's one step."""
        return fold_learning_rate(init, step, rate)

    # The in-place form is derived: the same arithmetic, the new state copied into the old.
    return with_traits(GradientTransformation(init, update), fold=fold)


def _add_rate(
    direction: list[Tensor], lr: Hyper, params: list[Tensor] | None, *, apply: bool
) -> list[Tensor]:
    """torch.optim's ``param.add_(direction, alpha=-lr)``: one rounding (on the CPU,
    ``addcmul`` by a ``[N, 1, ...]`` view of per-member rates rounds alike). With
    ``apply``, done so in place (returning nothing); otherwise returned as what it
    makes the parameters less the parameters, which adds back exactly while the two are
    within a factor 2, or without the parameters as ``direction * -lr`` (a rounding more).
    """
    neg = per_leaf(hyper_map(lr, lambda v: -v), direction)
    if params is None:
        return list(torch._foreach_mul(direction, neg))
    if apply:
        if isinstance(neg, float):
            torch._foreach_add_(params, direction, alpha=neg)
        else:
            torch._foreach_addcmul_(params, direction, neg)
        return []
    if isinstance(neg, float):
        new = torch._foreach_add(params, direction, alpha=neg)
    else:
        new = torch._foreach_addcmul(params, direction, neg)
    return updates_to_(list(new), params)


@rebuildable
def sgd(
    lr: float | PerMember | Schedule = 1e-3,
    momentum: float | PerMember = 0.0,
    dampening: float | PerMember = 0.0,
    weight_decay: float | PerMember = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """SGD, computing for each member what ``torch.optim.SGD`` computes for it alone.

    Per member and leaf, as ``torch.optim.SGD``: ``g = -grad`` if ``maximize``, then
    ``g += weight_decay * param``; with momentum, the buffer starts as ``g`` itself on
    a leaf's first update and is ``momentum * buf + (1 - dampening) * g`` after; the
    direction is ``g + momentum * buf`` (``nesterov``) or ``buf``; the step is
    ``param -= lr * direction``. A member whose momentum is 0 (in a per-member
    tensor) keeps no momentum, as torch.optim does for it.

    Any of ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` may be a ``[N]``
    tensor of per-member values; ``lr`` may also be a schedule ``lr(count)`` (see
    [`scale_by_learning_rate`][funcensemble.optim.scale_by_learning_rate]). Leaves
    that are not floating point get no state and no update; a leaf whose gradient is
    None is skipped, as ``torch.optim`` skips a parameter whose ``.grad`` is None.

    The step runs torch.optim's own operations in its order, the learning rate folded
    into the last one, ``param.add_(direction, alpha=-lr)`` (a per-member ``lr``, by
    ``addcmul_``, which rounds alike on the CPU). Given the same gradients, ``update_``
    (and [`EnsembleOptimizer`][funcensemble.optim.EnsembleOptimizer]) steps each
    member bit for bit as ``torch.optim.SGD`` steps it alone, with floats, ``[N]``
    tensors or a schedule's values (tested on the CPU over 300 steps, float32 and
    float64). ``update`` given the parameters returns what that step makes them less
    the parameters, which ``apply_updates`` adds back exactly wherever a step keeps a
    parameter within a factor 2 of where it was (or infinite, where it stays so);
    elsewhere (near zero) the sum may be
    an ulp of the larger of the two values off, and without the parameters the updates
    are ``direction * -lr``, one rounding more than torch.optim.

    Args:
        lr: The learning rate: a float, a ``[N]`` tensor, or a schedule ``lr(count)``.
        momentum: Momentum factor.
        dampening: Dampening for momentum.
        weight_decay: L2 penalty added to the gradient (after the sign flip of
            ``maximize``).
        nesterov: Use Nesterov momentum (needs ``momentum > 0`` and ``dampening`` 0
            for every member).
        maximize: Maximize the objective instead of minimizing it.

    Returns:
        A [`GradientTransformation`][funcensemble.optim.GradientTransformation] whose
        state is the pair ``(SGDState, lr state)``: the
        [`SGDState`][funcensemble.optim.SGDState], then an
        [`EmptyState`][funcensemble.optim.EmptyState] for a constant ``lr`` or a
        [`ScheduleState`][funcensemble.optim.ScheduleState] for a schedule. The
        layout is the same whatever the values; with ``momentum`` the float 0 the
        buffers are None.

    Raises:
        ValueError: A hyperparameter out of range (``torch.optim``'s wording), a
            per-member tensor not shaped ``[N]``, or ``nesterov`` without momentum or
            with dampening.
        TypeError: A hyperparameter of the wrong type.

    Example:
        >>> import torch, funcensemble as fe
        >>> opt = fe.optim.sgd(lr=torch.tensor([0.1, 0.2]), momentum=0.9)  # per member
        >>> params = {"w": torch.ones(2, 3)}
        >>> state = opt.init(params)
        >>> for _ in range(2):
        ...     state = opt.update_({"w": torch.ones(2, 3)}, state, params)
        >>> params["w"][:, 0]  # buffers 1, then 0.9 * 1 + 1 = 1.9
        tensor([0.7100, 0.4200])
    """
    where = "sgd"
    lr_ = checked_learning_rate(where, lr)
    m = hyperparameter(where, "momentum", momentum, label="momentum value")
    d = hyperparameter(where, "dampening", dampening, label="dampening value")
    wd = hyperparameter(where, "weight_decay", weight_decay, label="weight_decay value")
    nesterov = _flag(where, "nesterov", nesterov)
    maximize = _flag(where, "maximize", maximize)
    if nesterov:
        m_pos = bool((m.value > 0).all()) if is_per_member(m) else m.value > 0
        d_zero = bool((d.value == 0).all()) if is_per_member(d) else d.value == 0
        if not (m_pos and d_zero):
            raise ValueError(
                f"{where}: Nesterov momentum requires a momentum and zero dampening (expected "
                f"momentum > 0 and dampening 0 for every member, got momentum {m.value} and "
                f"dampening {d.value}). Pass nesterov=False or set them."
            )
    return chain(
        _sgd_direction(where, m, d, nesterov, wd, maximize),
        learning_rate(where, lr_),  # type: ignore[arg-type]
    )
