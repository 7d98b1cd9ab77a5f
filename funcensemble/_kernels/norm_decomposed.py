"""LayerNorm and train-mode BatchNorm as elementary ops, for a grad transform under vmap.

torch's batching rules for the backward kernels of ``native_layer_norm`` and
``native_batch_norm`` are wrong for ``grad_input`` when that backward is itself
differentiated (pytorch/functorch#534): a gradient penalty or a meta-gradient written
per member, ``torch.func.grad`` inside the mapped function, gets wrong second
derivatives for the layers before the norm (tens of percent off), where the loop's
double backward is exact. First derivatives are right.

So when a grad transform is the innermost one (the layer runs inside ``torch.func.grad``,
``jacrev``, ...), the norms run as means, a variance and elementwise ops, whose batching
rules and derivatives of every order are torch's ordinary ones. The values agree with
the fused kernels to rounding. Eval-mode BatchNorm (a fixed affine map of the input)
keeps its kernel.
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


def batch_norm_uses_batch(training: bool, running_mean: Any, running_var: Any) -> bool:
    """Whether ``F.batch_norm`` normalizes by the batch's statistics."""
    return training or running_mean is None or running_var is None


def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """``F.batch_norm`` with the batch's statistics; running ones updated as torch does."""
    dims = [0, *range(2, input.dim())]
    shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
    mean = input.mean(dims)
    var = (input - mean.view(shape)).square().mean(dims)
    if training and running_mean is not None and running_var is not None:
        if not isinstance(momentum, float):
            raise NotImplementedError(
                "BatchNorm in train mode with momentum=None (a cumulative average) inside "
                "torch.func.grad under funcensemble's vmap is not supported (expected a "
                "float momentum). Give the layer a float momentum, or compute the second "
                "derivative on the module face (ens(x) with create_graph=True)."
            )
        count = input.numel() // input.shape[1]
        with torch.no_grad():
            unbiased = var.detach() * (count / max(count - 1, 1))
            running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
            running_var.mul_(1 - momentum).add_(unbiased * momentum)
    out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out
