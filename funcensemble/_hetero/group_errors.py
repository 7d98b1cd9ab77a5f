"""Errors raised inside one group of a ``HeteroEnsemble``, naming the group's members."""

import contextlib
from collections.abc import Iterator, Sequence

# Errors whose one argument is their message (a KeyError's is the key: left as it is).
_NAMED = (ValueError, RuntimeError, TypeError)


@contextlib.contextmanager
def naming(where: str, g: int, members: Sequence[int], groups: int) -> Iterator[None]:
    """Run group ``g``'s part of a call; an error says which group and members it was.

    The error itself is raised on, its message (a single string argument of a
    ValueError, RuntimeError or TypeError) prefixed with the group once: its type,
    attributes, notes and traceback stay. With one group every member is in it, and
    other errors are left as they are.

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
        prefix = f"{where}: in group {g} (members {list(members)}): "
        message = error.args[0] if len(error.args) == 1 else None
        if groups > 1 and isinstance(message, str) and not message.startswith(prefix):
            # (A message naming the same call already: the call is named once.)
            error.args = (prefix + message.removeprefix(f"{where}: "),)
        raise
