"""Hyperparameters that are one number for all members or a ``[N]`` tensor, one per member."""

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from jaxtyping import Float
from torch import Tensor

from ._protocol import check_one_member_axis, leaf_name

Number = float | int
# One value per member; a 0-dim tensor is accepted too, as one value shared by all.
PerMember = Float[Tensor, "member"] | Float[Tensor, ""]


class Hyper(NamedTuple):
    """A validated hyperparameter: a Python float, or a ``[N]`` tensor of per-member values.

    (A schedule may also give a 0-dim tensor, shared by all members.) Per-member
    values broadcast over each leaf's leading member axis: for a leaf of
    shape ``[N, d1, ..., dk]`` the tensor is viewed as ``[N, 1, ..., 1]``.
    A NamedTuple, so that ``torch.compile`` can build one while tracing a schedule.
    """

    name: str
    value: float | Tensor


def is_per_member(h: Hyper) -> bool:
    """Whether ``h`` holds a tensor (one value per member) rather than a float."""
    return isinstance(h.value, Tensor)


def hyper_map(h: Hyper, fn: Callable[[Any], Any]) -> Hyper:
    """The hyperparameter transformed value-wise, e.g. ``1 - beta``."""
    return Hyper(h.name, fn(h.value))


def check_members(
    h: Hyper,
    where: str,
    spec: optree.PyTreeSpec,
    leaves: list,
    indices: list[int],
    root: str = "params",
    *,
    exact: bool = True,
) -> None:
    """Check that a per-member value has one entry per member of every leaf (and, with
    ``exact``, that a float16/bfloat16 leaf's dtype holds each value exactly)."""
    if not isinstance(h.value, Tensor) or h.value.dim() == 0:
        return
    n = h.value.shape[0]
    for i in indices:
        leaf = leaves[i]
        if exact and leaf.dtype in _HALF and not torch.compiler.is_compiling():
            _check_exact(where, h, leaf.dtype)
        size = leaf.shape[0] if leaf.dim() else None
        if size != n:
            got = f"leading size {size}" if size is not None else "no member axis (0-dim)"
            name = leaf_name(spec, i, root)
            hetero = (
                " A HeteroEnsemble's groups each have their own member axis: "
                + _group_values_advice(h.name)
                if ".stacked." in name and "groups." in name
                else ""
            )
            raise ValueError(
                f"{where}: {h.name} has {n} per-member values but {name} has {got}. A "
                f"per-member {h.name} needs one value per member: a 1-D tensor as long as "
                f"the leading axis of every parameter.{hetero}"
            )
    # Groups of one size pass the check above, yet value k would reach member k of
    # every group: different members.
    check_one_member_axis(
        where,
        f"one per-member {h.name}",
        spec,
        indices,
        "P" + _group_values_advice(h.name)[1:],
        root,
    )


_HALF = (torch.float16, torch.bfloat16)


def _check_exact(where: str, h: Hyper, dtype: torch.dtype) -> None:
    """Refuse per-member values that a float16/bfloat16 leaf's dtype would round: they
    are viewed in the leaf's dtype, where torch.optim computes with the member's Python
    float in float32 (bf16(0.99) is 0.98828125: 22 off after 200 SGD steps)."""
    value = h.value
    assert isinstance(value, Tensor)
    rounded = value.to(dtype).to(value.dtype)
    if not torch.equal(rounded, value):
        k = int((rounded != value).nonzero()[0, 0])
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"{where}: per-member {h.name} for {name} parameters would be rounded to "
            f"{name} (expected values {name} holds exactly, got {value[k].item()!r} for "
            f"member {k}, which it rounds to {rounded[k].item()!r}), where torch.optim "
            "computes with each member's value in float32. Keep the parameters in "
            "float32 (torch.autocast computes in half precision), or give one value for "
            "all members."
        )


def _group_values_advice(name: str) -> str:
    return (
        f"pass each group its members' values, e.g. {name}[list(hens.group_members[g])] "
        "with hens.groups[g] (or build the optimizer with hens.optimizer, which routes [N] "
        "values)."
    )


def one_minus(h: Hyper) -> Hyper:
    """``1 - h``, computed in double precision where the device has it, as torch.optim
    computes ``1 - beta`` from a Python float; each leaf's view then rounds it once."""
    value = h.value
    if isinstance(value, Tensor):
        wide = torch.float32 if value.device.type == "mps" else torch.float64
        return Hyper(h.name, 1.0 - value.to(wide))
    return Hyper(h.name, 1.0 - value)


def per_leaf(
    h: Hyper, leaves: list[Tensor], dtypes: list[torch.dtype] | None = None
) -> float | list[Tensor]:
    """The value for each leaf: the float itself, or ``[N, 1, ..., 1]`` views.

    Views live on each leaf's device, in its dtype (or in ``dtypes``); leaves that
    agree on device, dtype and rank share one view.
    """
    value = h.value
    if not isinstance(value, Tensor):
        return value
    cache: dict[tuple[torch.device, torch.dtype, int], Tensor] = {}
    out = []
    for k, leaf in enumerate(leaves):
        dtype = leaf.dtype if dtypes is None else dtypes[k]
        key = (leaf.device, dtype, leaf.dim())
        view = cache.get(key)
        if view is None:
            shape = [-1] + [1] * (leaf.dim() - 1) if value.dim() else [1] * leaf.dim()
            view = value.to(device=leaf.device, dtype=dtype).reshape(shape)
            cache[key] = view
        out.append(view)
    return out


