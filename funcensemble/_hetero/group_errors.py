"""Errors raised inside one group of a ``HeteroEnsemble``, naming the group's members."""

import contextlib
from collections.abc import Iterator, Sequence

# Re-raised as the same type with the group named; other types (a user's own) pass as
# they are, since their constructors may take other arguments.
_NAMED = (ValueError, RuntimeError, TypeError)


@contextlib.contextmanager
def naming(where: str, g: int, members: Sequence[int], groups: int) -> Iterator[None]:
    """Run group ``g``'s part of a call; an error says which group and members it was.

    With one group every member is in it: the error is left as it is.

    Example:
        >>> try:
        ...     with naming("HeteroEnsemble", 1, [1, 3], groups=2):
        ...         raise ValueError("vmap: layer `0` expects 5 input features")
        ... except ValueError as e:
        ...     print(e)
        HeteroEnsemble: in group 1 (members [1, 3]): vmap: layer `0` expects 5 input features
    """
    try:
        yield
    except _NAMED as error:
        if groups == 1 or type(error) not in _NAMED:
            raise
        raise type(error)(f"{where}: in group {g} (members {list(members)}): {error}") from error
