"""Where an object's optimizer step counts are, for loading either count layout.

A step count is one tensor shared by the members (0-dim) while they have all stepped
together, and one per member (``[N]``) once members joined later (``concat``). A
checkpoint of either layout loads into an optimizer state of either: the loaded state
takes the checkpoint's. ``fe.load`` and ``fe.distributed.load`` find the counts here.
"""

from collections.abc import Callable
from typing import Any

import optree
from torch import Tensor

from ..optim._ensemble_optimizer import EnsembleOptimizer
from ..optim._members import count_mask, count_sizes
from .paths import flatten_by_key, path_key


def count_paths(
    where: str, obj: Any, *, key: Callable[[optree.PyTreeAccessor], str] = path_key
) -> dict[str, int | None]:
    """The paths (named by ``key``) of ``obj``'s step counts, each with its member count
    (its own state's: a HeteroEnsemble's groups differ in N; else the tree's).

    ``obj`` is an ``EnsembleOptimizer`` (its ``state_dict()`` paths) or a pytree.
    """
    if isinstance(obj, EnsembleOptimizer):
        # state_dict() lists the state's leaves in their flattening order.
        keys = obj.state_dict()["state"]
        marked = {"state": dict(zip(keys, count_mask(obj.state), strict=True))}
        sized = {"state": dict(zip(keys, count_sizes(obj.state), strict=True))}
        n: int | None = obj._num_members() if obj.params else None
    else:
        leaves, spec = optree.tree_flatten(obj, none_is_leaf=True)
        mask = count_mask(obj)
        marked = optree.tree_unflatten(spec, mask)
        sized = optree.tree_unflatten(spec, count_sizes(obj))
        leading = {
            leaf.shape[0]
            for leaf, is_count in zip(leaves, mask, strict=True)
            if isinstance(leaf, Tensor) and leaf.dim() > 0 and not is_count
        }
        n = leading.pop() if len(leading) == 1 else None
    flags, _ = flatten_by_key(where, marked, (bool,), "a flag", key=key)
    sizes, _ = flatten_by_key(where, sized, (int,), "a member count", key=key)
    return {path: (sizes[path] if sizes[path] >= 0 else n) for path in flags if flags[path]}


def layout_as_saved(
    mine: Any, n: int | None, saved_shape: tuple[int, ...], saved_dtype: Any, saved_n: int
) -> Tensor | None:
    """A zero tensor in the saved layout to load into, in place of the step count
    ``mine`` (whose state holds ``n`` members), or None where no conversion applies.

    ``saved_shape`` is the saved count's shape, ``()`` or ``(saved_n,)``: ``saved_n``
    is the checkpoint's member count, of which this object holds ``n`` (all of them,
    or one rank's share of a sharded checkpoint).
    """
    if not isinstance(mine, Tensor) or n is None or saved_dtype != mine.dtype:
        return None
    shape = tuple(mine.shape)
    if shape == () and saved_shape == (saved_n,):
        return mine.new_zeros((n,))
    if shape == (n,) and saved_shape == ():
        return mine.new_zeros(())
    return None
