"""Copies of a module's structure whose tensors are replaced one by one.

A *skeleton* is a deep copy of a module in which every parameter and buffer has been
swapped for another tensor (a meta tensor, a stacked ``[N, ...]`` tensor, or one
member's slice), so the copy keeps the module's classes, attributes, hooks, tied
weights and train/eval flags without duplicating the user's weight storage.
"""

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .._structure.tensor_tags import tensor_tags


def named_tensors(module: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The module's parameters and buffers by state-dict name, tied tensors once."""
    return dict(module.named_parameters()), dict(module.named_buffers())


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
    memo: dict[int, object] = {}
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
    return copied


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A weightless copy of ``module`` whose tensors live on the meta device."""

    def to_meta(_: str, t: Tensor) -> Tensor:
        return torch.empty_like(t, device="meta")

    return replace_tensors(module, to_meta, to_meta)


def modes(module: nn.Module) -> dict[str, bool]:
    """Each submodule's ``training`` flag, by qualified name (``""`` is the root)."""
    return {name: sub.training for name, sub in module.named_modules()}
