"""Ensemble outputs handed back as the loop's ``torch.stack`` hands them: never a tensor
autograd saved for the backward, so the caller may change them in place."""

from typing import Any

import torch
from torch import Tensor

from .. import _torch_compat, _tree


def _saved_as_result(t: Tensor) -> bool:
    """Whether autograd saved ``t``'s memory as the result of the op that made it (a
    last ``Sigmoid``, ``Tanh`` or ``ReLU``: its backward reads its own output)."""
    base = t._base if t._base is not None else t
    node = base.grad_fn
    if node is None:
        return False
    try:
        saved = getattr(node, "_saved_result", None)  # torch's own ops
        if saved is None:  # a custom autograd.Function (the fast path's layers)
            saved = getattr(node, "saved_tensors", ())
    except RuntimeError:  # already freed: nothing left to protect
        return False
    ptr = base.untyped_storage().data_ptr()
    found = saved if isinstance(saved, tuple) else (saved,)
    return any(isinstance(s, Tensor) and s.untyped_storage().data_ptr() == ptr for s in found)


@torch.compiler.disable  # eager only: its callers return a traced call's outputs as they are
def not_saved(out: Any) -> Any:
    """``out`` with a copy of every output that autograd also saved for the backward.

    The loop's ``torch.stack`` of the members' outputs is a fresh tensor, which the
    caller may change in place (``out.mul_(2)``) before ``backward()``. Handed back
    as it is, an ensemble output that a last activation saved would make that
    backward fail ("modified by an inplace operation").
    """
    if (
        not torch.is_grad_enabled()
        or torch.compiler.is_compiling()  # a compiled graph's outputs are its own
        or _torch_compat.inside_transform()  # wrapped tensors: not autograd's saved ones
    ):
        return out

    def fresh(t: Any) -> Any:
        saved = isinstance(t, Tensor) and t.requires_grad and _saved_as_result(t)
        return t.clone() if saved else t

    return fresh(out) if isinstance(out, Tensor) else _tree.tree_map(fresh, out)
