"""The public entry point a call came through, for the messages of the layers below it.

``fe.vmap``, ``fe.value_and_grad``, ``fe.grad`` and an ``Ensemble`` call all run the
member's function through one mapped call; errors raised inside it (by the
``FunctionalModule``, the fast path) name the entry point the user called.
"""

import contextvars

_current: contextvars.ContextVar[str] = contextvars.ContextVar(
    "funcensemble_entry_point", default="vmap"
)


def current() -> str:
    """The entry point of the call in progress (``"vmap"`` outside any)."""
    return _current.get()


def enter(where: str) -> contextvars.Token[str]:
    """Mark a call through ``where`` as in progress; undo with ``leave``."""
    return _current.set(where)


def leave(token: contextvars.Token[str]) -> None:
    _current.reset(token)
