"""Calls that ``vmap`` cannot batch as written, rewritten into the same math that it can.

When a ``FunctionalModule`` runs inside a ``torch.func`` transform (funcensemble's
``vmap``, with or without ``grad`` inside it), one ``TorchFunctionMode`` intercepts a few
functional calls:

- ``F.batch_norm``: all members as one call over ``N * C`` channels, and BatchNorm's
  ``float(num_batches_tracked)`` with ``momentum=None`` (see ``_batchnorm``);
- ``torch._weight_norm`` (``torch.nn.utils.parametrizations.weight_norm``): its kernel
  has no batching rule; it is ``v * (g / norm of v over every dim but dim)``, written
  here with ``torch.linalg.vector_norm``;
- ``F.normalize(..., out=buffer)`` (the power iteration of
  ``torch.nn.utils.parametrizations.spectral_norm`` in train mode): ``out=`` has no
  batching rule; the result is computed, then copied into ``out`` in place, so each
  member's ``_u``/``_v`` buffers are updated exactly as the loop updates them;
- ``F.adaptive_avg_pool{1,2,3}d`` to an output of size 1: PyTorch computes a mean over
  the spatial dims and then, for a ``channels_last`` input, restrides the result in
  place (``as_strided_``), which has no batching rule. The mean is computed here
  directly (the same values; only the output's memory layout can differ);
- ``F.layer_norm``, and ``F.batch_norm`` with batch statistics none kept, under a grad
  transform: as elementary ops, with torch's checks (see ``_norm_decomposed``);
- ``F.layer_norm``, ``F.batch_norm``, ``F.group_norm`` and ``F.instance_norm`` in a call
  whose tensors
  (inputs, parameters, buffers) have more than one floating dtype: vmap's rules promote
  parameters or statistics of another dtype than the input, where torch's kernels (the
  loop) refuse them or, for float32 ones with a float16/bfloat16 input, return the
  input's dtype; here they are refused, or computed, as the kernels do;
- ``F.group_norm`` on a ``channels_last`` input: its kernel asks the input's memory
  format, which vmap cannot answer; the input is made contiguous first (the same values);
- ``F.embedding`` of an ``nn.Embedding``: vmap's rule checks no index against the
  member's own table (one member's out-of-range index reads another member's row),
  keeps only member 0's padding row out of the gradient and cannot renormalise in
  place; each member's own embedding is computed instead (see ``_embedding``).

The mode is entered only for skeletons holding a layer that makes these calls
(checked on every call: submodules may change), so other models pay nothing.
"""

import contextlib
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations
from torch.overrides import TorchFunctionMode

from .. import _torch_compat, _tree
from .._core import entry as _entry
from . import batchnorm as _batchnorm
from . import norm_decomposed as _norm_decomposed
from . import torch_functions as _torch_functions
from .autocast_policy import CONVOLUTIONS
from .embedding import PerMemberEmbedding, embedding_per_member, needs_embedding_rule

# The norms whose kernels take a float32 layer with a float16/bfloat16 input.
_NORMS = (F.layer_norm, F.batch_norm, F.group_norm, F.instance_norm)
_POOLS = {F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3}
_POOL_LAYERS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_NORM_LAYERS = (parametrizations._WeightNorm, parametrizations._SpectralNorm)


def _weight_norm(v: Tensor, g: Tensor, dim: int = 0) -> Tensor:
    # torch.norm_except_dim's convention: dim=-1 means the norm over every dim.
    if dim == -1:
        norm = torch.linalg.vector_norm(v)
    else:
        keep = dim % v.dim()
        others = [d for d in range(v.dim()) if d != keep]
        norm = torch.linalg.vector_norm(v, 2, dim=others, keepdim=True)
    return v * (g / norm)


