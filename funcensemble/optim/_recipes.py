"""How each of the library's transforms was built, so member surgery can rebuild it.

A transform holds its hyperparameters in closures. The public constructors (``adam``,
``sgd``, ``chain``, ...) are wrapped by ``rebuildable``, which records the call; member
surgery rebuilds a transform from that record with the selected members' ``[N]``
per-member values (``_members.remap``).
"""

import functools
import hashlib
import inspect
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
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
        # A transform by its update function; a schedule (a function) by itself.
        _RECIPES[getattr(out, "update", out)] = (build, _snapshot(args), _snapshot(kwargs))
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


# Transforms made of others without a call to record (a HeteroEnsemble's groups), by
# their update function: a name and the parts, described in turn.
_PARTS: "weakref.WeakKeyDictionary[Callable[..., Any], tuple[str, list[Any]]]" = (
    weakref.WeakKeyDictionary()
)


def record_parts(t: Any, name: str, parts: list[Any]) -> None:
    """Record that transform ``t`` runs ``parts`` (for [`describe`][] only)."""
    _PARTS[t.update] = (name, list(parts))


def describe(value: Any) -> str:
    """A transform (or hyperparameter) as the call that built it, with every value:
    ``adam(lr=0.01, betas=(0.9, 0.999), ...)``. Two transforms with one description
    step alike. A transform or schedule of the user's own, whose call was not recorded,
    is described by its kind only."""
    if hasattr(value, "update") and hasattr(value, "init"):
        parts = _PARTS.get(value.update)
        if parts is not None:
            each = [describe(p) for p in parts[1]]
            if len(set(each)) == 1:  # one transform in every group: as the plain one
                return each[0]
            return f"{parts[0]}({', '.join(each)})"
        return _call(recipe_of(value.update), "<a transform of your own>")
    if isinstance(value, Tensor):
        if value.numel() <= 8:
            shown = value.tolist()
        else:
            data = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
            shown = f"sha256:{hashlib.sha256(data.tobytes()).hexdigest()[:16]}"
        return (
            f"tensor({shown}, shape={list(value.shape)}, {str(value.dtype).removeprefix('torch.')})"
        )
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):  # in key order: the order it was built in does not count
        items = sorted(value.items(), key=lambda kv: repr(kv[0]))
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in items) + "}"
    if callable(value):
        return _call(recipe_of(value), "<a function of your own>")
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return repr(value)
    if type(value).__module__.startswith("funcensemble."):
        return repr(value)  # our own records (a partition's labels)
    return f"<a {type(value).__qualname__}>"  # (a repr may hold an address)


def _call(recipe: Recipe | None, unknown: str) -> str:
    if recipe is None:
        return unknown
    build, args, kwargs = recipe
    try:  # one description however the arguments were passed
        bound = inspect.signature(build).bind(*args, **kwargs)
        bound.apply_defaults()
        named = dict(bound.arguments)
    except (TypeError, ValueError):
        named = {**dict(enumerate(args)), **kwargs}
    shown = ", ".join(f"{k}={describe(v)}" for k, v in named.items())
    return f"{getattr(build, '__name__', 'transform')}({shown})"
