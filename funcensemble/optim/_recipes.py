"""How each of the library's transforms was built, so member surgery can rebuild it.

A transform holds its hyperparameters in closures. The public constructors (``adam``,
``sgd``, ``chain``, ...) are wrapped by ``rebuildable``, which records the call; member
surgery rebuilds a transform from that record with the selected members' ``[N]``
per-member values (``_members.remap``).
"""

import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from torch import Tensor

F = TypeVar("F", bound=Callable[..., Any])
Recipe = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]

# Keyed by the transform's `update` function, like the traits in _protocol: a
# GradientTransformation is a plain NamedTuple of functions.
_RECIPES: "weakref.WeakKeyDictionary[Callable[..., Any], Recipe]" = weakref.WeakKeyDictionary()


def _snapshot(value: Any) -> Any:
    """``value`` with its tensors copied: a user's later in-place edit of their ``lr``
    tensor must not change what a rebuilt transform gets (the built one copied it)."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)) and not hasattr(type(value), "_fields"):
        return type(value)(_snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def rebuildable(factory: F) -> F:
    """Record each call of a public transform constructor under the transform it returns."""

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        out = factory(*args, **kwargs)
        _RECIPES[out.update] = (build, _snapshot(args), _snapshot(kwargs))
        return out

    return build  # type: ignore[return-value]


def record_recipe(t: Any, recipe: Recipe) -> None:
    """Record how transform ``t`` was built, for one whose constructor records it
    itself (see ``_partition``)."""
    _RECIPES[t.update] = recipe


def recipe_of(update: Callable[..., Any]) -> Recipe | None:
    """The recorded call that built the transform with this ``update``, or None."""
    try:
        return _RECIPES.get(update)
    except TypeError:  # an update that cannot be weakly referenced: the user's own
        return None
