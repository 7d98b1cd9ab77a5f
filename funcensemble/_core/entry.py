"""The public entry point a call came through, for the messages of the layers below it.

``fe.vmap``, ``fe.value_and_grad``, ``fe.grad`` and an ``Ensemble`` call all run the
member's function through one mapped call; errors raised inside it (by the
``FunctionalModule``, the fast path) name the entry point the user called.
"""

import contextvars

_current: contextvars.ContextVar[tuple[str, bool]] = contextvars.ContextVar(
    "funcensemble_entry_point", default=("vmap", False)
)


def current() -> str:
    """The entry point of the call in progress (``"vmap"`` outside any)."""
    return _current.get()[0]


def forward_only() -> bool:
    """Whether the mapped function of the call in progress is the members' forward
    itself (an ``Ensemble`` call, ``fe.vmap(fmodel)``), with no code of the caller's
    running inside the call after it (a loss reading what a hook kept)."""
    return _current.get()[1]


def enter(where: str, *, forward_only: bool = False) -> contextvars.Token[tuple[str, bool]]:
    """Mark a call through ``where`` as in progress; undo with ``leave``."""
    return _current.set((where, forward_only))


def leave(token: contextvars.Token[tuple[str, bool]]) -> None:
    _current.reset(token)
