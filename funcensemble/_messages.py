"""The one error dialect: ``function: what is wrong (expected X, got Y). What to do.``

Small builders for the parts every message shares, so that the same thing is said the
same way everywhere: a name in backquotes, a list of names, an ensemble leaf's label
("parameter `0.weight`"), which keys are missing or extra, and the common argument
checks (a positive int).
"""

import ast
import numbers
from collections.abc import Callable, Iterable
from typing import Any


def quoted(name: object) -> str:
    """A name as messages show it: ``weight`` becomes ```weight```."""
    return f"`{name}`"


def names(keys: Iterable[Any], label: Callable[[Any], str] = quoted, limit: int = 0) -> str:
    """``keys``, sorted, labelled and comma-separated; past ``limit`` (if > 0), a count."""
    keys = sorted(keys, key=str)
    shown = keys[:limit] if limit > 0 else keys
    text = ", ".join(label(k) for k in shown)
    return text + (f" and {len(keys) - len(shown)} more" if len(shown) < len(keys) else "")


def a(noun: str) -> str:
    """``noun`` with its indefinite article: ``a float``, ``an int``, ``a uint8``,
    ``an AdamState``, ``an SGDState`` (a leading acronym is read letter by letter).

    Example:
        >>> from funcensemble._messages import a
        >>> [a(n) for n in ("int", "uint8", "AdamState", "SGDState", "ScheduleState")]
        ['an int', 'a uint8', 'an AdamState', 'an SGDState', 'a ScheduleState']
    """
    acronym = noun[:2].isupper()
    vowel = noun[:1] in tuple("AEFHILMNORSX" if acronym else "aeioAEIO")
    return f"{'an' if vowel else 'a'} {noun}"


def expected_got(expected: object, got: object) -> str:
    """The dialect's middle part: ``(expected X, got Y)``."""
    return f"(expected {expected}, got {got})"


def key_difference(
    missing: Iterable[Any],
    extra: Iterable[Any],
    *,
    kind: str = "",
    label: Callable[[Any], str] = quoted,
) -> str:
    """What a set of keys lacks and has too many of, after its subject: ``is missing
    parameters `a` and has extra parameters `b```; empty when both are empty.

    ``kind`` (e.g. ``"parameters"``) goes before each list; ``label`` names one key.

    Example:
        >>> from funcensemble._messages import key_difference
        >>> key_difference({"b", "a"}, {"c"}, kind="buffers")
        'is missing buffers `a`, `b` and has extra buffers `c`'
        >>> key_difference(set(), set())
        ''
    """
    missing, extra = list(missing), list(extra)
    noun = f"{kind} " if kind else ""
    parts = []
    if missing:
        parts.append(f"is missing {noun}{names(missing, label)}")
    if extra:
        parts.append(f"has extra {noun}{names(extra, label)}")
    return " and ".join(parts)


def ensemble_leaf(key: str) -> str:
    """The label of a leaf of an ensemble's ``{"params": ..., "buffers": ...}`` tree,
    keyed by its path (``['params']['0.weight']``): ``parameter `0.weight```; other
    paths as ``leaf `path```.

    Example:
        >>> from funcensemble._messages import ensemble_leaf
        >>> ensemble_leaf("['params']['0.weight']"), ensemble_leaf("['opt'].mu")
        ('parameter `0.weight`', "leaf `['opt'].mu`")
    """
    for group, word in (("params", "parameter"), ("buffers", "buffer")):
        prefix = f"[{group!r}]["
        if key.startswith(prefix) and key.endswith("]"):
            try:
                name = ast.literal_eval(key[len(prefix) : -1])
            except (ValueError, SyntaxError):
                break
            return f"{word} {quoted(name)}"
    return pytree_leaf(key)


def pytree_leaf(key: str) -> str:
    """The label of a pytree leaf by its path: ``leaf `['opt'].mu```."""
    return f"leaf {quoted(key)}"


def tensor_spec(dtype: object, shape: tuple[int, ...]) -> str:
    """A tensor as messages describe it, with its article: ``a float64 tensor of shape
    (3, 2)`` (``dtype`` a ``torch.dtype`` or its name)."""
    return f"{a(str(dtype).removeprefix('torch.'))} tensor of shape {tuple(shape)}"


def submodule(path: str) -> str:
    """The label of a submodule by its dotted path: ``submodule `net.0```, or ``the root
    module`` for the empty path."""
    return f"submodule {quoted(path)}" if path else "the root module"


def boolean(where: str, name: str, value: object) -> bool:
    """``value`` if it is a bool, else a ``TypeError`` in the house dialect naming
    ``where`` and the argument ``name``.

    Example:
        >>> from funcensemble._messages import boolean
        >>> boolean("f", "flag", True)
        True
    """
    if not isinstance(value, bool):
        raise TypeError(
            f"{where}: {name} must be a bool {expected_got('True or False', type(value).__name__)}"
            f". Pass {name}=True or {name}=False."
        )
    return value


def positive_int(where: str, name: str, value: object, *, or_none: bool = False) -> int:
    """``value`` if it is an int >= 1 (not a bool), else a ``TypeError``/``ValueError``
    in the house dialect naming ``where`` and the argument ``name``."""
    wanted, expected = "a positive int", "an int >= 1"
    if or_none:
        wanted, expected = f"{wanted} or None", f"{expected} or None"
    # numbers.Integral: a NumPy integer (a count read from an array) is an int too.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{where}: {name} must be {wanted} {expected_got(expected, type(value).__name__)}. "
            f"Pass {name} as {expected}."
        )
    value = int(value)
    if value < 1:
        raise ValueError(
            f"{where}: {name} must be {wanted} {expected_got(expected, repr(value))}. "
            f"Pass {name} as {expected}."
        )
    return value
