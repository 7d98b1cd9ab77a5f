"""Learning-rate schedules (warm-up, cosine decay), each setting one number or one per member."""

import math
import numbers
from collections.abc import Callable

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._hyper import hyperparameter
from ._recipes import rebuildable

# What a schedule is called with: the number of previous updates (ScheduleState.count).
Count = Int[Tensor, ""] | int
LearningRate = Float[Tensor, ""] | Float[Tensor, " member"]
Steps = int | np.integer | Int[Tensor, " member"]
PerMember = float | Float[Tensor, " member"]


def _steps(where: str, name: str, value: object, minimum: int) -> float | Tensor:
    """A step count (``>= minimum``): an int, or a 1-D integer tensor with one per member."""
    if isinstance(value, Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(
                f"{where}: {name} as a tensor must hold integers (one per member), got dtype "
                f"{value.dtype}. Build it with torch.tensor([...]) of ints."
            )
        if value.dim() != 1 or value.numel() == 0:
            raise ValueError(
                f"{where}: {name} as a tensor must be 1-D with one value per member "
                f"(expected shape [N], got {tuple(value.shape)}). Pass one value per member "
                "in member order, or an int shared by all members."
            )
        bad = value < minimum
        if bool(bad.any()):
            member = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{where}: {name} must be >= {minimum} for every member, got "
                f"{int(value[member])} for member {member}."
            )
        return value.detach().to(torch.float64)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)  # a NumPy integer (len(loader) * epochs), as torch's take it
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{where}: {name} must be an int or a 1-D integer tensor of per-member values "
            f"(expected one of those, got {type(value).__name__}). Pass {name} as an int."
        )
    if value < minimum:
        raise ValueError(
            f"{where}: {name} must be >= {minimum} (expected {minimum} or more, got {value}). "
            f"Pass {name} >= {minimum}."
        )
    return float(value)


def _rate(where: str, name: str, value: object, *, upper: float | None = None) -> float | Tensor:
    label = f"{name} value"
    h = hyperparameter(where, name, value, label=label, upper=upper, upper_closed=True)
    return h.value.to(torch.float64) if isinstance(h.value, Tensor) else h.value


def _common(where: str, named: dict[str, float | Tensor]) -> dict[str, Tensor]:
    """Every value as a float64 tensor on one device, per-member ones checked for one N."""
    tensors = {k: v for k, v in named.items() if isinstance(v, Tensor)}
    sizes = {k: v.shape[0] for k, v in tensors.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k} has {n}" for k, n in sizes.items())
        raise ValueError(
            f"{where}: the per-member arguments disagree on the number of members ({listed}). "
            "Give every per-member tensor one value per member."
        )
    devices = {v.device for v in tensors.values()}
    if len(devices) > 1:
        raise ValueError(
            f"{where}: the per-member arguments lie on different devices "
            f"({sorted(map(str, devices))}); put them on one device."
        )
    device = devices.pop() if devices else torch.device("cpu")
    return {
        k: v if isinstance(v, Tensor) else torch.tensor(v, dtype=torch.float64, device=device)
        for k, v in named.items()
    }


def _count(where: str, count: object, device: torch.device) -> Tensor:
    if isinstance(count, Tensor) and count.dim() == 0 and not count.is_floating_point():
        return count.to(device=device, dtype=torch.float64)
    if isinstance(count, int) and not isinstance(count, bool):
        return torch.tensor(float(count), dtype=torch.float64, device=device)
    raise TypeError(
        f"{where}: a schedule is called with the step count (expected an int or a 0-dim "
        f"integer tensor such as ScheduleState.count, got {count!r}). Call it with the "
        "step number."
    )


def _warmup(t: Tensor, peak: Tensor, steps: Tensor, start: Tensor) -> Tensor:
    # torch.optim.lr_scheduler.LinearLR's factor, start + (1 - start) * t / steps, and
    # exactly 1 from `steps` on (also for steps = 0: no warm-up).
    fraction = torch.minimum(t, steps) / steps.clamp(min=1)
    factor = torch.where(t >= steps, 1.0, start + (1 - start) * fraction)
    return peak * factor


def _cosine(t: Tensor, peak: Tensor, steps: Tensor, floor: Tensor) -> Tensor:
    # CosineAnnealingLR's closed form over its first half period, then held at the floor.
    phase = torch.minimum(t, steps) / steps
    return floor + (peak - floor) * (1 + torch.cos(math.pi * phase)) / 2


