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

from .. import _torch_compat


def _signature(fn: Any) -> inspect.Signature | None:
    """``fn``'s own signature: not the one a ``functools.wraps`` decorator points to (it
    may supply arguments itself) but torch.compile's (which passes everything on), and
    the user's loss behind funcensemble's own wrapper (``_signature_of``)."""
    target = getattr(fn, "_signature_of", fn)
    # torch.compile's wrapper passes everything on: the compiled function's decides.
    target = _torch_compat.compiled_original(target) or target
    try:
        return inspect.signature(target, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin or an object without one
        return None


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    count = f"{len(args)} input{'s' if len(args) != 1 else ''}"
    return count + (f" and keyword arguments {sorted(kwargs)}" if kwargs else "")


def refuse_an_ensemble(where: str, name: str, fn: Any, *, with_fmodel: bool = False) -> None:
    """Refuse an ``fe.Ensemble`` (or ``HeteroEnsemble``) given where a function of one
    member is expected: it runs every member itself, and would be called with one
    member's params and buffers as its inputs."""
    from .._hetero.ensemble import HeteroEnsemble  # (both import this module's users)
    from .ensemble import Ensemble

    if isinstance(fn, Ensemble | HeteroEnsemble):
        kind = "HeteroEnsemble" if isinstance(fn, HeteroEnsemble) else "Ensemble"
        arguments = "fmodel, params, buffers" if with_fmodel else "params, buffers"
        fix = (
            "Pass a loss calling the fmodel it is given: e.g. def loss_fn(fmodel, params, "
            "buffers, x, y): return F.mse_loss(fmodel(params, buffers, x), y)."
            if with_fmodel
            else "Pass ens.fmodel, or a function calling it: e.g. def loss_fn(params, "
            "buffers, x, y): return F.mse_loss(ens.fmodel(params, buffers, x), y)."
        )
        raise TypeError(
            f"{where}: {name} is an fe.{kind}, which runs every member itself (expected "
            f"a function of ONE member, called as {name}({arguments}, *inputs)). {fix}"
        )


def refuse_a_module_of_inputs(where: str, name: str, fn: Any) -> None:
    """Refuse an ordinary ``nn.Module`` whose ``forward`` takes only inputs (such as
    ``nn.Linear(3, 2)``) where a function of one member's ``(params, buffers, *inputs)``
    is expected: it would be called with the member's parameters as its inputs."""
    if not isinstance(fn, nn.Module):
        return
    signature = _signature(fn.forward)
    if signature is None:
        return
    try:
        signature.bind(None, None)
    except TypeError:
        module = type(fn).__name__
        takes = signature.replace(return_annotation=inspect.Signature.empty)
        raise TypeError(
            f"{where}: {name} is an nn.Module ({module}) whose forward takes "
            f"{takes} (expected a function of ONE member's parameters, called as "
            f"{name}(params, buffers, *inputs)). To run N such modules as one, build "
            f"fe.Ensemble([...]) of them and call it, or map the fmodel fe.stack gives: "
            f"fmodel, params, buffers = fe.stack(modules); fe.vmap(fmodel)(params, buffers, x)."
        ) from None


def arguments_error(
    where: str,
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leading: tuple[str, ...] = ("params", "buffers"),
) -> TypeError | None:
    """A clear ``TypeError`` if ``fn(params, buffers, *args, **kwargs)`` (or, for a
    ``FunctionalModule``, the members' ``forward(*args, **kwargs)``) cannot be called
    with these arguments; ``None`` if it can (the error came from inside it).
    ``leading``: what ``fn`` is given before the inputs (a ``HeteroEnsemble``'s loss
    takes its member's ``fmodel`` first)."""
    signature = _signature(fn)
    if signature is None:
        return None
    try:
        signature.bind(*[None] * len(leading), *args, **kwargs)
    except TypeError as why:
        name = getattr(fn, "__name__", type(fn).__name__)
        first = ", ".join(leading)
        given = ", ".join(leading[:-1]) + f" and {leading[-1]}"
        count = {2: "two", 3: "three"}.get(len(leading), str(len(leading)))
        return TypeError(
            f"{where}: the function is called for each member as {name}({first}, "
            f"*inputs, **kwargs), here with {first} and {_inputs(args, kwargs)}, "
            f"which its signature {signature} cannot take (expected its first {count} "
            f"parameters to take one member's {given}, then the inputs; got: {why}). "
            f"Define it as e.g. def loss_fn({first}, x, y), calling "
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
            f"{_inputs(args, kwargs)} given (expected the arguments one member's "
            f"{type(skeleton).__name__}.forward takes; got: {why}). Pass the inputs its forward "
            "takes; a target for a loss goes to the loss, not the ensemble."
        )
    return None
