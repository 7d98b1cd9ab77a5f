"""Checking that every rank set up the same ensemble, before any rank computes with it.

Ranks that disagree (on the member count, the architecture, a dtype, a parameter name,
an optimizer's hyperparameters) would otherwise run: the collectives would combine
tensors of different meanings, or gloo would abort the process on mismatched sizes.
Each rank describes its set-up as a small dict of strings, the descriptions are
exchanged with one ``all_gather_object``, and every rank compares the same list, so
every rank raises the same error, naming the ranks and what differs.
"""

import functools
import math
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._checkpoint.paths import path_key
from .._core.ensemble import Ensemble
from .._core.skeleton import replace_tensors
from .._messages import submodule
from .._structure.architecture import Architecture
from ..optim._ensemble_optimizer import EnsembleOptimizer
from ..optim._protocol import GradientTransformation
from ._errors import failures

Description = dict[str, str]
_SHOWN = 4  # differences named in one message
_DEPTH = 12  # how deep an optimizer's closures are followed


def exchange(
    where: str, description: Description, rank: int, world: int, group: Any
) -> list[Description]:
    """Every rank's description, in rank order (this one alone without other ranks)."""
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return [description]
    out: list[Any] = [None] * world
    with failures(where, "exchanging its set-up with the other ranks", rank, world, group=group):
        dist.all_gather_object(out, description, group=group)
    return out


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def differences(descriptions: list[Description]) -> str:
    """Each entry on which the ranks' descriptions differ, with every rank's value
    (``""`` when they are all alike)."""
    keys = list(dict.fromkeys(k for d in descriptions for k in d))
    found = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, description in enumerate(descriptions):
            by_value.setdefault(description.get(key, "(absent)"), []).append(rank)
        if len(by_value) > 1:
            parts = [f"{_ranks(ranks)}: {value}" for value, ranks in by_value.items()]
            found.append(f"{key} ({'; '.join(parts)})")
    more = len(found) - _SHOWN
    return "; ".join(found[:_SHOWN]) + (f"; and {more} more" if more > 0 else "")


def compare(where: str, descriptions: list[Description], advice: str) -> None:
    """Raise ``ValueError`` naming each entry on which the ranks' descriptions differ."""
    shown = differences(descriptions)
    if not shown:
        return
    raise ValueError(
        f"{where}: the {len(descriptions)} ranks were not set up alike: they differ in "
        f"{shown}. {advice}"
    )


def agree(
    where: str, description: Description, rank: int, world: int, group: Any, advice: str
) -> None:
    """Exchange ``description`` and raise on every rank if any rank's differs."""
    compare(where, exchange(where, description, rank, world, group), advice)


# --- descriptions ----------------------------------------------------------------------


def _tensor(t: Tensor, member_first: bool) -> str:
    shape = tuple(t.shape[1:]) if member_first else tuple(t.shape)
    words = "per-member shape" if member_first else "shape"
    grad = ", requires_grad" if t.requires_grad else ""
    return f"{str(t.dtype).removeprefix('torch.')}, {words} {shape}{grad}"


def _weightless_member(ens: Ensemble) -> nn.Module:
    """One member's module with meta tensors: its structure, without copying weights."""

    def param(_: str, t: Tensor) -> Tensor:
        empty = torch.empty(t.shape[1:], dtype=t.dtype, device="meta")
        return nn.Parameter(empty, requires_grad=t.requires_grad)

    def buffer(_: str, t: Tensor) -> Tensor:
        return torch.empty(t.shape[1:], dtype=t.dtype, device="meta")

    return replace_tensors(ens.stacked, param, buffer)


