"""Small gradient transforms: weight decay, learning-rate scaling (with schedules), sign flip."""

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from jaxtyping import Int
from torch import Tensor

from ._hyper import (
    Hyper,
    PerMember,
    check_members,
    hyper_map,
    hyperparameter,
    per_leaf,
    schedule_value,
)
from ._protocol import (
    EmptyState,
    GradientTransformation,
    PyTree,
    check_like,
    check_state_type,
    check_tensors,
    flatten,
    leaves_like,
    not_the_chains_state,
    refill,
    refuse_integer_updates,
    scatter,
    trainable,
    traits,
    with_traits,
)
from ._recipes import rebuildable

Schedule = Callable[[Int[Tensor, ""]], Any]


class ScheduleState(NamedTuple):
    """The state of a scheduled learning rate.

    Attributes:
        count: How many times ``update`` has run (a 0-dim int64 CPU tensor); the
            schedule is called with it.

    Example:
        >>> import torch, funcensemble as fe
        >>> opt = fe.optim.adam(lr=lambda count: 1e-3 * 0.9 ** count.double())
        >>> opt.init({"w": torch.zeros(2, 3)})[-1]
        ScheduleState(count=tensor(0))
    """

    count: Int[Tensor, ""]


def _float_updates(where: str, updates: PyTree) -> tuple[list[Any], optree.PyTreeSpec, list[int]]:
    """The update leaves, their structure, and the indices of the floating-point ones."""
    leaves, spec = flatten(updates)
    check_tensors(where, "the update", spec, leaves)
    return leaves, spec, trainable(leaves)


def _only(spec: optree.PyTreeSpec, size: int, active: list[int], new: list[Tensor]) -> PyTree:
    """A tree with ``new`` at the ``active`` leaves and None everywhere else."""
    return spec.unflatten(scatter([None] * size, active, new))


def flip_sign(where: str) -> GradientTransformation:
    """Negate the updates (how ``maximize=True`` turns ascent into descent)."""

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        leaves, spec, active = _float_updates(where, updates)
        with torch.no_grad():
            new = list(torch._foreach_neg([leaves[i] for i in active])) if active else []
        return _only(spec, len(leaves), active, new), state

    # Stateless, and `update` writes none of its inputs: it is its own in-place form.
    return GradientTransformation(init, update, update)


def decayed_weights(where: str, weight_decay: Hyper) -> GradientTransformation:
    """``add_decayed_weights`` from an already validated hyperparameter."""

    def init(params: PyTree) -> EmptyState:
        leaves, spec = flatten(params)
        check_members(weight_decay, where, spec, leaves, trainable(leaves))
        return EmptyState()

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        if params is None:
            raise ValueError(
                f"{where}: weight decay needs the parameters; call update(grads, state, params)."
            )
        leaves, spec = flatten(params)
        ups = leaves_like(where, "updates", spec, updates)
        check_tensors(where, "the update", spec, ups)
        refuse_integer_updates(where, "the update", spec, ups, leaves)
        floats = set(trainable(leaves))
        active = [i for i in trainable(ups) if i in floats]
        check_like(where, "the update", spec, active, ups, leaves)
        check_members(weight_decay, where, spec, leaves, active)
        out = [None] * len(leaves)
        if active:
            us, ps = [ups[i] for i in active], [leaves[i] for i in active]
            with torch.no_grad():
                wd = per_leaf(weight_decay, ps)
                if isinstance(wd, float):
                    new = torch._foreach_add(us, ps, alpha=wd)
                else:
                    new = torch._foreach_addcmul(us, ps, wd)
            out = scatter(out, active, new)
        return spec.unflatten(out), state

    return GradientTransformation(init, update, update)


