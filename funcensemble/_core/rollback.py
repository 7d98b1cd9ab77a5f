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


class _Transaction:
    __slots__ = ("buffers", "params", "saved")

    def __init__(self, buffers: Mapping[str, Any], params: Mapping[str, Any]) -> None:
        self.buffers, self.params = buffers, params
        self.saved: dict[str, tuple[Tensor, Tensor]] = {}

    def save(self, names: list[str]) -> None:
        for name in names:
            if name in self.saved:
                continue
            t = self.buffers.get(name, self.params.get(name))
            if isinstance(t, Tensor):
                self.saved[name] = (t, t.detach().clone())

    def restore(self) -> None:
        with torch.no_grad():
            for t, old in self.saved.values():
                t.copy_(old)


_current: ContextVar[_Transaction | None] = ContextVar("funcensemble_rollback", default=None)


class _Rollback:
    """The transaction as a context object: entered on every vmap call, so no generator."""

    __slots__ = ("token", "transaction")

    def __init__(self, buffers: Mapping[str, Any], params: Mapping[str, Any]) -> None:
        self.transaction = _Transaction(buffers, params)

    def __enter__(self) -> None:
        self.token = _current.set(self.transaction)

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        try:
            if kind is not None:
                self.transaction.restore()
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


def save_before_update(names: list[str]) -> None:
    """Save the named buffers of the innermost open transaction, if any, before an update."""
    if torch.compiler.is_compiling():
        return  # no transaction is opened while compiling (see rollback_on_error)
    transaction = _current.get()
    if transaction is not None and names:
        transaction.save(names)
