"""Copies of a module's structure whose tensors are replaced one by one.

A *skeleton* is a deep copy of a module in which every parameter and buffer has been
swapped for another tensor (a meta tensor, a stacked ``[N, ...]`` tensor, or one
member's slice), so the copy keeps the module's classes, attributes, hooks, tied
weights and train/eval flags without duplicating the user's weight storage.

An object of the user's own classes that every member holds (one object, such as a
temperature or a config all members were built with) is not copied: the skeleton
holds that object too, as each loop member does, so a change made to it after the
ensemble is built reaches both (see ``keep_shared``).
"""

import copy
import functools
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .._messages import submodule
from .._structure.attributes import TORCH_OWN
from .._structure.tensor_tags import tensor_tags


def named_tensors(module: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The module's parameters and buffers by state-dict name, tied tensors once."""
    return dict(module.named_parameters()), dict(module.named_buffers())


# Where an object sits in a module: submodule path, attribute, then the keys or
# indices of the lists, tuples and dicts it is nested in.
Location = tuple[Any, ...]
# For each skeleton, the objects every member holds, by location: kept by reference in
# every copy made of it here.
_SHARED: "weakref.WeakKeyDictionary[nn.Module, dict[Location, object]]" = (
    weakref.WeakKeyDictionary()
)
_COPIED_ANYWAY = (
    Tensor,
    nn.Module,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
    weakref.ref,
)
_DEPTH = 8  # how deep lists, tuples and dicts are followed


def shareable(value: object) -> bool:
    """Whether ``value`` is an object of the user's own classes, which members may hold
    in common (not a tensor, module, function or builtin value or container)."""
    return type(value).__module__ != "builtins" and not isinstance(value, _COPIED_ANYWAY)


def user_objects(module: nn.Module) -> dict[Location, object]:
    """The ``shareable`` objects in the module's attributes (nn.Module's own entries
    aside), followed into lists, tuples and dicts, by location."""
    found: dict[Location, object] = {}

    def visit(value: Any, where: Location, depth: int) -> None:
        if isinstance(value, list | tuple | dict):
            if depth >= _DEPTH:
                return
            if isinstance(value, dict):  # OrderedDict, defaultdict too
                for k, v in value.items():
                    # Keys that compare as plain values only: no user __eq__ is called.
                    if type(k) in (str, int, bool) or k is None:
                        visit(v, (*where, k), depth + 1)
            else:  # namedtuples too
                for i, v in enumerate(value):
                    visit(v, (*where, i), depth + 1)
        elif shareable(value):
            found[where] = value

    for path, sub in module.named_modules():
        for key, value in vars(sub).items():
            if key not in TORCH_OWN:
                visit(value, (path, key), 0)
    return found


def held_by_all(objects: dict[Location, object], modules: Iterable[nn.Module]) -> dict:
    """Those of ``objects`` (by location) that each of ``modules`` holds there too."""
    for module in modules:
        theirs = user_objects(module)
        objects = {k: v for k, v in objects.items() if theirs.get(k) is v}
    return objects


def keep_shared(module: nn.Module, objects: dict[Location, object]) -> None:
    """Keep these objects (every member holds them) by reference in copies of ``module``."""
    if objects:
        _SHARED[module] = dict(objects)
    else:
        _SHARED.pop(module, None)


def shared(module: nn.Module) -> dict[Location, object]:
    """The objects kept by reference in copies of ``module``, by location."""
    return dict(_SHARED.get(module, {}))


def shared_state(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (an object's ``__getstate__``) with the locations of the objects kept
    by reference in copies of ``module``: the record is keyed by the module itself,
    which ``copy.deepcopy`` and pickling replace (see ``restore_shared``)."""
    locations = list(_SHARED.get(module, {}))
    return {**state, _LOCATIONS: locations} if locations else state


def restore_shared(state: dict[str, Any]) -> Callable[[nn.Module], None]:
    """Take ``shared_state``'s locations out of ``state``; the function returned
    records, for the copied module, the objects it holds there (the copy's own)."""
    locations = state.pop(_LOCATIONS, None)

    def record(module: nn.Module) -> None:
        if locations:
            found = user_objects(module)
            keep_shared(module, {k: found[k] for k in locations if k in found})

    return record


_LOCATIONS = "_funcensemble_shared_locations"


def replace_tensors(
    module: nn.Module,
    make_param: Callable[[str, Tensor], Tensor],
    make_buffer: Callable[[str, Tensor], Tensor],
    kept: dict[Location, object] | None = None,
    where: str = "funcensemble",
) -> nn.Module:
    """Deep-copy ``module``, building each parameter and buffer with the callables.

    Tied tensors stay tied: each distinct tensor is built once and the copy reuses it
    wherever the original did, with the original's Python attributes (copied). Nothing
    of the original's storage is copied.
    """
    params, buffers = named_tensors(module)
    kept = shared(module) if kept is None else kept
    memo: dict[int, object] = {id(v): v for v in kept.values()}  # deepcopy keeps these
    for name, param in params.items():
        new = make_param(name, param)
        if not isinstance(new, nn.Parameter):
            new = nn.Parameter(new, requires_grad=param.requires_grad)
        memo[id(param)] = new
    for name, buffer in buffers.items():
        if id(buffer) not in memo:
            memo[id(buffer)] = make_buffer(name, buffer)
    tensors = [t for t in (*params.values(), *buffers.values()) if tensor_tags(t)]
    try:
        copied = copy.deepcopy(module, memo)
    except Exception as error:
        raise _not_copied(where, module, memo, error) from error
    for t in tensors:  # attributes set on a tensor (a tag such as `p.no_decay = True`)
        new = memo[id(t)]
        if new is not t:
            vars(new).update(copy.deepcopy(tensor_tags(t), memo))
    keep_shared(copied, kept)
    return copied


def _not_copied(where: str, module: nn.Module, memo: dict, error: Exception) -> TypeError:
    """The error for a module ``copy.deepcopy`` failed on, naming the attribute it
    failed on where one alone fails."""
    for path, sub in module.named_modules():
        for name, value in vars(sub).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            try:
                copy.deepcopy(value, dict(memo))
            except Exception as found:
                error, place = found, f"`{name}` of {submodule(path)} ({type(sub).__name__})"
                break
        else:
            continue
        break
    else:
        place = f"{submodule('')} ({type(module).__name__})"
    return TypeError(
        f"{where}: member 0's {place} could not be copied (copy.deepcopy raised "
        f"{type(error).__name__}: {error}; expected attributes that copy.deepcopy copies). "
        "An ensemble runs every member through one copy of member 0. Keep such an object "
        "out of the module (a module-level constant, or a value computed in forward), or "
        "give its class a __deepcopy__."
    )


def meta_skeleton(
    module: nn.Module, kept: dict[Location, object] | None = None, where: str = "funcensemble"
) -> nn.Module:
    """A weightless copy of ``module`` whose tensors live on the meta device; ``kept``:
    the objects it holds by reference (by default those ``module`` keeps)."""

    def to_meta(_: str, t: Tensor) -> Tensor:
        return torch.empty_like(t, device="meta")

    return replace_tensors(module, to_meta, to_meta, kept, where)


def modes(module: nn.Module) -> dict[str, bool]:
    """Each submodule's ``training`` flag, by qualified name (``""`` is the root)."""
    return {name: sub.training for name, sub in module.named_modules()}