def _global_pool(spatial: int, input: Tensor, output_size: Any) -> Tensor | None:
    sizes = output_size if isinstance(output_size, (tuple, list)) else (output_size,) * spatial
    if not isinstance(input, Tensor) or input.dim() < spatial + 1 or len(sizes) != spatial:
        return None
    if spatial == 1 and input.dim() > 3:
        # torch's adaptive_avg_pool1d takes [C, L] or [N, C, L] only (and refuses this, as
        # in the loop); the 2d and 3d kinds, to size 1, take any leading dims.
        return None
    dims = tuple(range(-spatial, 0))
    if any(
        not (s == 1 or (s is None and input.shape[d] == 1))
        for s, d in zip(sizes, dims, strict=True)
    ):
        return None
    return input.mean(dims, keepdim=True)


def _on_cpu(t: Any) -> bool:
    return isinstance(t, Tensor) and t.device.type == "cpu"


def _autocast_fp32(t: Any) -> Any:
    """``t`` as autocast's float32 policy casts it: a float tensor other than float64."""
    eligible = isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
    return t.float() if eligible else t


# Layers whose batching rules under vmap run below autocast, in the operands' dtype:
# their operands (input, weight, bias) are cast here as autocast casts the loop's.
_AUTOCAST_CAST = (F.linear, *CONVOLUTIONS)
_OPERANDS = ("input", "weight", "bias")


def _autocast_cast(device_types: tuple[str, ...], func: Any, args: Any, kwargs: Any) -> Tensor:
    """``func`` (one of ``_AUTOCAST_CAST``) with its operands cast as autocast casts them
    (float tensors other than float64, on a device it is on for, to its dtype there)."""

    def cast(t: Any) -> Any:
        eligible = (
            isinstance(t, Tensor)
            and t.is_floating_point()
            and t.dtype != torch.float64
            and t.device.type in device_types
        )
        return t.to(_torch_compat.autocast_dtype(t.device.type)) if eligible else t

    args = tuple(cast(a) if i < len(_OPERANDS) else a for i, a in enumerate(args))
    kwargs = {k: cast(v) if k in _OPERANDS else v for k, v in kwargs.items()}
    return func(*args, **kwargs)


def _no_autocast_attention() -> None:
    raise RuntimeError(
        "MultiheadAttention under torch.autocast: inside vmap its matrix products run "
        "below autocast, in float32, where the loop's run in the autocast dtype "
        "(expected no autocast around an ensemble with attention layers). Run the "
        "ensemble outside torch.autocast, or convert its members to the low-precision "
        "dtype (.to(torch.bfloat16)) instead."
    )


