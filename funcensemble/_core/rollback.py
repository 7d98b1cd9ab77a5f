"""Tensors that a failed call updated in place are put back as they were.

In train mode a normalization layer (BatchNorm, InstanceNorm with
``track_running_stats``) updates its running statistics in place during the forward,
before the layers after it run (as do ``spectral_norm``'s power iteration and
``Embedding(max_norm=...)``, see ``_structure.updated_in_place``). When a later layer
raises, the call returns nothing but the tensors would stay updated.
[`vmap`][funcensemble.vmap] (and so ``Ensemble.forward``) runs the call inside a
transaction over the stacked parameters and buffers it was given; each
``FunctionalModule`` call inside it first saves a copy of the tensors it is about to
update (a few ``[N, C]`` tensors, once per call), and the transaction writes the
copies back if the call raises.
"""

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

from .. import _torch_compat


class _Transaction:
    __slots__ = ("buffers", "params", "rows", "saved")

    def __init__(self, buffers: Mapping[str, Any], params: Mapping[str, Any]) -> None:
        self.buffers, self.params = buffers, params
        # Whole tensors by identity (the tensor kept with its copy), and row updates in
        # the order they were made (a table updated twice: undone last to first).
        self.saved: dict[int, tuple[Tensor, Tensor]] = {}
        self.rows: list[tuple[Tensor, tuple[Tensor, ...], Tensor]] = []

    def save(self, names: list[str]) -> None:
        for name in names:
            t = self.buffers.get(name, self.params.get(name))
            if isinstance(t, Tensor) and id(t) not in self.saved:
                self.saved[id(t)] = (t, t.detach().clone())

    def restore(self) -> None:
        with torch.no_grad():
            for t, index, old in reversed(self.rows):
                t.index_put_(index, old)
            for t, old in self.saved.values():
                t.copy_(old)

    def hand_to(self, parent: "_Transaction") -> None:
        """This transaction ended well inside ``parent``: a failure of the rest of
        ``parent``'s block puts back what this one saved too (the older copy kept)."""
        for key, entry in self.saved.items():
            parent.saved.setdefault(key, entry)
        parent.rows.extend(self.rows)


_current: ContextVar[_Transaction | None] = ContextVar("funcensemble_rollback", default=None)


class _Rollback:
    """The transaction as a context object: entered on every vmap call, so no generator."""

    __slots__ = ("parent", "token", "transaction")

    def __init__(self, buffers: Mapping[str, Any], params: Mapping[str, Any]) -> None:
        self.transaction = _Transaction(buffers, params)

    def __enter__(self) -> None:
        self.parent = _current.get()
        self.token = _current.set(self.transaction)

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        try:
            if kind is not None and not _torch_compat.ends_recomputation(kind):
                self.transaction.restore()
            elif self.parent is not None:  # (a checkpoint's early stop is no failure)
                self.transaction.hand_to(self.parent)
        finally:
            _current.reset(self.token)


@contextlib.contextmanager
def _untracked() -> Iterator[None]:
    yield


def rollback_on_error(buffers: Any, params: Any = None) -> contextlib.AbstractContextManager:
    """Run a block; if it raises, put the buffers (and parameters, such as an
    ``Embedding``'s renormalised weight) saved by ``save_before_update`` back."""
    if torch.compiler.is_compiling() or not isinstance(buffers, Mapping):
        return _untracked()
    return _Rollback(buffers, params if isinstance(params, Mapping) else {})


def save_rows_before_update(t: Tensor, index: tuple[Tensor, ...]) -> None:
    """Save ``t[index]`` (advanced indexing: rows of a table about to be written in
    place, such as ``Embedding(max_norm)``'s renormalised rows) in the innermost open
    transaction, if any: a whole large table is not copied for a few rows."""
    if torch.compiler.is_compiling():
        return
    transaction = _current.get()
    if transaction is not None:
        transaction.rows.append((t, index, t[index].clone()))


def save_before_update(names: list[str]) -> None:
    """Save the named buffers of the innermost open transaction, if any, before an update."""
    if torch.compiler.is_compiling():
        return  # no transaction is opened while compiling (see rollback_on_error)
    transaction = _current.get()
    if transaction is not None and names:
        transaction.save(names)
