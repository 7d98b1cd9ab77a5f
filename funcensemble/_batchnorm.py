"""BatchNorm of all members as one ``batch_norm`` over ``N * C`` channels, under ``vmap``.

vmap's batching rule for ``batch_norm`` with per-member weights and running statistics
costs about three times the loop's BatchNorm. Per-member statistics are exactly
per-channel statistics once the member axis is folded into the channel axis:
``[B, N, C, ...]`` viewed as ``[B, N * C, ...]``, with the stacked ``[N, C]`` weights
and running statistics viewed as ``[N * C]``. One ``batch_norm`` call then normalizes
every member and updates every member's running statistics in place. ``_rewrites``
intercepts ``F.batch_norm`` inside funcensemble's own ``vmap`` calls and calls
``_fold``, which does that whenever the tensors are laid out for it; anything else
goes to vmap as before.
"""

import torch
from torch import Tensor
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
from torch.nn import functional as F

from ._fastpath import _unwrap_at


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
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is None or interpreter.key() != torch._C._functorch.TransformType.Vmap:
        return None
    level = interpreter.level()
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
    with retrieve_current_functorch_interpreter().lower():
        out = F.batch_norm(h.reshape(b, n * c, *spatial), *flat, training, momentum, eps)
    return torch._C._functorch._add_batch_dim(out.view(b, n, c, *spatial), 1, level)
