"""Kept buffers are handed out again only once nothing else holds them."""

import torch

from funcensemble._kernels import workspace as _workspace


def test_a_buffer_is_reused_only_when_released():
    _workspace.clear()
    like = torch.zeros(1)
    shape = (64, 1024)  # 256 KiB: above the size the pool keeps
    a = _workspace.empty(shape, like)
    ptr = a.data_ptr()
    b = _workspace.empty(shape, like)
    assert b.data_ptr() != ptr  # a is held: another buffer
    view = a[3:]
    del a
    c = _workspace.empty(shape, like)
    assert c.data_ptr() != ptr  # a view of it is still held
    del view, c
    d = _workspace.empty(shape, like)
    assert d.data_ptr() == ptr  # released: the kept buffer comes back
    saved = d.detach()  # e.g. what autograd saved, or a .grad
    del d
    assert _workspace.empty(shape, like).data_ptr() != ptr
    del saved
    assert _workspace.empty(shape, like).data_ptr() == ptr
    _workspace.clear()


def test_small_and_non_cpu_requests_are_fresh_and_the_pool_is_bounded():
    _workspace.clear()
    like = torch.zeros(1, dtype=torch.float64)
    small = _workspace.empty((8, 8), like)
    assert small.dtype == torch.float64 and not _workspace._pool.buffers
    held = [_workspace.empty((128, 128), like) for _ in range(_workspace._PER_SHAPE + 3)]
    assert len({t.data_ptr() for t in held}) == len(held)
    assert sum(len(v) for v in _workspace._pool.buffers.values()) == _workspace._PER_SHAPE
    for k in range(_workspace._SHAPES + 5):
        _workspace.empty((128, 129 + k), like)
    assert len(_workspace._pool.buffers) <= _workspace._SHAPES
    kept = sum(b.nbytes for v in _workspace._pool.buffers.values() for b in v)
    assert kept == _workspace._pool.bytes <= _workspace._MAX_BYTES
    _workspace.clear()
    assert not _workspace._pool.buffers and _workspace._pool.bytes == 0
