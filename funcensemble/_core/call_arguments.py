"""Clear errors for a mapped function that cannot take the arguments it is given.

``fe.vmap`` and ``fe.value_and_grad`` call the user's function for one member as
``fn(params, buffers, *inputs, **kwargs)``. A function written without the buffers
argument, or members' ``forward`` given one input too many, fails inside the
vectorized call with Python's bare ``<lambda>() takes 3 positional arguments but 4
were given``. These helpers say which call it was and what to write instead; they run
only after a ``TypeError``, so a call that works costs nothing.
"""

import inspect
from typing import Any

from torch import nn


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an object without one
        return None


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    count = f"{len(args)} input{'s' if len(args) != 1 else ''}"
    return count + (f" and keyword arguments {sorted(kwargs)}" if kwargs else "")


def refuse_an_ensemble(where: str, name: str, fn: Any) -> None:
    """Refuse an ``fe.Ensemble`` (or ``HeteroEnsemble``) given where a function of one
    member is expected: it runs every member itself, and would be called with one
    member's params and buffers as its inputs."""
    if isinstance(fn, nn.Module) and type(fn).__name__ in ("Ensemble", "HeteroEnsemble"):
        kind = type(fn).__name__
        raise TypeError(
            f"{where}: {name} is an fe.{kind}, which runs every member itself (expected "
            f"a function of ONE member, called as {name}(params, buffers, *inputs)). "
            f"Pass ens.fmodel, or a function calling it: e.g. "
            "def loss_fn(params, buffers, x, y): return F.mse_loss(ens.fmodel(params, "
            "buffers, x), y)."
        )


def arguments_error(
    where: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> TypeError | None:
    """A clear ``TypeError`` if ``fn(params, buffers, *args, **kwargs)`` (or, for a
    ``FunctionalModule``, the members' ``forward(*args, **kwargs)``) cannot be called
    with these arguments; ``None`` if it can (the error came from inside it)."""
    signature = _signature(fn)
    if signature is None:
        return None
    try:
        signature.bind(None, None, *args, **kwargs)
    except TypeError as why:
        name = getattr(fn, "__name__", type(fn).__name__)
        return TypeError(
            f"{where}: the function is called for each member as {name}(params, buffers, "
            f"*inputs, **kwargs), here with params, buffers and {_inputs(args, kwargs)}, "
            f"which its signature {signature} cannot take ({why}; expected its first two "
            "parameters to take one member's params and buffers, then the inputs). "
            "Define it as e.g. def loss_fn(params, buffers, x, y), calling "
            "fmodel(params, buffers, x) inside."
        )
    skeleton = getattr(fn, "skeleton", None)
    if not isinstance(skeleton, nn.Module):
        return None
    forward = _signature(skeleton.forward)
    if forward is None:
        return None
    try:
        forward.bind(*args, **kwargs)
    except TypeError as why:
        return TypeError(
            f"{where}: the members' forward{forward} cannot take the "
            f"{_inputs(args, kwargs)} given ({why}; expected the arguments one member's "
            f"{type(skeleton).__name__}.forward takes). Pass the inputs its forward "
            "takes; a target for a loss goes to the loss, not the ensemble."
        )
    return None
