"""Stable string keys for pytree leaves, as written into checkpoint files."""

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor, nn

from .._core.tree_view import state_view
from .._messages import a


def path_key(accessor: optree.PyTreeAccessor) -> str:
    """A leaf's path, e.g. ``['opt'].mu['w']``.

    Written out by hand rather than with ``accessor.codify()`` so that the keys in
    files do not change with optree's formatting.
    """
    parts = []
    for entry in accessor:
        if isinstance(entry, optree.NamedTupleEntry | optree.StructSequenceEntry):
            parts.append(f".{entry.field}")
        elif isinstance(entry, optree.GetAttrEntry):
            parts.append(f".{entry.name}")
        else:
            parts.append(f"[{entry.entry!r}]")
    return "".join(parts)


def dotted_key(accessor: optree.PyTreeAccessor) -> str:
    """A leaf's path as ``torch.distributed.checkpoint`` names nested state, e.g.
    ``opt.0.mu.net.0.weight``: dict keys, sequence indices and field names joined by dots."""
    parts = []
    for entry in accessor:
        if isinstance(entry, optree.NamedTupleEntry | optree.StructSequenceEntry):
            parts.append(str(entry.field))
        elif isinstance(entry, optree.GetAttrEntry):
            parts.append(entry.name)
        else:
            parts.append(str(entry.entry))
    return ".".join(parts)


def flatten_by_key(
    where: str,
    obj: Any,
    value_types: Any,
    values_text: str,
    *,
    key: Callable[[optree.PyTreeAccessor], str] = path_key,
) -> tuple[dict[str, Any], optree.PyTreeSpec]:
    """An Ensemble's stacked state (its registered view) or a pytree's leaves, keyed by
    [`path_key`][].

    Raises before anything is written: an ordinary module, two leaves with one key,
    or a leaf that is neither a tensor nor of one of the exact ``value_types``.
    """
    tree: Any = state_view(obj)  # an Ensemble: {"params": ..., "buffers": ...}
    if tree is None and isinstance(obj, nn.Module):
        raise TypeError(
            f"{where}: got a {type(obj).__name__}, an ordinary module (expected an "
            f"fe.Ensemble (or fe.HeteroEnsemble) or a pytree of tensors, got "
            f"{type(obj).__name__}). For an ordinary module, pass module.state_dict()."
        )
    if tree is None:
        tree = obj
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree)
    keys = [key(a) for a in accessors]
    if len(set(keys)) != len(keys):
        raise ValueError(
            f"{where}: two leaves of the pytree have the same path string; use dict keys "
            f"that differ as strings (and hold no dots, for sharded checkpoints). Paths: "
            f"{keys}."
        )
    if keys == [""] and not isinstance(obj, Tensor) and type(obj) not in value_types:
        raise TypeError(
            f"{where}: got {a(type(obj).__name__)}, which is neither an ensemble nor a pytree "
            f"of tensors (expected an fe.Ensemble (or fe.HeteroEnsemble) or a pytree of "
            f"tensors, got "
            f"{type(obj).__name__}). For a torch.optim optimizer, pass opt.state_dict() (an "
            "fe.optim.EnsembleOptimizer can be passed itself)."
        )
    for key, leaf in zip(keys, leaves, strict=True):
        # Exact types: subclasses (numpy.float64, IntEnum) would not come back as such.
        if not isinstance(leaf, Tensor) and type(leaf) not in value_types:
            if isinstance(leaf, torch.Generator):
                fix = (
                    "Save its state instead (gen.get_state(), a uint8 tensor) and put it "
                    "back on loading (gen.set_state(state))."
                )
            elif isinstance(leaf, nn.Module) or hasattr(leaf, "state_dict"):
                # An ensemble, a module or an optimizer inside the tree.
                fix = (
                    "Put its .state_dict() in the tree instead (an ensemble or an "
                    "EnsembleOptimizer can also be saved on its own: fe.save(path, obj))."
                )
            else:
                fix = "Convert it to one of those (e.g. float(x) or torch.as_tensor(x))."
            raise TypeError(
                f"{where}: leaf `{key}` is {a(type(leaf).__name__)} (expected "
                f"{values_text}, got {type(leaf).__name__}). {fix}"
            )
    return dict(zip(keys, leaves, strict=True)), treedef
