"""Which member of the ensemble the first member of the current mapped call is.

A chunked call maps a slice of the members at a time; a message naming a member found
inside one (``nn.Embedding``'s index check) adds this offset to count from the
ensemble's first member, not the chunk's.
"""

import contextlib
import contextvars
from collections.abc import Iterator

_first = contextvars.ContextVar("funcensemble_first_member", default=0)


def first() -> int:
    """The ensemble index of the current call's first member (0 outside chunks)."""
    return _first.get()


@contextlib.contextmanager
def starting_at(index: int) -> Iterator[None]:
    """Within this block, the mapped call's first member is member ``index``."""
    token = _first.set(_first.get() + index)
    try:
        yield
    finally:
        _first.reset(token)