def describe_ensemble(ens: Ensemble) -> Description:
    """Class, architecture fingerprint, each tensor's per-member spec, modes and options."""
    member = _weightless_member(ens)
    out = {
        "the member class": f"{type(member).__module__}.{type(member).__qualname__}",
        "the architecture fingerprint": Architecture.of(member).fingerprint(),
        "randomness": repr(ens.randomness),
    }
    for kind, tensors in (("parameter", ens.stacked_params()), ("buffer", ens.stacked_buffers())):
        for name, t in tensors.items():
            out[f"{kind} `{name}`"] = _tensor(t, member_first=True)
    for name, module in member.named_modules():
        label = submodule(name)
        out[f"the mode of {label}"] = "train" if module.training else "eval"
        # A module's extra_repr shows its settings (a slope, eps, stride, p), which the
        # tensors do not: the fingerprint may not cover them all.
        out[f"the settings of {label}"] = f"{type(module).__name__}({module.extra_repr()})"
        # And what extra_repr leaves out: a custom module's own attributes (a scale, a
        # mode string), as fe.stack compares them between the members of one process.
        attributes = _attributes(module)
        if attributes:
            out[f"the attributes of {label}"] = attributes
        hooks = {
            "forward hooks": module._forward_hooks,
            "forward pre-hooks": module._forward_pre_hooks,
        }
        for kind, table in hooks.items():
            if table:
                out[f"the {kind} of {label}"] = "; ".join(_function(f) for f in table.values())
    return out


_MODULE_SLOTS = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping


def _function(fn: Any) -> str:
    """A function by name and the values it closes over or defaults to."""
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    values = ", ".join(v for _, v in _constants(fn, name, 0, set()))
    return f"{name}({values})" if values else name


