"""Activation-sized CPU buffers kept from one training step to the next.

A stacked MLP's hidden activations and their gradients are megabytes each (S at 128
members: 4 MiB per hidden layer). Allocated fresh every step, glibc's malloc serves
them from memory it has just returned to the system (its mmap and trim thresholds),
so every step pays a page fault per 4 KiB on first touch: up to half the step at two
threads. Keeping the buffers and writing into them (``out=``) skips that.

A buffer is handed out only when nothing but this pool holds its storage (no view,
no alias, no tensor that autograd saved or the user kept): a graph not yet
backpropagated, ``retain_graph=True``, ``create_graph=True``, an output or ``.grad``
the user holds all keep their buffer, and the next step gets another one. So reuse
never overwrites a tensor anyone can still read.

The pool is bounded (a few buffers per shape, a few dozen shapes, least recently used
dropped first, 512 MiB in all) and per thread, so threads never share a buffer.
"""

import threading
from collections import OrderedDict

import torch
from torch import Tensor

from .. import _torch_compat

# Below this, malloc's free lists serve the request from memory it already touched.
MIN_BYTES = 64 * 1024
_PER_SHAPE = 8  # a training step of a deep MLP holds several same-shaped at once
_SHAPES = 32
_MAX_BYTES = 512 * 2**20  # kept in all, per thread

Key = tuple[tuple[int, ...], torch.dtype, torch.device, bool]


class _Pool(threading.local):
    def __init__(self) -> None:
        self.buffers: OrderedDict[Key, list[Tensor]] = OrderedDict()
        self.bytes = 0


_pool = _Pool()


def empty(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialized ``shape`` tensor of ``like``'s dtype and device, which nothing
    else holds; the caller writes every element before anyone reads it.

    A kept buffer when one is free (CPU, large enough), else a fresh tensor that is
    kept for later steps while the pool has room.
    """
    dtype, device = like.dtype, like.device
    numel = 1
    for s in shape:
        numel *= s
    if device.type != "cpu" or numel * like.element_size() < MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    # A buffer made under inference_mode cannot be saved for backward outside it.
    key = (shape, dtype, device, torch.is_inference_mode_enabled())
    buffers = _pool.buffers.get(key)
    if buffers is None:
        buffers = _pool.buffers[key] = []
        if len(_pool.buffers) > _SHAPES:
            _, dropped = _pool.buffers.popitem(last=False)
            _pool.bytes -= sum(b.nbytes for b in dropped)
    else:
        _pool.buffers.move_to_end(key)
    for buf in buffers:
        if not _torch_compat.storage_held_elsewhere(buf):
            return buf.detach()  # an alias: the pool's own tensor never leaves it
    buf = torch.empty(shape, dtype=dtype, device=device)
    if len(buffers) < _PER_SHAPE and _pool.bytes + buf.nbytes <= _MAX_BYTES:
        buffers.append(buf)
        _pool.bytes += buf.nbytes
        return buf.detach()
    return buf


def clear() -> None:
    """Drop this thread's kept buffers (their memory returns once nothing else holds it)."""
    _pool.buffers.clear()
    _pool.bytes = 0