@rebuildable
def linear_warmup(
    peak_lr: PerMember, warmup_steps: Steps, *, start_factor: PerMember = 0.0
) -> Callable[[Count], LearningRate]:
    """A learning rate that rises linearly to ``peak_lr`` over ``warmup_steps``, then stays.

    At step ``t`` (the number of previous updates) the rate is
    ``peak_lr * (start_factor + (1 - start_factor) * t / warmup_steps)`` up to
    ``warmup_steps`` and ``peak_lr`` from there on, what ``torch.optim.lr_scheduler.LinearLR(
    opt, start_factor, total_iters=warmup_steps)`` gives an optimizer with ``lr=peak_lr``
    when stepped once per update (``LinearLR`` takes ``start_factor > 0`` only; the
    default 0 here starts the warm-up from a rate of 0). One difference: here
    ``warmup_steps=0`` means no warm-up, ``peak_lr`` from the first update on, where
    ``LinearLR(total_iters=0)`` holds ``start_factor * lr`` for good (its factor never
    reaches 1); in torch, leave ``LinearLR`` out for no warm-up. Each argument may be
    one number for all members or a ``[N]`` tensor, one per member. Pass the schedule
    as the ``lr`` of ``fe.optim.adam``, ``adamw``, ``sgd``, ``rmsprop`` or
    ``scale_by_learning_rate``.

    Args:
        peak_lr: The rate reached at the end of the warm-up, ``>= 0``.
        warmup_steps: The warm-up's length in updates, ``>= 0`` (ints).
        start_factor: The first step's fraction of ``peak_lr``, in ``[0, 1]``.

    Returns:
        ``schedule(count)``: a 0-dim tensor if every argument is a number, else ``[N]``
        (float64, on the per-member tensors' device).

    Raises:
        TypeError: An argument of the wrong type (a float step count, say).
        ValueError: A value out of range, or per-member tensors of different lengths.

    Example:
        >>> import torch, funcensemble as fe
        >>> sched = fe.optim.linear_warmup(torch.tensor([1.0, 2.0]), torch.tensor([2, 4]))
        >>> [sched(t).tolist() for t in range(3)]
        [[0.0, 0.0], [0.5, 0.5], [1.0, 1.0]]
        >>> opt = fe.optim.adam(lr=sched)  # per-member warm-up
    """
    where = "linear_warmup"
    values = _common(
        where,
        {
            "peak_lr": _rate(where, "peak_lr", peak_lr),
            "warmup_steps": _steps(where, "warmup_steps", warmup_steps, 0),
            "start_factor": _rate(where, "start_factor", start_factor, upper=1.0),
        },
    )
    peak, steps, start = values["peak_lr"], values["warmup_steps"], values["start_factor"]

    def schedule(count: Count) -> LearningRate:
        return _warmup(_count(where, count, peak.device), peak, steps, start)

    return schedule


@rebuildable
def cosine_decay(
    peak_lr: PerMember, decay_steps: Steps, *, min_lr: PerMember = 0.0
) -> Callable[[Count], LearningRate]:
    """A learning rate that falls from ``peak_lr`` to ``min_lr`` along a half cosine.

    At step ``t`` the rate is ``min_lr + (peak_lr - min_lr) * (1 + cos(pi * t /
    decay_steps)) / 2`` up to ``decay_steps``, and ``min_lr`` after (where
    ``torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=decay_steps,
    eta_min=min_lr)`` would rise again): what that scheduler gives an optimizer with
    ``lr=peak_lr``, stepped once per update, for the first ``decay_steps`` steps. Each
    argument may be one number for all members or a ``[N]`` tensor, one per member.

    Args:
        peak_lr: The first step's rate, ``>= 0``.
        decay_steps: The decay's length in updates, ``>= 1`` (ints).
        min_lr: The final rate, ``>= 0``.

    Returns:
        ``schedule(count)``: a 0-dim tensor if every argument is a number, else ``[N]``.

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: A value out of range, or per-member tensors of different lengths.

    Example:
        >>> import torch, funcensemble as fe
        >>> sched = fe.optim.cosine_decay(torch.tensor([1.0, 0.5]), 10)
        >>> sched(0).tolist(), sched(5).tolist(), sched(10).tolist(), sched(99).tolist()
        ([1.0, 0.5], [0.5, 0.25], [0.0, 0.0], [0.0, 0.0])
    """
    where = "cosine_decay"
    values = _common(
        where,
        {
            "peak_lr": _rate(where, "peak_lr", peak_lr),
            "decay_steps": _steps(where, "decay_steps", decay_steps, 1),
            "min_lr": _rate(where, "min_lr", min_lr),
        },
    )
    peak, steps, floor = values["peak_lr"], values["decay_steps"], values["min_lr"]

    def schedule(count: Count) -> LearningRate:
        return _cosine(_count(where, count, peak.device), peak, steps, floor)

    return schedule