def _describe(value: object) -> str:
    return type(value).__name__


def hyperparameter(
    where: str,
    name: str,
    value: object,
    *,
    label: str,
    upper: float | None = None,
    schedule_ok: bool = False,
    upper_closed: bool = False,
) -> Hyper:
    """Validate ``value`` as a hyperparameter in ``[0, upper)`` (``[0, inf)`` if no upper).

    With ``upper_closed``, ``upper`` itself is allowed: ``[0, upper]``.

    Raises ``ValueError`` with torch.optim's wording (``Invalid learning rate: -1.0``)
    for an out-of-range value, ``TypeError`` for something that is not a number or a
    floating-point tensor.
    """
    below = "<=" if upper_closed else "<"
    constraint = f"0 <= {name}" + (f" {below} {upper:g}" if upper is not None else "")
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        # A NumPy number (from a config or an array), as torch.optim takes it.
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
        raise TypeError(
            f"{where}: {name} must be a float"
            + (
                ", a 1-D tensor of per-member values or a schedule lr(count)"
                if schedule_ok
                else " or a 1-D tensor of per-member values"
            )
            + f" (expected a number, got {_describe(value)}). "
            + (
                "Give per-member values as a 1-D tensor, one value per member in member "
                "order: torch.tensor([...], dtype=torch.float64) (float64 holds each value "
                f"as torch.optim's Python float does), or pass {name} as one float shared "
                "by all members."
                if isinstance(value, (list, tuple))
                else f"Pass {name} as a float."
            )
        )
    if isinstance(value, Tensor):
        if value.is_meta:
            raise ValueError(
                f"{where}: {name} is a meta tensor, which holds no values; pass a float or "
                "a tensor with one value per member (on the CPU or the parameters' device)."
            )
        if not value.is_floating_point():
            raise TypeError(
                f"{where}: {name} as a tensor must be floating point (expected one float "
                f"value per member, got dtype {value.dtype}). Convert it, e.g. "
                f"{name}.float(), or pass a float shared by all members."
            )
        if value.dim() == 0:
            # Read as a float, as eager computes with it (a 0-dim tensor would be cast
            # to each leaf's dtype: other numbers in bfloat16 and float16).
            value = value.item()
        elif value.dim() > 1 or (value.dim() == 1 and value.numel() == 0):
            raise ValueError(
                f"{where}: {name} as a tensor must be 1-D with one value per member "
                f"(expected shape [N], got {tuple(value.shape)}). Pass one value per member "
                "in member order, or a float shared by all members."
            )
    if not isinstance(value, Tensor):
        value = float(value)
        if not (
            value >= 0.0 and (upper is None or value < upper or (upper_closed and value == upper))
        ):
            raise ValueError(f"{where}: Invalid {label}: {value}. Expected {constraint}.")
        return Hyper(name, value)
    value = value.detach().clone()
    ok = value >= 0
    if upper is not None:
        ok &= (value <= upper) if upper_closed else (value < upper)
    if torch.compiler.is_compiling():
        # Reading the values would break the graph (a data-dependent branch): the
        # check runs inside it, raising when the compiled call runs.
        torch._assert_async(ok.all(), f"{where}: Invalid {label}: expected {constraint}.")
        return Hyper(name, value)
    if not bool(ok.all()):
        member = int((~ok).nonzero()[0, 0])
        raise ValueError(
            f"{where}: Invalid {label}: {value[member].item()} (member {member} of the "
            f"per-member {name}). Expected {constraint} for every member."
        )
    return Hyper(name, value)


def schedule_value(where: str, name: str, value: object) -> Hyper:
    """The output of a schedule (a float, or a 0-dim or ``[N]`` tensor) as a ``Hyper``.

    Not range-checked: that would need a device sync on every step.
    """
    if isinstance(value, Tensor):
        if value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool:
            return Hyper(name, value)
        if value.dim() == 1 and value.is_floating_point():
            return Hyper(name, value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return Hyper(name, float(value))
    if isinstance(value, Tensor):
        desc = f"tensor of shape {tuple(value.shape)}"
    elif isinstance(value, float):
        desc = repr(value)  # nan or inf
    else:
        desc = _describe(value)
    # A NaN or infinite float has the right type and a wrong value: ValueError.
    kind = ValueError if isinstance(value, float) else TypeError
    raise kind(
        f"{where}: the {name} schedule must return a finite float, a 0-dim tensor or a 1-D "
        f"floating-point tensor of per-member values (expected one of those, got {desc}). "
        "Return one of those from the schedule."
    )
