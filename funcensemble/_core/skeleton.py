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

import torch
from torch import Tensor, nn

from .._structure.tensor_tags import tensor_tags


def named_tensors(module: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The module's parameters and buffers by state-dict name, tied tensors once."""
    return dict(module.named_parameters()), dict(module.named_buffers())


# For each skeleton, the attributes (submodule path, name) holding objects every member
# holds, kept by reference in every copy made of it here.
_SHARED: "weakref.WeakKeyDictionary[nn.Module, frozenset[tuple[str, str]]]" = (
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


def shareable(value: object) -> bool:
    """Whether ``value`` is an object of the user's own classes, which members may hold
    in common (not a tensor, module, function or builtin value or container)."""
    return type(value).__module__ != "builtins" and not isinstance(value, _COPIED_ANYWAY)


def user_objects(module: nn.Module, own: frozenset[str]) -> dict[tuple[str, str], object]:
    """The module's attributes holding ``shareable`` objects, by (submodule path, name);
    ``own``: nn.Module's own entries, never the user's."""
    return {
        (path, key): value
        for path, sub in module.named_modules()
        for key, value in vars(sub).items()
        if key not in own and shareable(value)
    }


def keep_shared(module: nn.Module, names: Iterable[tuple[str, str]]) -> None:
    """Keep the objects ``module`` holds in these attributes by reference in its copies."""
    names = frozenset(names)
    if names:
        _SHARED[module] = names
    else:
        _SHARED.pop(module, None)


def _kept(module: nn.Module) -> dict[int, object]:
    found = {}
    for path, key in _SHARED.get(module, ()):
        sub = module.get_submodule(path) if path else module
        if key in vars(sub):
            value = vars(sub)[key]
            found[id(value)] = value
    return found


def replace_tensors(
    module: nn.Module,
    make_param: Callable[[str, Tensor], Tensor],
    make_buffer: Callable[[str, Tensor], Tensor],
) -> nn.Module:
    """Deep-copy ``module``, building each parameter and buffer with the callables.

    Tied tensors stay tied: each distinct tensor is built once and the copy reuses it
    wherever the original did, with the original's Python attributes (copied). Nothing
    of the original's storage is copied.
    """
    params, buffers = named_tensors(module)
    memo: dict[int, object] = _kept(module)  # deepcopy keeps what its memo maps to itself
    for name, param in params.items():
        new = make_param(name, param)
        if not isinstance(new, nn.Parameter):
            new = nn.Parameter(new, requires_grad=param.requires_grad)
        memo[id(param)] = new
    for name, buffer in buffers.items():
        if id(buffer) not in memo:
            memo[id(buffer)] = make_buffer(name, buffer)
    tensors = [t for t in (*params.values(), *buffers.values()) if tensor_tags(t)]
    copied = copy.deepcopy(module, memo)
    for t in tensors:  # attributes set on a tensor (a tag such as `p.no_decay = True`)
        new = memo[id(t)]
        if new is not t:
            vars(new).update(copy.deepcopy(tensor_tags(t), memo))
    keep_shared(copied, _SHARED.get(module, ()))
    return copied


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A weightless copy of ``module`` whose tensors live on the meta device."""

    def to_meta(_: str, t: Tensor) -> Tensor:
        return torch.empty_like(t, device="meta")

    return replace_tensors(module, to_meta, to_meta)


def modes(module: nn.Module) -> dict[str, bool]:
    """Each submodule's ``training`` flag, by qualified name (``""`` is the root)."""
    return {name: sub.training for name, sub in module.named_modules()}