@rebuildable
def add_decayed_weights(weight_decay: float | PerMember = 0.0) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (L2 regularization, or AdamW's decay).

    Args:
        weight_decay: The decay rate, one float or a ``[N]`` tensor of per-member rates.

    Raises:
        ValueError: A negative rate, or a per-member tensor not shaped ``[N]``.

    Example:
        >>> import torch, funcensemble as fe
        >>> decay = fe.optim.add_decayed_weights(torch.tensor([0.0, 1.0]))  # per member
        >>> params = {"w": torch.ones(2, 3)}
        >>> updates, _ = decay.update({"w": torch.zeros(2, 3)}, decay.init(params), params)
        >>> updates["w"][:, 0].tolist()
        [0.0, 1.0]
    """
    where = "add_decayed_weights"
    wd = hyperparameter(where, "weight_decay", weight_decay, label="weight_decay value")
    return decayed_weights(where, wd)


def checked_learning_rate(where: str, lr: Any) -> Hyper | Schedule:
    """``lr`` as the aliases take it: a schedule as given, anything else validated."""
    if callable(lr) and not isinstance(lr, Tensor):
        return lr
    return hyperparameter(where, "lr", lr, label="learning rate", schedule_ok=True)


def learning_rate(where: str, lr: Hyper | Schedule) -> GradientTransformation:
    """``scale_by_learning_rate`` from an already validated value or schedule."""

    def scale(updates: PyTree, value: Hyper) -> PyTree:
        leaves, spec, active = _float_updates(where, updates)
        check_members(value, where, spec, leaves, active)
        if not active:
            return _only(spec, len(leaves), active, [])
        us = [leaves[i] for i in active]
        with torch.no_grad():
            new = list(torch._foreach_mul(us, per_leaf(hyper_map(value, lambda v: -v), us)))
        return _only(spec, len(leaves), active, new)

    if isinstance(lr, Hyper):
        constant = lr

        def init(params: PyTree) -> EmptyState:
            leaves, spec = flatten(params)
            check_members(constant, where, spec, leaves, trainable(leaves))
            return EmptyState()

        def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
            return scale(updates, constant), state

        # Adam folds a learning rate that follows it into its own step (see chain).
        return with_traits(
            GradientTransformation(init, update, update), learning_rate=(where, constant)
        )

    schedule = lr

    def init_schedule(params: PyTree) -> ScheduleState:
        return ScheduleState(torch.zeros((), dtype=torch.int64))

    def scheduled(updates: PyTree, state: ScheduleState) -> PyTree:
        check_state_type(where, state, ScheduleState)
        return scale(updates, schedule_value(where, "lr", schedule(state.count)))

    def update_schedule(
        updates: PyTree, state: ScheduleState, params: PyTree = None
    ) -> tuple[PyTree, ScheduleState]:
        return scheduled(updates, state), ScheduleState(state.count + 1)

    def update_schedule_(
        updates: PyTree, state: ScheduleState, params: PyTree = None
    ) -> tuple[PyTree, ScheduleState]:
        out = scheduled(updates, state)  # checked and computed before the count moves
        state.count.add_(1)
        return out, state

    out = GradientTransformation(init_schedule, update_schedule, update_schedule_)
    return with_traits(out, learning_rate=(where, schedule))


# A direction's step, given the rate: step(updates, state, params, (where, lr) or None,
# apply=...) -> (updates, new state), the parameters stepped in place with apply=True.
Step = Callable[..., tuple[PyTree, Any]]


def fold_learning_rate(
    init: Callable[[PyTree], Any], step: Step, rate: GradientTransformation
) -> GradientTransformation | None:
    """A direction and the learning rate ``rate`` after it as one step (see ``chain``),
    which takes the rate into torch.optim's own operations (SGD, RMSprop); None where
    ``rate`` is not a learning rate. Its state is the pair (direction's, rate's).
    """
    found = traits(rate).learning_rate
    if found is None:
        return None
    lr_where, lr = found
    constant = isinstance(lr, Hyper)

    def value(state: Any) -> tuple[str, Hyper]:
        """The pair's state checked, and the rate of this step (a schedule's value)."""
        if not isinstance(state, tuple) or len(state) != 2:
            raise ValueError(not_the_chains_state(state, 2))
        if constant:
            return lr_where, lr
        check_state_type(lr_where, state[1], ScheduleState)
        return lr_where, schedule_value(lr_where, "lr", lr(state[1].count))

    def pair_init(params: PyTree) -> tuple[Any, Any]:
        return init(params), rate.init(params)

    def pair_update(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        lr_ = value(state)
        out, new = step(grads, state[0], params, lr_)
        return out, (new, state[1] if constant else ScheduleState(state[1].count + 1))

    def pair_update_(grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, Any]:
        """In place, as torch.optim steps: the parameters too (checks first)."""
        lr_ = value(state)
        _, new = step(grads, state[0], params, lr_, apply=True)
        if not constant:
            state[1].count.add_(1)
        return None, (refill(state[0], new), state[1])

    out = GradientTransformation(pair_init, pair_update, pair_update_)
    return with_traits(out, applies=True)


@rebuildable
def scale_by_learning_rate(lr: float | PerMember | Schedule = 1e-3) -> GradientTransformation:
    """Multiply the updates by ``-lr``, turning a descent direction into a step.

    Args:
        lr: The learning rate: one float, a ``[N]`` tensor of per-member rates, or a
            schedule ``lr(count) -> float | Tensor`` called with the number of
            previous ``update`` calls (a 0-dim int64 tensor: 0, 1, 2, ...), like a
            ``torch.optim.lr_scheduler.LambdaLR`` stepped once per iteration. The
            count advances on every call, even one where every gradient is None.
            ``0.9 ** count`` is float32 (an int64 tensor promotes to torch's default
            dtype): ``0.9 ** count.double()`` computes what ``LambdaLR`` does.
            A schedule may return a float, a 0-dim tensor or a ``[N]`` tensor; its
            values are not range-checked (that would sync the device every step).

    Raises:
        ValueError: A negative rate, or a per-member tensor not shaped ``[N]``.

    Example:
        >>> import torch, funcensemble as fe
        >>> sched = fe.optim.scale_by_learning_rate(lambda count: 0.5**count)
        >>> params = {"w": torch.zeros(2, 3)}
        >>> state = sched.init(params)
        >>> for _ in range(3):
        ...     updates, state = sched.update({"w": torch.ones(2, 3)}, state, params)
        >>> updates["w"][0, 0].item(), state.count.item()
        (-0.25, 3)
    """
    where = "scale_by_learning_rate"
    if callable(lr) and not isinstance(lr, Tensor):
        return learning_rate(where, lr)
    return learning_rate(
        where, hyperparameter(where, "lr", lr, label="learning rate", schedule_ok=True)
    )
