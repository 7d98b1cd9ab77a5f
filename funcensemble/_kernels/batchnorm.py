"""BatchNorm of all members as one ``batch_norm`` over ``N * C`` channels, under ``vmap``.

vmap's batching rule for ``batch_norm`` with per-member weights and running statistics
costs about three times the loop's BatchNorm. Per-member statistics are exactly
per-channel statistics once the member axis is folded into the channel axis:
``[B, N, C, ...]`` viewed as ``[B, N * C, ...]``, with the stacked ``[N, C]`` weights
and running statistics viewed as ``[N * C]``. One ``batch_norm`` call then normalizes
every member and updates every member's running statistics in place. ``_rewrites``
intercepts ``F.batch_norm`` inside funcensemble's own ``vmap`` calls and asks
``BatchNormRule``, which does that whenever the tensors are laid out for it; anything
else goes to vmap as before.

BatchNorm with ``momentum=None`` (a cumulative moving average) reads its step count
with ``float(num_batches_tracked)``, which vmap cannot do for a per-member count. The
same rule answers that call: when every member has the same count (members trained
together), with that count, so the layer computes the factor the loop computes; otherwise
the statistics are updated per member with factor ``1 / count`` (see
``_per_member_average``).
"""

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .. import _torch_compat
from .._torch_compat import unwrap_at as _unwrap_at
from . import torch_functions as _torch_functions

_BatchNorm = nn.modules.batchnorm._BatchNorm
_NormBase = nn.modules.batchnorm._NormBase
_STATS = ("running_mean", "running_var", "num_batches_tracked")


def norm_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every normalization layer that can hold running statistics."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, _NormBase)]


def has_batch_norm(norms: list[tuple[str, nn.Module]]) -> bool:
    return any(isinstance(m, _BatchNorm) for _, m in norms)


def updated_in_place(norms: list[tuple[str, nn.Module]]) -> list[str]:
    """Buffer names a forward updates in place: the running statistics of train-mode layers."""
    return [
        f"{name}.{stat}" if name else stat
        for name, m in norms
        if m.training and m.track_running_stats
        for stat in _STATS
        if m._buffers.get(stat) is not None
    ]