class VmapRewrites(TorchFunctionMode):
    """Within this mode, the calls listed in the module docstring run batchable math."""

    def __init__(
        self,
        batch_norm: _batchnorm.BatchNormRule | None,
        autocast: tuple[str, ...] = (),
        *,
        decompose_norms: bool = False,
        check_dtypes: bool = False,
        skeleton: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.batch_norm = batch_norm
        self.autocast = autocast  # the device types torch.autocast is on for
        self.decompose_norms = decompose_norms  # under a grad transform (_norm_decomposed)
        self.check_dtypes = check_dtypes  # the norms' dtypes, which vmap's rules promote
        self.skeleton = skeleton  # to name a LayerNorm in messages

    def _layer_norm(
        self,
        input: Tensor,
        normalized_shape: Any,
        weight: Tensor | None = None,
        bias: Tensor | None = None,
        eps: float = 1e-5,
    ) -> Tensor:
        wrong = _norm_decomposed.layer_norm_mismatch(input, normalized_shape, weight, bias)
        if wrong is not None:
            raise RuntimeError(f"{self._layer_norm_name(normalized_shape, weight)}: {wrong}")
        if input.device.type == "cuda" and "cuda" in self.autocast:
            # CUDA autocast runs layer_norm in float32 (CPU autocast leaves its dtype be).
            input, weight, bias = (_autocast_fp32(t) for t in (input, weight, bias))
        return _norm_decomposed.layer_norm(input, normalized_shape, weight, bias, eps)

    def _in_kernel_dtypes(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``F.layer_norm``, ``F.batch_norm`` or ``F.group_norm`` in the dtypes their
        kernels take: one dtype for the layer's tensors, the input's or float32 with a
        float16/bfloat16 input, whose result is rounded to the input's dtype (vmap's
        rules promote the one and return float32 for the other)."""
        if func in (F.batch_norm, F.instance_norm):
            bound = (
                _batch_norm_arguments(*args, **kwargs)
                if func is F.batch_norm
                else _instance_norm_arguments(*args, **kwargs)
            )
            named = dict(
                zip(("running_mean", "running_var", "weight", "bias"), bound[1:5], strict=True)
            )
        else:  # layer_norm and group_norm: (input, shape or groups, weight, bias, eps)
            bound = _layer_norm_arguments(*args, **kwargs)
            named = {"weight": bound[2], "bias": bound[3]}
        input = bound[0]
        tensors = [t for t in named.values() if t is not None]
        if not isinstance(input, Tensor) or not all(isinstance(t, Tensor) for t in tensors):
            return self._rewritten(func, args, kwargs)  # torch's own errors
        if func is F.instance_norm and bound[3] is None:
            # Without a weight, torch 2.13's instance_norm converts its statistics to the
            # input's dtype, as vmap's rule does; torch 2.6's computes in float32, where
            # vmap's rule refuses the dtypes ("expected scalar type"): that route then.
            try:
                return self._rewritten(func, args, kwargs)
            except RuntimeError as error:
                if "expected scalar type" not in str(error):
                    raise
        wrong = _norm_decomposed.dtype_mismatch(input, **named)
        if wrong is not None:
            name = (
                self._layer_norm_name(bound[1], bound[2])
                if func is F.layer_norm
                else self._norm_name(bound)
            )
            raise RuntimeError(f"{name}: {wrong}")
        if any(t.dtype != input.dtype for t in tensors):
            # The kernels' own float32 arithmetic, rounded as they round (bit for bit in
            # the tests; instance_norm in eval mode with float16 may differ by a rounding).
            out = self._rewritten(func, (input.float(), *bound[1:]), {})
            return out.to(input.dtype)
        return self._rewritten(func, args, kwargs)

    def _norm_name(self, bound: tuple[Any, ...]) -> str:
        """The BatchNorm or GroupNorm layer holding these statistics or this weight, else
        ``batch_norm``/``group_norm``."""
        found = [
            name
            for name, m in (self.skeleton.named_modules() if self.skeleton is not None else ())
            if isinstance(m, nn.modules.batchnorm._NormBase | nn.GroupNorm)
            and any(
                t is not None and t is u for t, u in zip(bound[1:5], _norm_tensors(m), strict=True)
            )
        ]
        if len(found) != 1:
            return "group_norm" if isinstance(bound[1], int) else "batch_norm"
        kind = type(self.skeleton.get_submodule(found[0])).__name__
        return f"{kind} `{found[0]}`" if found[0] else kind

    def _layer_norm_name(self, normalized_shape: Any, weight: Tensor | None) -> str:
        """The ``nn.LayerNorm`` that passed ``weight`` (the module holds it during the call),
        or the only one without a weight of this shape; else ``layer_norm``."""
        found = [
            name
            for name, m in (self.skeleton.named_modules() if self.skeleton is not None else ())
            if isinstance(m, nn.LayerNorm)
            and m.weight is weight
            and list(m.normalized_shape) == list(normalized_shape)
        ]
        if len(found) != 1:
            return "layer_norm"
        return f"LayerNorm `{found[0]}`" if found[0] else "LayerNorm"

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        func = _torch_functions.original(func)  # (a user's replacement runs once)
        if func is F.group_norm:
            args, kwargs = _row_major_input(args, kwargs)
        if self.check_dtypes and func in _NORMS:
            return self._in_kernel_dtypes(func, args, kwargs)
        return self._rewritten(func, args, kwargs)

    def _rewritten(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``func(*args, **kwargs)``, or the rewrite this mode runs instead."""
        if self.decompose_norms and func is F.layer_norm:
            _refuse_under_a_users_mode(func)
            return self._layer_norm(*args, **kwargs)
        if self.decompose_norms and func is F.batch_norm:
            bound = _batch_norm_arguments(*args, **kwargs)
            # Batch statistics, none kept (in eval mode torch refuses that, as in the loop).
            if bound[5] and bound[1] is None and bound[2] is None:
                _refuse_under_a_users_mode(func)
                return _norm_decomposed.batch_norm(*bound)
        if func is F.batch_norm:
            out = self.batch_norm.batch_norm(args, kwargs) if self.batch_norm else None
            if out is not None:
                return out
        elif func in (Tensor.__float__, Tensor.item) and args and self.batch_norm:
            count = self.batch_norm.step_count(args[0])
            if count is not None:
                return count
        elif func is F.embedding:
            return embedding_per_member(*args, **kwargs)
        elif func is F.binary_cross_entropy_with_logits:
            _refuse_mixed_logits(*args, **kwargs)
        elif func in _AUTOCAST_CAST and self.autocast:
            return _autocast_cast(self.autocast, func, args, kwargs)
        elif func is F.multi_head_attention_forward and self.autocast:
            _no_autocast_attention()
        elif func is torch._weight_norm:
            return _weight_norm(*args, **kwargs)
        elif func is F.normalize and kwargs.get("out") is not None:
            out = kwargs.pop("out")
            return out.copy_(func(*args, **kwargs))
        elif func in _POOLS and args:
            size = args[1] if len(args) > 1 else kwargs.get("output_size")
            input = args[0]
            if func is F.adaptive_avg_pool3d and "cpu" in self.autocast and _on_cpu(input):
                input = _autocast_fp32(input)  # on CPU autocast's float32 list
            pooled = _global_pool(_POOLS[func], input, size)
            if pooled is not None:
                return pooled
        return func(*args, **kwargs)


def _refuse_mixed_logits(input: Any, target: Any, *args: Any, **kwargs: Any) -> None:
    """Refuse ``F.binary_cross_entropy_with_logits`` of two floating dtypes: torch's
    kernel computes the loss in place in a tensor of the target's dtype (a float64
    input with a float32 target, as ``(h > 0).float()`` gives, returns float32), which
    its vmap rule does not (float64): the loop's dtype, and its values to a rounding."""
    if isinstance(input, Tensor) and _torch_compat.autocast_enabled(input.device.type):
        return  # (on autocast's float32 list: both operands float32, in the loop as here)
    kinds = [t.dtype for t in (input, target) if isinstance(t, Tensor) and t.is_floating_point()]
    if len(kinds) == 2 and kinds[0] != kinds[1]:
        raise TypeError(
            "binary_cross_entropy_with_logits: the input is "
            f"{str(kinds[0]).removeprefix('torch.')} and the target "
            f"{str(kinds[1]).removeprefix('torch.')} (expected one dtype: the loop's kernel "
            "rounds the loss to the target's dtype, which the members' vectorized call "
            f"cannot repeat, got {kinds[0]} and {kinds[1]}). Cast the target: "
            "target.to(input.dtype)."
        )


def _row_major_input(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``F.group_norm``'s input made contiguous: on a ``channels_last`` input (a UNet's
    convolutions) its kernel asks the input's memory format, which vmap cannot answer
    ("NYI: querying is_contiguous inside of vmap"); the values are the same."""
    if args and isinstance(args[0], Tensor):
        return (args[0].contiguous(), *args[1:]), kwargs
    if isinstance(kwargs.get("input"), Tensor):
        return args, {**kwargs, "input": kwargs["input"].contiguous()}
    return args, kwargs


def _refuse_under_a_users_mode(func: Any) -> None:
    """Refuse to compute ``func`` as elementary ops while a torch function mode of the
    user's is active: it would see those ops, not the call the loop's module makes (a
    dispatch mode sees aten ops either way)."""
    if _torch_compat.foreign_function_mode_active():
        name = func.__name__
        raise RuntimeError(
            f"{_entry.current()}: inside torch.func.grad under fe.vmap (yours, or "
            "fe.value_and_grad's inside another transform or torch.compile), the ensemble "
            f"computes F.{name} as elementary ops, which a torch function mode of your "
            f"own, active here, would see instead of the F.{name} call the loop's module "
            "makes (expected no function mode of your own around such a call, got one). "
            "Call it outside your mode, or take the gradient with fe.value_and_grad, or "
            f"loss.backward() on the module face, which call F.{name} itself."
        )


def _layer_norm_arguments(
    input: Tensor,
    normalized_shape: Any,
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
) -> tuple[Any, ...]:
    return input, normalized_shape, weight, bias, eps


def _instance_norm_arguments(
    input: Tensor,
    running_mean: Any = None,
    running_var: Any = None,
    weight: Any = None,
    bias: Any = None,
    use_input_stats: bool = True,
    momentum: Any = 0.1,
    eps: float = 1e-5,
) -> tuple[Any, ...]:
    return input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps


def _norm_tensors(m: nn.Module) -> tuple[Any, ...]:
    """A norm layer's tensors in ``_batch_norm_arguments``' order after the input
    (``_layer_norm_arguments``' for a GroupNorm: its weight and bias at the same places)."""
    if isinstance(m, nn.GroupNorm):
        return None, m.weight, m.bias, None
    return m.running_mean, m.running_var, m.weight, m.bias


def _batch_norm_arguments(
    input: Tensor,
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: bool = False,
    momentum: Any = 0.1,
    eps: float = 1e-5,
) -> tuple[Any, ...]:
    return input, running_mean, running_var, weight, bias, training, momentum, eps


def _float_dtypes(tensors: Any) -> set[torch.dtype]:
    return {
        t.dtype
        for t in _tree.flatten(tensors)[0]
        if isinstance(t, Tensor) and t.is_floating_point()
    }


def vmap_rewrites(skeleton: nn.Module, tensors: Any = ()) -> contextlib.AbstractContextManager:
    """``VmapRewrites`` for a call of ``skeleton`` under a transform, if it needs one;
    ``tensors``: the call's inputs, parameters and buffers (a pytree)."""
    # A plain nullcontext otherwise, which torch.compile traces without a graph break.
    if not _torch_compat.inside_transform():
        return contextlib.nullcontext()
    # fe.stack's skeleton holds meta tensors: the members' devices are the inputs'.
    autocast = tuple(kind for kind in ("cpu", "cuda") if _torch_compat.autocast_enabled(kind))
    compiling = torch.compiler.is_compiling()
    embedding = needs_embedding_rule(skeleton, compiling=compiling)
    if compiling:
        # Only the embedding rule is traced; the others have no compiled use.
        return PerMemberEmbedding() if embedding else contextlib.nullcontext()
    norms = _batchnorm.norm_layers(skeleton)
    rule = _batchnorm.BatchNormRule(_batchnorm.cumulative(norms))
    fold = _batchnorm.has_batch_norm(norms)
    other = embedding or any(
        isinstance(m, _POOL_LAYERS + _NORM_LAYERS + (nn.GroupNorm, nn.BCEWithLogitsLoss))
        for m in skeleton.modules()
    )
    # A grad transform inside the vmap: LayerNorm and BatchNorm as elementary ops.
    decompose = _torch_compat.grad_innermost() and any(
        isinstance(m, (nn.LayerNorm, nn.modules.batchnorm._BatchNorm)) for m in skeleton.modules()
    )
    # Floating tensors of several dtypes: the norms' dtypes are checked as their
    # kernels check them (a call of one dtype cannot mix them, so pays nothing).
    # Under autocast too: it casts a layer's input and not the norm's parameters.
    # (With decomposed norms too: a GroupNorm, or a BatchNorm keeping statistics, is not.)
    check = bool(autocast) or len(_float_dtypes(tensors)) > 1
    if fold or other or autocast or decompose or check:
        return VmapRewrites(
            rule if fold else None,
            autocast,
            decompose_norms=decompose,
            check_dtypes=check,
            skeleton=skeleton,
        )
    return contextlib.nullcontext()
