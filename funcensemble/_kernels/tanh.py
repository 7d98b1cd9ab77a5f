"""The fast path's float32 ``tanh`` on CPUs where MKL's own is slow: NumPy's SIMD kernel.

ATen hands float32 ``tanh`` on CPU to MKL's vector math (``vsTanh``), which takes a
slow generic path on AMD CPUs: 1.35 ms for the 4 MiB hidden activations of 128 S heads
at two threads, 40% of a training step (``expm1``, ``exp`` and ATen's Sleef-based
``gelu``/``mish`` are no faster there). NumPy's own float32 ``tanh`` is a SIMD kernel
(AVX2/FMA3 and AVX-512, chosen when NumPy starts): on the same 4 MiB it takes about
0.15 ms on one thread. It is within 2 ulp of the exact tanh over every float32 (1.37
measured; MKL's: 0.51), and gives ``tanh``'s ``±0``, ``±1`` at ``±inf`` and NaN. It
runs on the tensor's own memory (``Tensor.numpy()`` shares it), in place.

It replaces ``torch.tanh`` where the fast path owns the backward (``tanh_backward`` of
the output, as autograd's own): in ``LinearAct``, in the compiled MLP op and in the
eager plain-op chain (through ``FastTanh``), at every size, so a member gets the same
numbers whichever of those runs it and however many members share its tensors.
Float64, other devices, Intel CPUs (fast MKL ``tanh``), a NumPy without those SIMD
kernels, tensor subclasses, calls watched by a tracer or mode (``torch.jit.trace``,
``make_fx``, a dispatch or function mode, ``with torch.device(...)``) and eager calls
inside other ``torch.func`` transforms or under forward-mode AD keep ``torch.tanh``.
"""

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import _torch_compat


@functools.cache
def _slow_mkl_tanh() -> bool:
    """Whether this CPU runs MKL's ``vsTanh`` slowly: an AMD CPU with an MKL build."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() == "AuthenticAMD"
    except OSError:
        pass
    return False


@functools.cache
def _numpy_simd_tanh() -> bool:
    """Whether NumPy runs its SIMD float32 ``tanh`` here (AVX2 with FMA3, or AVX-512).

    Without them NumPy falls back to the C library's scalar ``tanhf``: accurate, but
    slower than MKL's slow path.
    """
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as features
    has = lambda name: bool(features.get(name, False))  # noqa: E731
    return has("AVX512_SKX") or (has("AVX2") and has("FMA3"))


_forced: list[bool] = []  # set by `forced` (tests): the choice regardless of the CPU


def replaces(t: Tensor) -> bool:
    """Whether the fast path computes ``t``'s tanh with NumPy's kernel.

    Never for a tensor subclass, nor while a tracer or mode watches torch's ops
    (``torch.jit.trace``, ``make_fx``, a dispatch or function mode): NumPy's work is
    invisible to them, and a traced graph would leave the tanh out.
    """
    if torch.compiler.is_compiling():
        return False  # first: Dynamo traces this function and cannot trace what follows
    if t.dtype != torch.float32 or t.device.type != "cpu" or type(t) is not Tensor:
        return False
    if _torch_compat.ops_observed():
        return False
    return _forced[-1] if _forced else (_slow_mkl_tanh() and _numpy_simd_tanh())


@contextlib.contextmanager
def forced(enabled: bool) -> Iterator[None]:
    """Use (or not) NumPy's kernel for CPU float32 whatever the CPU (for tests)."""
    _forced.append(enabled)
    try:
        yield
    finally:
        _forced.pop()


def tanh_(z: Tensor) -> Tensor:
    """``torch.tanh_(z)``, computed by NumPy's SIMD kernel where ``replaces(z)``."""
    if not replaces(z):
        return z.tanh_()
    # NumPy's SIMD loop handles contiguous memory; strided arrays may take its scalar
    # loop, whose numbers differ by an ulp: a member's values must not depend on layout.
    target = z if z.is_contiguous() else z.contiguous()
    values = target.detach().numpy()
    np.tanh(values, out=values)
    if target is not z:
        z.copy_(target)
    elif not z.is_inference():
        # NumPy wrote behind autograd's back: record the change as torch's in-place ops do.
        torch.autograd.graph.increment_version(z)
    return z


class FastTanh(torch.autograd.Function):
    """``tanh_`` in place on a fresh intermediate, differentiated as autograd's tanh is
    (``tanh_backward`` of the output), for the plain-op chain in eager mode only (an
    ``autograd.Function`` without ``setup_context`` does not run inside transforms)."""

    @staticmethod
    def forward(ctx: Any, z: Tensor) -> Tensor:  # type: ignore[override]
        ctx.mark_dirty(z)
        y = tanh_(z)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(g, y)
