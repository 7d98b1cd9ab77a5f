"""Naming devices and placing one shard's arguments on its device."""

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .._core.in_dims import leaf_dims
from .._tree import flatten as tree_flatten
from .._tree import unflatten
from ._slices import narrow_members


def device_of(where: str, value: object) -> torch.device:
    if not isinstance(value, (str, torch.device)):
        raise TypeError(
            f"{where}: each device must be a str or torch.device (expected e.g. 'cuda:0', "
            f"got {type(value).__name__}). Name each device as a str or torch.device."
        )
    try:
        device = torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{where}: {value!r} is not a device name ({error}).") from None
    if device.type == "meta":
        raise ValueError(f"{where}: the meta device holds no values; give real devices.")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{where}: {value!r} asks for CUDA, but CUDA is not available.")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= count:
            raise ValueError(
                f"{where}: {value!r} is not available: this machine has {count} CUDA "
                f"device(s), cuda:0 to cuda:{count - 1}."
            )
        device = torch.device("cuda", index)
    return device


def devices_of(where: str, devices: object) -> tuple[torch.device, ...]:
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Iterable):
        raise TypeError(
            f"{where}: devices must be a list of devices (expected e.g. ['cuda:0', 'cuda:1'], "
            f"got {type(devices).__name__}). Pass one device per shard in a list."
        )
    found = tuple(device_of(where, d) for d in devices)
    if not found:
        raise ValueError(
            f"{where}: devices is empty (expected at least one device, got 0). Pass one "
            "device per shard."
        )
    return found


def copies_async(device: torch.device) -> bool:
    # A copy to the CPU must complete before the CPU reads it; copies to an accelerator
    # are ordered on its stream, so they need not block Python.
    return device.type != "cpu"


def place_arg(arg: Any, dim: Any, members: slice, device: torch.device) -> Any:
    """``arg`` for one shard: mapped tensors cut to its members, all tensors on its device."""
    leaves, dims = leaf_dims(0, arg, dim)  # checked by check_member_sizes
    spec = tree_flatten(arg)[1]
    out = []
    for leaf, d in zip(leaves, dims, strict=True):
        if isinstance(leaf, Tensor):
            leaf = leaf if d is None else narrow_members(leaf, members, d)
            leaf = leaf.to(device, non_blocking=copies_async(device))
        out.append(leaf)
    return unflatten(spec, out)
