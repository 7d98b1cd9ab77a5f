"""The fast path's float32 ``tanh`` on CPUs where MKL's own is slow: ``e / (e + 2)``.

ATen hands float32 ``tanh`` on CPU to MKL's vector math (``vsTanh``), which takes a
slow generic path on AMD CPUs: 1.35 ms for the 4 MiB hidden activations of 128 S heads
at two threads, 40% of a training step, against 0.22 ms for ``sigmoid``. There the fast
path computes ``tanh(x) = e / (e + 2)`` with ``e = expm1(2x)`` (``x`` first clamped to
10, past which both give 1): four passes and MKL's ``expm1``, 0.86 ms. It is within 2.5
ulp of the exact tanh over every float32 (checked exhaustively; MKL's: 0.51), with no
cancellation anywhere (``expm1`` is exact to an ulp near 0, and ``e + 2`` lies in
``(1, 2)`` for ``x < 0``), and gives ``tanh``'s ``±0``, ``±1`` at ``±inf`` and NaN.

It replaces ``torch.tanh`` where the fast path owns the backward (``tanh_backward`` of
the output, as autograd's own): in ``LinearAct``, in the compiled MLP op and in the
eager plain-op chain (through ``ExpTanh``), at every size, so a member gets the same
numbers whichever of those runs it and however many members share its tensors (a
one-head S layer pays for it: 24 against 13 us, plus the ``autograd.Function``).
Float64, other devices, Intel CPUs (fast MKL ``tanh``) and eager calls inside other
``torch.func`` transforms or under forward-mode AD keep ``torch.tanh``.
"""

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from . import workspace as _workspace

# tanh(x) rounds to 1 in float32 from x = 9.0109; the clamp keeps expm1(2x) finite.
_CLAMP = 10.0
_TWO = torch.tensor(2.0, dtype=torch.float32, device="cpu")  # whatever the defaults at import


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


_forced: list[bool] = []  # set by `forced` (tests): the choice regardless of the CPU


def replaces(t: Tensor) -> bool:
    """Whether the fast path computes ``t``'s tanh as ``e / (e + 2)``."""
    if t.dtype != torch.float32 or t.device.type != "cpu":
        return False
    return _forced[-1] if _forced else _slow_mkl_tanh()


@contextlib.contextmanager
def forced(enabled: bool) -> Iterator[None]:
    """Use (or not) ``e / (e + 2)`` for CPU float32 whatever the CPU (for tests)."""
    _forced.append(enabled)
    try:
        yield
    finally:
        _forced.pop()


def tanh_(z: Tensor) -> Tensor:
    """``torch.tanh_(z)``, computed as ``e / (e + 2)`` where ``replaces(z)``."""
    if not replaces(z):
        return z.tanh_()
    # No Python-number operand but the clamp's: each costs a scalar tensor conversion,
    # a quarter of the time of the whole on one S head.
    z.add_(z).clamp_(max=2 * _CLAMP)  # 2x, exactly
    torch.expm1(z, out=z)
    denominator = torch.add(z, _TWO, out=_workspace.empty(tuple(z.shape), z))
    return z.div_(denominator)


class ExpTanh(torch.autograd.Function):
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