def _simple(value: Any, depth: int = 0) -> str:
    if value is None or isinstance(value, (bool, str, numbers.Number)):
        return _value(value)
    if isinstance(value, (tuple, list)) and depth < _DEPTH:
        inner = ", ".join(_simple(v, depth + 1) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if callable(value) and not isinstance(value, (type, nn.Module)):
        return _function(value)
    return type(value).__qualname__


def _attributes(module: nn.Module) -> str:
    """The module's attributes beyond nn.Module's bookkeeping, tensors and submodules."""
    parts = [
        f"{name}={_simple(value)}"
        for name, value in sorted(vars(module).items())
        if name not in _MODULE_SLOTS and not isinstance(value, (Tensor, nn.Module))
    ]
    return ", ".join(parts)


def _value(x: Any) -> str:
    if isinstance(x, Tensor):
        if x.dim() == 0:
            return f"{x.item()!r} ({str(x.dtype).removeprefix('torch.')})"
        return f"one value per member ({_tensor(x, member_first=True)})"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return repr(x)


def describe_leaves(leaves: Mapping[str, Any], *, values: bool = True) -> Description:
    """Leaves by path: member-first tensors by spec, other leaves by value.

    With ``values=False`` (a template to load into) other leaves are described by type.
    """
    out = {}
    for key, leaf in leaves.items():
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            out[f"leaf `{key}`"] = _tensor(leaf, member_first=True)
        elif values:
            out[f"leaf `{key}`"] = _value(leaf)
        elif isinstance(leaf, Tensor):
            out[f"leaf `{key}`"] = _tensor(leaf, member_first=False)
        else:
            out[f"leaf `{key}`"] = type(leaf).__name__
    return out


def describe_tree(tree: Any) -> Description:
    """A pytree of this rank's state by leaf path (see ``describe_leaves``)."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree, none_is_leaf=True)
    return describe_leaves({path_key(a): x for a, x in zip(accessors, leaves, strict=True)})


def _constants(obj: Any, owner: str, depth: int, seen: set[int]) -> Iterator[tuple[str, str]]:
    """The numbers, strings and tensors an optimizer's functions close over, in order.

    Lists and dicts in a closure are caches filled while training, not settings, and
    are skipped.
    """
    if depth > _DEPTH or id(obj) in seen:
        return
    if obj is None or isinstance(obj, (bool, str, numbers.Number, Tensor)):
        yield owner, _value(obj)
        return
    seen.add(id(obj))
    if isinstance(obj, tuple):  # GradientTransformation is a NamedTuple too
        for x in obj:
            yield from _constants(x, owner, depth + 1, seen)
    elif isinstance(obj, functools.partial):
        name = f"partial({getattr(obj.func, '__qualname__', type(obj.func).__qualname__)})"
        for x in (obj.func, *obj.args, *[obj.keywords[k] for k in sorted(obj.keywords)]):
            yield from _constants(x, name, depth + 1, seen)
        for key in sorted(obj.keywords):
            yield name, repr(key)
    elif callable(obj) and not isinstance(obj, type):
        name = getattr(obj, "__qualname__", type(obj).__qualname__)
        code = getattr(obj, "__code__", None)
        own = (getattr(obj, "__module__", None) or "").startswith("funcensemble")
        if code is not None and not own:
            # A function of the user's (a schedule): the numbers written in its body and
            # its defaults are its settings too. fe.optim's own keep theirs in closures.
            for c in code.co_consts:
                if isinstance(c, numbers.Number):
                    yield name, _value(c)
            for d in getattr(obj, "__defaults__", None) or ():
                yield from _constants(d, name, depth + 1, seen)
            for d in (getattr(obj, "__kwdefaults__", None) or {}).values():
                yield from _constants(d, name, depth + 1, seen)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from _constants(contents, name, depth + 1, seen)


def describe_optimizer(where: str, optimizer: Any) -> Description:
    """An ``fe.optim`` transformation or a ``torch.optim`` optimizer, by hyperparameters
    (an ``EnsembleOptimizer`` by its transformation)."""
    if isinstance(optimizer, EnsembleOptimizer):
        optimizer = optimizer.transform
    if isinstance(optimizer, torch.optim.Optimizer):
        out = {"the optimizer": type(optimizer).__qualname__}
        for i, group in enumerate(optimizer.param_groups):
            for name, value in group.items():
                if name != "params":
                    out[f"the optimizer's group {i} `{name}`"] = _value(value)
        return out
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            f"{where}: optimizer must be an fe.optim transformation, an "
            "fe.optim.EnsembleOptimizer or a torch.optim.Optimizer (expected e.g. "
            f"fe.optim.adam(1e-3), got {type(optimizer).__name__}). Pass the optimizer "
            "this rank trains with."
        )
    out: Description = {}
    counts: dict[str, int] = {}
    label: dict[str, str] = {}  # fe.optim keeps a setting's name just before its value
    for owner, value in _constants(optimizer, "", 0, set()):
        counts[owner] = counts.get(owner, 0) + 1
        where = f"value {counts[owner]} of `{owner}`"
        name = label.pop(owner, None)
        key = f"the optimizer's `{name}` ({where})" if name else f"the optimizer's {where}"
        out[key] = value
        if value.startswith("'") and value.endswith("'"):
            label[owner] = value[1:-1]
    return out


def describe_state(where: str, value: Any) -> Description:
    """An ``Ensemble`` by its architecture, any other pytree by its leaves."""
    if isinstance(value, Ensemble):
        return describe_ensemble(value)
    if isinstance(value, nn.Module):
        raise TypeError(
            f"{where}: state is a {type(value).__name__}, an ordinary module (expected an "
            f"fe.Ensemble (this rank's members) or a pytree of member-first tensors, got "
            f"{type(value).__name__}). Pass the Ensemble, or its state_dict()."
        )
    return describe_tree(value)


def agree_to_write(
    where: str,
    path: str,
    leaves: Mapping[str, Any],
    shard: Any,
    *,
    values: bool,
    checkpoint: str | None = None,
    refused: str | None = None,
) -> None:
    """Before a sharded save or load: every rank passes the same structure (and values);
    for a load, ``checkpoint`` identifies what this rank found at ``path``, and
    ``refused`` is this rank's own refusal of its object (raised by the caller after
    this, when every rank refused alike)."""
    rank, world, group = shard._all_ranks()
    description = describe_leaves(leaves, values=values)
    if checkpoint is not None:
        description["the checkpoint found"] = checkpoint
        description["whether its object matches the checkpoint"] = (
            "yes" if refused is None else f"no ({refused.rstrip('.')})"
        )
    agree(
        where,
        description,
        rank,
        world,
        group,
        f"Every rank must pass the same structure for '{path}' (the same keys, dtypes and "
        "per-member shapes"
        + (
            ", and equal values for the leaves written once, such as a step count)."
            if values
            else "), and read the same checkpoint: one directory all ranks share, chosen "
            "once (e.g. by rank 0, then broadcast), not listed by each rank on its own; "
            "a rank whose own object does not match the checkpoint is named above with "
            "its reason: build that rank's object for the saved members and structure."
        ),
    )
