"""CPU autocast's per-op dtype policy, applied inside vmap as eager autocast applies it.

``torch.func.vmap`` runs an op's batching rule above autocast, so the kernels it calls
are cast by their own names, not the op's: ``addmm`` becomes ``mm`` plus ``add`` (float32
where the loop's ``addmm`` returns bfloat16), ``mv`` becomes ``mm`` (bfloat16 where the
loop's ``mv`` stays float32), and ops on autocast's float32 list (``cross_entropy``,
``trace``) run in their operands' dtype. While CPU autocast is on, one
``TorchFunctionMode`` applies autocast's policy to each call that a member's forward or a
loss makes of an op in ``_POLICY``, and runs the op with CPU autocast off, as autocast's
own kernels redispatch below it:

- ``"lower"`` (CPU autocast's lower-precision list): floating operands other than
  float64, on CPU, cast to autocast's dtype;
- ``"rounded"`` (the same list, for kernels that accumulate in float32 and round once:
  ``addmm``, ``baddbmm``, the convolutions, ``F.linear`` where torch fuses its bias into
  one ``addmm``): cast so, then computed in float32 and rounded to autocast's dtype
  once, as the kernel rounds (their batching rules would round the product, then the
  sum with the bias); bfloat16 only (under float16 they are ``"lower"``);
- ``"fp32"`` (its float32 list): those operands cast to float32;
- ``"off"``: ops autocast leaves alone whose batching rules call ops it casts;
- ``"refused"``: ``addbmm``, whose kernel rounds after each batch's product, which
  neither its batching rule nor one float32 computation does.

Operands autocast does not cast (float64, integers, tensors on another device) and
calls with an ``out=`` tensor run as written.

The table holds the ops whose results under vmap differ from the loop's without it,
found by comparing the two, for float32 and bfloat16 operands, in dtype and bits; each
entry is checked in ``tests/test_autocast_policy.py``. Calls inside a Python-level torch
function (``F.multi_head_attention_forward``) are not seen, only the function itself.

This is CPU autocast only. Under CUDA autocast ``_kernels/rewrites.py`` casts the
operands of a member's ``F.linear`` and convolutions, and nothing more.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .. import _torch_compat
from . import torch_functions as _torch_functions


def _linear(input: Any, weight: Any, bias: Any = None) -> str:
    # torch's linear runs addmm (one rounding) for a 2-d input with a bias, and for a
    # contiguous input with a bias when it is 3-d or the bias is 1-d (flattened to 2-d);
    # otherwise matmul, then the bias added (two roundings).
    if not isinstance(bias, Tensor) or not isinstance(input, Tensor):
        return "lower"
    flattened = input.is_contiguous() and (input.dim() == 3 or bias.dim() == 1)
    return "rounded" if input.dim() == 2 or flattened else "lower"


# Whether eager CPU autocast casts torch.inner of two vectors, per autocast dtype: it
# runs dot (left alone) in recent torch, a cast product in older ones (2.6). Asked
# once, eagerly, outside any transform (see CpuAutocastPolicy.__init__).
_INNER_OF_VECTORS_CAST: dict[torch.dtype, bool] = {}


def _probe_inner(dtype: torch.dtype) -> None:
    if dtype not in _INNER_OF_VECTORS_CAST:
        with torch.autocast("cpu", dtype=dtype):
            out = torch.inner(torch.ones(2), torch.ones(2))
        _INNER_OF_VECTORS_CAST[dtype] = out.dtype == dtype


def _inner(input: Any, other: Any) -> str | None:
    # torch's inner of two vectors: see _INNER_OF_VECTORS_CAST; of matrices, a cast
    # matmul, which vmap's rule already casts.
    vectors = all(isinstance(t, Tensor) and t.dim() <= 1 for t in (input, other))
    if not vectors:
        return None
    cast = _INNER_OF_VECTORS_CAST.get(_torch_compat.autocast_dtype("cpu"), False)
    return "lower" if cast else "off"


# Whether eager CPU autocast's transposed convolutions round once from float32, per
# autocast dtype: they do where oneDNN runs them in bfloat16 (AVX-512 CPUs); on CPUs
# without it torch's own kernel adds the overlapping patches in bfloat16 (col2im),
# rounding each sum, which the same kernel under vmap repeats bit for bit. Asked once,
# eagerly, on a case whose sums round otherwise (see CpuAutocastPolicy.__init__).
_TRANSPOSED_ROUND_ONCE: dict[torch.dtype, bool] = {}


def _probe_transposed(dtype: torch.dtype) -> None:
    if dtype not in _TRANSPOSED_ROUND_ONCE:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(2, 8, 6, 6, generator=g), torch.randn(8, 4, 3, 3, generator=g)
        with torch.autocast("cpu", dtype=dtype):
            eager = F.conv_transpose2d(x, w)
        with torch.autocast("cpu", enabled=False):
            once = F.conv_transpose2d(x.to(dtype).float(), w.to(dtype).float()).to(dtype)
        _TRANSPOSED_ROUND_ONCE[dtype] = torch.equal(eager, once)


# The convolutions, on autocast's lower-precision list (rewrites.py casts them too).
CONVOLUTIONS = (
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
)
_TRANSPOSED = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
_LOWER = (
    torch.linalg.vecdot,
    torch.prelu,  # F.prelu
    Tensor.prelu,
    F.scaled_dot_product_attention,
)
_ROUNDED = (
    torch.addmm,
    Tensor.addmm,
    torch.baddbmm,
    Tensor.baddbmm,
    *CONVOLUTIONS,
)
_FP32 = (
    F.cross_entropy,
    F.nll_loss,
    F.l1_loss,
    F.binary_cross_entropy_with_logits,
    F.poisson_nll_loss,
    F.hinge_embedding_loss,
    F.cosine_embedding_loss,
    torch.trace,
    Tensor.trace,
    F.max_pool3d,
    F.adaptive_avg_pool3d,
    torch.cdist,
    torch.pinverse,
    Tensor.pinverse,
    torch.linalg.solve,
    torch.linalg.eigvalsh,
    torch.linalg.svdvals,
    torch.fft.fft,
    torch.fft.ifft,
    torch.fft.fft2,
    torch.fft.ifft2,
    torch.fft.fftn,
    torch.fft.ifftn,
    torch.fft.rfft,
    torch.fft.irfft,
    torch.fft.rfft2,
    torch.fft.irfft2,
    torch.fft.rfftn,
    torch.fft.irfftn,
    torch.fft.hfft,
    torch.fft.ihfft,
)
_REFUSED = (torch.addbmm, Tensor.addbmm)
_OFF = (torch.mv, Tensor.mv, torch.dot, Tensor.dot, torch.vdot, Tensor.vdot)
_OFF += (torch.addmv, Tensor.addmv)

# op -> its policy, or a function of the call's arguments that returns it (or None).
_POLICY: dict[Any, str | Callable[..., str | None]] = {
    **dict.fromkeys(_LOWER, "lower"),
    **dict.fromkeys(_ROUNDED, "rounded"),
    **dict.fromkeys(_FP32, "fp32"),
    **dict.fromkeys(_OFF, "off"),
    **dict.fromkeys(_REFUSED, "refused"),
    F.linear: _linear,
    torch.inner: _inner,
    Tensor.inner: _inner,
}


class CpuAutocastPolicy(TorchFunctionMode):
    """Within this mode, the ops of ``_POLICY`` run as eager CPU autocast runs them;
    ``where`` (the entry point the user called) names the refusals."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        _probe_inner(_torch_compat.autocast_dtype("cpu"))
        _probe_transposed(_torch_compat.autocast_dtype("cpu"))

    @staticmethod
    def _eligible(t: Any) -> bool:
        """A tensor autocast casts: floating, not float64, on the CPU."""
        return (
            isinstance(t, Tensor)
            and t.is_floating_point()
            and t.dtype != torch.float64
            and t.is_cpu
        )

    def _any_eligible(self, args: Any, kwargs: Any) -> bool:
        for a in (*args, *kwargs.values()):
            items = a if type(a) in (list, tuple) else (a,)
            if any(self._eligible(t) for t in items):
                return True
        return False

    def _cast(self, tree: Any, dtype: torch.dtype) -> Any:
        """``tree``'s eligible tensors as ``dtype``, also inside a list or tuple."""
        if isinstance(tree, Tensor):
            return tree.to(dtype) if self._eligible(tree) else tree
        if type(tree) in (list, tuple):
            return type(tree)(self._cast(t, dtype) for t in tree)
        return tree

    def _cast_all(self, args: Any, kwargs: Any, dtype: torch.dtype) -> tuple[Any, Any]:
        return self._cast(args, dtype), {k: self._cast(v, dtype) for k, v in kwargs.items()}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        func = _torch_functions.original(func)  # (a user's replacement runs once)
        policy = _POLICY.get(func)
        if callable(policy):
            policy = policy(*args, **kwargs)
        if policy is None or kwargs.get("out") is not None:
            # (An out= variant is on none of autocast's lists: the loop's runs as written.)
            return func(*args, **kwargs)
        if policy == "refused":
            raise ValueError(
                f"{self.where}: addbmm under CPU torch.autocast cannot be computed inside "
                "vmap as the loop computes it (expected no addbmm in an ensemble's forward "
                "or loss under autocast, got a call of it): its kernel rounds to the "
                "autocast dtype after each batch's product. Write it as torch.addmm calls, "
                "one per batch (the same values), or call it outside torch.autocast."
            )
        dtype = _torch_compat.autocast_dtype("cpu")
        if policy in ("lower", "rounded", "fp32") and not self._any_eligible(args, kwargs):
            # Nothing autocast would cast (float64, integers, other devices): as written.
            policy = "off"
        if policy == "rounded" and dtype != torch.bfloat16:
            # The one rounding from float32 was checked against bfloat16 kernels only.
            policy = "lower"
        if policy == "rounded" and func in _TRANSPOSED and not _TRANSPOSED_ROUND_ONCE[dtype]:
            policy = "lower"  # the loop's kernel rounds each sum: its own, under vmap
        if policy in ("lower", "rounded"):
            args, kwargs = self._cast_all(args, kwargs, dtype)
        if policy in ("rounded", "fp32"):
            args, kwargs = self._cast_all(args, kwargs, torch.float32)
        with torch.autocast("cpu", enabled=False):
            out = func(*args, **kwargs)
        return out.to(dtype) if policy == "rounded" else out