@rebuildable
def warmup_cosine(
    peak_lr: PerMember,
    warmup_steps: Steps,
    total_steps: Steps,
    *,
    start_factor: PerMember = 0.0,
    min_lr: PerMember = 0.0,
) -> Callable[[Count], LearningRate]:
    """Linear warm-up to ``peak_lr``, then cosine decay to ``min_lr`` at ``total_steps``.

    [`linear_warmup`][funcensemble.optim.linear_warmup] for the first ``warmup_steps``
    updates, then [`cosine_decay`][funcensemble.optim.cosine_decay] over the remaining
    ``total_steps - warmup_steps``, then ``min_lr``: what
    ``SequentialLR(opt, [LinearLR(opt, start_factor, total_iters=warmup_steps),
    CosineAnnealingLR(opt, T_max=total_steps - warmup_steps, eta_min=min_lr)],
    milestones=[warmup_steps])`` gives an optimizer with ``lr=peak_lr`` stepped once
    per update, up to ``total_steps``. Each argument may be one number for all members
    or a ``[N]`` tensor, one per member.

    Args:
        peak_lr: The rate at the end of the warm-up, ``>= 0``.
        warmup_steps: The warm-up's length in updates, ``>= 0`` (ints).
        total_steps: Warm-up plus decay, ``> warmup_steps`` for every member (ints).
        start_factor: The first step's fraction of ``peak_lr``, in ``[0, 1]``.
        min_lr: The final rate, ``>= 0``.

    Returns:
        ``schedule(count)``: a 0-dim tensor if every argument is a number, else ``[N]``.

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: A value out of range, ``total_steps <= warmup_steps`` for some
            member, or per-member tensors of different lengths.

    Example:
        >>> import torch, funcensemble as fe
        >>> sched = fe.optim.warmup_cosine(1.0, warmup_steps=torch.tensor([2, 4]), total_steps=12)
        >>> [round(v, 3) for v in sched(2).tolist()], sched(12).tolist()
        ([1.0, 0.5], [0.0, 0.0])
    """
    where = "warmup_cosine"
    values = _common(
        where,
        {
            "peak_lr": _rate(where, "peak_lr", peak_lr),
            "warmup_steps": _steps(where, "warmup_steps", warmup_steps, 0),
            "total_steps": _steps(where, "total_steps", total_steps, 1),
            "start_factor": _rate(where, "start_factor", start_factor, upper=1.0),
            "min_lr": _rate(where, "min_lr", min_lr),
        },
    )
    peak, warm, total = values["peak_lr"], values["warmup_steps"], values["total_steps"]
    start, floor = values["start_factor"], values["min_lr"]
    total_each, warm_each = (v.reshape(-1) for v in torch.broadcast_tensors(total, warm))
    short = (total_each <= warm_each).nonzero()
    if short.numel():
        k = int(short[0, 0])
        member = f" for member {k}" if total.dim() or warm.dim() else ""
        raise ValueError(
            f"{where}: total_steps must exceed warmup_steps{member}, got total_steps "
            f"{int(total_each[k])} and warmup_steps {int(warm_each[k])}. total_steps counts "
            "the warm-up and the decay; for a warm-up alone use linear_warmup."
        )
    decay = total - warm

    def schedule(count: Count) -> LearningRate:
        t = _count(where, count, peak.device)
        rising = _warmup(t, peak, warm, start)
        falling = _cosine((t - warm).clamp(min=0), peak, decay, floor)
        return torch.where(t < warm, rising, falling)

    return schedule
