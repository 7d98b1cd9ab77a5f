"""Errors raised inside one group of a ``HeteroEnsemble``, naming the group's members."""

import contextlib
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def naming(where: str, g: int, members: Sequence[int], groups: int) -> Iterator[None]:
    """Run group ``g``'s part of a call; an error says which group and members it was.

    The error itself is raised on, its message (a single string argument) prefixed with
    the group: its type, attributes, notes and traceback stay. With one group every
    member is in it, and an error with other arguments is left as it is.

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
    except Exception as error:
        if groups > 1 and len(error.args) == 1 and isinstance(error.args[0], str):
            error.args = (f"{where}: in group {g} (members {list(members)}): {error.args[0]}",)
        raise
