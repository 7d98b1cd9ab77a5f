"""Ensemble outputs handed back as the loop's ``torch.stack`` hands them: a fresh tensor
per output, which the caller may change in place before ``backward()``.

Two ways a vectorized call's outputs differ from that, both fixed here by a copy:

- an output whose own op saved it for its backward (a last ``Sigmoid``, ``Tanh`` or
  ``ReLU``): changed in place, it would stop the backward ("modified by an inplace
  operation");
- an output sharing memory with another output (a member returning
  ``(h, h[..., :1])``), with the ensemble's parameters or buffers (a member returning
  ``self.scale``), with an input (a member returning its slice of the input) or with
  a tensor every member returned (a closed-over tensor, or an unregistered tensor
  attribute): changed in place, it would change those too, which the loop's stacks
  never do.

Which ops save their output is read from their backward node's class (a
``_saved_result`` attribute), never by unpacking a saved tensor: that would run
``saved_tensors_hooks`` (``torch.utils.checkpoint`` would recompute the forward).
"""

from typing import Any

import torch
from torch import Tensor

from .. import _torch_compat, _tree

_SAVES_RESULT: dict[type, bool] = {}


def _saves_itself(t: Tensor) -> bool:
    """Whether the op that made ``t`` (or the tensor ``t`` views) saved its result."""
    base = t if t._base is None else t._base
    node = base.grad_fn
    if node is None:
        return False
    cls = type(node)
    saves = _SAVES_RESULT.get(cls)
    if saves is None:
        saves = _SAVES_RESULT[cls] = "_saved_result" in dir(cls)
    return saves


def _same_for_all(t: Tensor) -> bool:
    """Whether ``t`` is an output every member returned the same tensor for: vmap hands
    it back expanded over the members (the member axis of stride 0), which an in-place
    op refuses; the loop's torch.stack is a tensor of its own."""
    return bool(t.dim()) and t.stride(0) == 0 and t.shape[0] > 1


def unbatched_copied(out: Any) -> Any:
    """``out``, returned by one member inside the call's own vmap, with a copy of each
    tensor the vmap does not batch (a closed-over tensor, a tensor attribute every
    member shares, or a view of one): vmap would hand back a view of that tensor
    itself, which an in-place change to the output would change (with one member
    silently). Outside a vmap, or while compiling, ``out`` as it is."""
    if torch.compiler.is_compiling():
        return out
    level = _torch_compat.vmap_level()
    if level is None:
        return out
    leaves, spec = _tree.flatten(out)
    copied = False
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor) and not _torch_compat.batched_at(leaf, level):
            leaves[k] = leaf.clone()
            copied = True
    return _tree.unflatten(spec, leaves) if copied else out


def _storages(*trees: Any) -> set[int]:
    """The storages of the tensors in ``trees`` (the state and inputs of a call)."""
    return {
        t.untyped_storage().data_ptr()
        for tree in trees
        for t in _tree.flatten(tree)[0]
        if isinstance(t, Tensor) and t.numel() and not _torch_compat.is_wrapped(t)
    }


@torch.compiler.disable  # eager only: its callers return a traced call's outputs as they are
def not_saved(out: Any, *held: Any, saved: bool = True) -> Any:
    """``out`` with a copy of every output its own op saved for the backward, and of
    every output sharing memory with an earlier one or with the tensors in ``held``
    (the call's parameters, buffers and inputs), or expanded over the members (see
    ``unbatched_copied``). ``saved=False``: outputs that are detached once the caller's
    own backward has run, for which the first copy protects nothing."""
    if torch.jit.is_tracing() or _torch_compat.inside_transform():
        # (A traced graph must not depend on grad mode; wrapped tensors are the
        # enclosing transform's to handle.)
        return out
    if isinstance(out, Tensor) and not held:
        return out.clone() if out.requires_grad and _saves_itself(out) else out
    leaves, spec = _tree.flatten(out)
    seen = _storages(*held)
    fresh = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            ptr = leaf.untyped_storage().data_ptr() if leaf.numel() else 0
            shared = ptr != 0 and ptr in seen
            seen.add(ptr)
            if _same_for_all(leaf):
                leaf = leaf.clone(memory_format=torch.contiguous_format)
            elif shared or (saved and leaf.requires_grad and _saves_itself(leaf)):
                leaf = leaf.clone()
        fresh.append(leaf)
    return _tree.unflatten(spec, fresh)
