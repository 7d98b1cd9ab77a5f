"""LayerNorm and train-mode BatchNorm as elementary ops, for a grad transform under vmap.

torch's batching rules for the backward kernels of ``native_layer_norm`` and
``native_batch_norm`` are wrong for ``grad_input`` when that backward is itself
differentiated (pytorch/functorch#534): a gradient penalty or a meta-gradient written
per member, ``torch.func.grad`` inside the mapped function, gets wrong second
derivatives for the layers before the norm (tens of percent off), where the loop's
double backward is exact. First derivatives are right.

So when a grad transform is the innermost one (the layer runs inside ``torch.func.grad``,
``jacrev``, ...), LayerNorm and a BatchNorm without running statistics run as means, a
variance and elementwise ops, whose batching rules and derivatives of every order are
torch's ordinary ones. The values agree with the fused kernels to rounding. Eval-mode
BatchNorm (a fixed affine map of the input) keeps its kernel, and a train-mode one that
tracks running statistics keeps funcensemble's other rules (torch refuses its in-place
update of a captured buffer inside ``torch.func.grad``).
"""

from typing import Any

import torch
from torch import Tensor


def layer_norm(
    input: Tensor,
    normalized_shape: Any,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """``F.layer_norm``: normalized over the last ``len(normalized_shape)`` dims."""
    count = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    dims = tuple(range(-count, 0))
    centered = input - input.mean(dims, keepdim=True)
    var = centered.square().mean(dims, keepdim=True)
    out = centered * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


def batch_norm(
    input: Tensor,
    running_mean: None,
    running_var: None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = True,
    momentum: Any = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """``F.batch_norm`` without running statistics: normalized by the batch's own."""
    dims = [0, *range(2, input.dim())]
    shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
    mean = input.mean(dims).view(shape)
    centered = input - mean
    var = centered.square().mean(dims).view(shape)
    out = centered * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out