def cumulative(norms: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The train-mode BatchNorms with ``momentum=None``, which read their step count."""
    return [
        (name, m)
        for name, m in norms
        if isinstance(m, _BatchNorm)
        and m.momentum is None
        and m.training
        and m.track_running_stats
        and m._buffers.get("num_batches_tracked") is not None
    ]


def check_values_per_channel(size: torch.Size) -> None:
    """``F.batch_norm``'s own check in training, in one member's ``size``."""
    if size[0] * math.prod(size[2:]) == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {size} "
            "(per member)"
        )


def _fold(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor | None:
    """``F.batch_norm`` of every member at once, or ``None`` to let vmap run it."""
    level = _torch_compat.vmap_level()
    if level is None:
        return None
    if not isinstance(input, Tensor):
        return None
    found = _unwrap_at(input, level)
    if found is None or found[1] is None:
        return None
    inner, bdim = found
    per_member = []
    for t in (running_mean, running_var, weight, bias):
        if t is None:
            per_member.append(None)
            continue
        unwrapped = _unwrap_at(t, level) if isinstance(t, Tensor) else None
        if unwrapped is None or unwrapped[1] != 0 or unwrapped[0].dim() != 2:
            return None  # shared (unbatched) or oddly batched: vmap's rule handles it
        per_member.append(unwrapped[0])
    h = inner.movedim(bdim, 1)  # [B, N, C, *spatial]
    if h.dim() < 3:
        return None
    b, n, c, spatial = h.shape[0], h.shape[1], h.shape[2], h.shape[3:]
    if any(t is not None and t.shape != (n, c) for t in per_member):
        return None
    stats = per_member[:2]
    if any(t is not None and not t.is_contiguous() for t in stats):
        return None  # a copy would not receive the in-place statistics update
    flat = [None if t is None else t.reshape(n * c) for t in per_member]
    if training:
        check_values_per_channel(torch.Size([b, c, *spatial]))  # not the folded N * C channels
    with _torch_compat.lower_transform():
        batch_norm = _torch_functions.original(F.batch_norm)  # (a replacement ran already)
        out = batch_norm(h.reshape(b, n * c, *spatial), *flat, training, momentum, eps)
    return _torch_compat.add_batch_dim(out.view(b, n, c, *spatial), 1, level)


def _per_member_average(
    counts: Tensor,
    input: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Train-mode ``F.batch_norm`` of one member whose cumulative factor is ``1 / counts``.

    Called under vmap with per-member ``counts`` (the incremented
    ``num_batches_tracked``): normalizes with the batch's statistics and updates the
    running ones as the BatchNorm kernel does, ``f * batch + (1 - f) * running``, with
    the unbiased batch variance and ``f`` in double precision.
    """
    out = _fold(input, None, None, weight, bias, True, 0.0, eps)
    if out is None:
        batch_norm = _torch_functions.original(F.batch_norm)  # (a replacement ran already)
        out = batch_norm(input, None, None, weight, bias, True, 0.0, eps)
    with torch.no_grad():
        x = input.detach()
        dims = [0, *range(2, x.dim())]
        factor = 1.0 / counts.to(torch.float64)
        for stat, batch in ((running_mean, x.mean(dims)), (running_var, x.var(dims))):
            stat.copy_(factor * batch + (1.0 - factor) * stat)
    return out


_OWN_READS = (nn.modules.batchnorm._BatchNorm.forward.__code__, nn.SyncBatchNorm.forward.__code__)


def _read_by_batch_norm(layer: nn.Module) -> bool:
    """Whether the ``float()`` being answered was called by torch's own BatchNorm
    ``forward`` for ``layer`` (``_BatchNorm``'s or ``SyncBatchNorm``'s, which hand it
    to ``F.batch_norm``, also through a subclass's ``super().forward()``), not by other
    code (a parent's forward, a hook, a subclass's own forward, which would get the
    placeholder): such a frame, ``layer`` its ``self``, before any module call's."""
    call = nn.Module._call_impl.__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not call:
        if frame.f_code in _OWN_READS and frame.f_locals.get("self") is layer:
            return True
        frame = frame.f_back
    return False


class BatchNormRule:
    """How ``_rewrites``' mode answers BatchNorm's calls under ``vmap``: members folded into
    channels, and ``float(num_batches_tracked)`` of the cumulative layers.

    ``cumulative``: the ``(name, layer)`` BatchNorms with ``momentum=None`` in train
    mode (see ``cumulative``), whose ``float(num_batches_tracked)`` this rule answers.
    """

    def __init__(self, cumulative: Sequence[tuple[str, nn.Module]] = ()) -> None:
        self.cumulative = cumulative
        # (running_mean the layer will pass to F.batch_norm, its per-member counts)
        self._pending: list[tuple[Tensor, Tensor]] = []

    def step_count(self, t: Tensor) -> float | None:
        """``float(t)`` for a cumulative BatchNorm's ``num_batches_tracked``, else ``None``."""
        found = next(((n, m) for n, m in self.cumulative if m.num_batches_tracked is t), None)
        if found is None:
            return None
        name, layer = found
        try:
            counts = _torch_compat.fully_unwrapped(t)
            first = counts.reshape(-1)[:1]
            if bool((counts == first).all()):
                return float(first.item())  # one count: the layer runs as in the loop
            shown = counts.tolist()
        except RuntimeError:
            # torch 2.6: under an outer grad transform the counts have no storage to read.
            shown = "not readable inside this transform"
        level = _torch_compat.vmap_level()
        batched = _unwrap_at(t, level) if level is not None else None
        if batched is None or batched[1] is None or batched[0].dim() != 1:
            raise RuntimeError(
                f"BatchNorm `{name}` has momentum=None (a cumulative moving average) and "
                f"members with different num_batches_tracked ({shown}), inside "
                "a torch.func transform funcensemble cannot see through (your own, or "
                "the torch.func.grad a compiled fe.value_and_grad runs). Call it through "
                "fe.vmap, fe.value_and_grad or fe.Ensemble directly and eagerly, give the "
                "members one count (e.g. set num_batches_tracked to the same value), or "
                "set momentum to a float."
            )
        if not torch.compiler.is_compiling() and not _read_by_batch_norm(layer):
            raise RuntimeError(
                f"forward reads float() or .item() of BatchNorm `{name}`'s "
                f"num_batches_tracked, and its members count differently ({shown}): in "
                "one vectorized call there is no one number to give it (expected members "
                "with one count, or BatchNorm alone reading it). Read the count as a "
                "tensor (bn.num_batches_tracked, without float() or .item()), or give the "
                "members one count."
            )
        self._pending.append((layer.running_mean, t))
        return float("nan")  # never used: F.batch_norm for this layer is answered below

    def batch_norm(self, args: Any, kwargs: Any) -> Tensor | None:
        """``F.batch_norm(*args, **kwargs)`` of all members, or ``None`` for vmap's rule."""
        if self._pending:
            running_mean = args[1] if len(args) > 1 else kwargs.get("running_mean")
            for i, (mean, counts) in enumerate(self._pending):
                if mean is running_mean:
                    del self._pending[i]
                    return _per_member_average(counts, *args, **kwargs)
        return _fold(*args, **kwargs)
