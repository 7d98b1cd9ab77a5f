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
torch's ordinary ones. The values agree with the fused kernels to rounding: like them,
a float16 or bfloat16 input is normalized in float32 (its square overflows float16 past
256), with BatchNorm's statistics rounded as the CPU kernel rounds them, and the result
rounded to the input's dtype. What the kernels refuse (shapes, dtypes, one value per
channel in training) is refused here too, with the same error class.
Eval-mode BatchNorm (a fixed affine map of the input) keeps its kernel, and a
train-mode one that tracks running statistics keeps funcensemble's other rules (torch
refuses its in-place update of a captured buffer inside ``torch.func.grad``).
"""

from typing import Any

import torch
from torch import Tensor

from .batchnorm import check_values_per_channel

_REDUCED = (torch.float16, torch.bfloat16)


def _compute_dtype(input: Tensor) -> torch.dtype:
    """The dtype the norm kernels compute in: float32 for a float16 or bfloat16 input."""
    return torch.float32 if input.dtype in _REDUCED else input.dtype


def dtype_mismatch(input: Tensor, **params: Tensor | None) -> str | None:
    """What the norm kernels refuse in the dtypes of ``params`` (weight, bias, running
    statistics), or ``None``: one dtype for all, the input's or float32 with a float16
    or bfloat16 input."""
    reduced = input.dtype in _REDUCED
    allowed = f"{input.dtype} or torch.float32" if reduced else str(input.dtype)
    given = [(name, p) for name, p in params.items() if p is not None]
    for name, p in given:
        if p.dtype != input.dtype and not (reduced and p.dtype == torch.float32):
            return (
                f"{name} of dtype {p.dtype} does not go with an input of dtype "
                f"{input.dtype} (expected {allowed}, got {p.dtype}). Convert the input or "
                "the layer to one dtype."
            )
    if len({p.dtype for _, p in given}) > 1:
        (first, a), (second, b) = (
            given[0],
            next((n, p) for n, p in given if p.dtype != given[0][1].dtype),
        )
        return (
            f"{second} of dtype {b.dtype} does not go with {first} of dtype {a.dtype} "
            f"(expected one dtype for the layer's tensors, got {a.dtype} and {b.dtype}). "
            "Convert the layer to one dtype."
        )
    return None


def layer_norm_mismatch(
    input: Tensor, normalized_shape: Any, weight: Tensor | None, bias: Tensor | None
) -> str | None:
    """What ``F.layer_norm`` refuses in these arguments (in one member's sizes), or ``None``."""
    shape = list(normalized_shape)
    if not shape:
        return "normalized_shape is empty (expected at least one size, got []). Pass one."
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and list(p.shape) != shape:
            return (
                f"{name} does not have the shape normalized_shape={shape} "
                f"(expected {shape}, got {list(p.shape)}). Give it that shape."
            )
    if list(input.shape[-len(shape) :]) != shape:
        return (
            f"the input does not end in normalized_shape={shape} (expected input of shape "
            f"[*, {', '.join(map(str, shape))}], got {list(input.shape)}). Set "
            "normalized_shape to the input's last sizes, or reshape the input."
        )
    return dtype_mismatch(input, weight=weight, bias=bias)


def layer_norm(
    input: Tensor,
    normalized_shape: Any,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """``F.layer_norm``, over the last ``len(normalized_shape)`` dims (checked by
    ``layer_norm_mismatch``)."""
    dtype = _compute_dtype(input)
    x = input.to(dtype)
    dims = tuple(range(-len(normalized_shape), 0))
    centered = x - x.mean(dims, keepdim=True)
    var = centered.square().mean(dims, keepdim=True)
    out = centered * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight.to(dtype)
    if bias is not None:
        out = out + bias.to(dtype)
    return out.to(input.dtype)


def _cpu_saved_statistics(
    low: torch.dtype, mean: Tensor, var: Tensor, count: int, eps: float
) -> tuple[Tensor, Tensor]:
    """The mean and inverse deviation from float32 ``mean`` and ``var``, rounded as torch's
    CPU batch_norm kernel rounds them when the parameters are float16 or bfloat16 too: it
    keeps them in that dtype, and for bfloat16 the sum of squares and the variance as well
    (CUDA keeps them all in float32)."""
    if low == torch.bfloat16:
        var = (var * count).to(low).float().div(count).to(low).float()
    return mean.to(low).float(), torch.rsqrt(var + eps).to(low).float()


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
    """Train-mode ``F.batch_norm`` without running statistics: normalized by the batch's own."""
    check_values_per_channel(input.shape)
    wrong = dtype_mismatch(input, weight=weight, bias=bias)
    if wrong is not None:
        raise RuntimeError(f"batch_norm: {wrong}")
    dtype = _compute_dtype(input)
    x = input.to(dtype)
    dims = [0, *range(2, x.dim())]
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    mean = x.mean(dims).view(shape)
    centered = x - mean
    var = centered.square().mean(dims).view(shape)
    if (
        dtype != input.dtype
        and input.device.type == "cpu"
        and all(p is None or p.dtype == input.dtype for p in (weight, bias))
    ):
        count = x.numel() // x.shape[1]
        mean, invstd = _cpu_saved_statistics(input.dtype, mean, var, count, eps)
        centered = x - mean
    else:
        invstd = torch.rsqrt(var + eps)
    out = centered * invstd
    if weight is not None:
        out = out * weight.to(dtype).view(shape)
    if bias is not None:
        out = out + bias.to(dtype).view(shape)
    return out.to(input.dtype)
