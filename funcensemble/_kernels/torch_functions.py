"""torch's own functions, told apart from a user's replacement of one.

A user may replace a function torch's modules call (``F.layer_norm = logged``, in a
notebook, before or after ``import funcensemble``). The loop's modules then call the
replacement once per call. Two places of ours must do the same:

- the MLP fast path, which calls no module and so none of those functions: it steps
  aside while one that its layers' forwards call is replaced ([`calls_unchanged`][]);
- our torch function modes under ``vmap`` (``_rewrites.VmapRewrites``,
  ``_autocast_policy.CpuAutocastPolicy``): torch's own ``F.layer_norm`` hands a mode the
  function found under its own name, which is then the replacement, already running
  (it called torch's). Calling that again would apply it twice; [`original`][] gives
  the torch function it replaced, which the mode runs (or rewrites) instead.

Example:
    >>> from torch.nn import functional as F
    >>> original(F.relu) is F.relu
    True
"""

import contextlib
import os
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .._core import entry as _entry

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def torch_own(fn: Any) -> bool:
    """Whether ``fn`` is torch's own: a builtin, or Python code in torch's files (a
    user's replacement, even one made before funcensemble was imported or dressed with
    ``functools.wraps``, runs code of the user's; torch's tracers patch with torch's)."""
    if isinstance(fn, types.BuiltinFunctionType):
        return True
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith(_TORCH_DIR)


# Where torch's modules look their functions up at each call.
_MODULES = (F, torch)
# torch's own function under each name at import; a name already replaced then maps to
# None: its original cannot be found any more.
_AT_IMPORT: dict[tuple[Any, str], Any] = {
    (module, name): (value if torch_own(value) else None)
    for module in _MODULES
    for name, value in vars(module).items()
    if callable(value) and not isinstance(value, type) and not name.startswith("__")
}
_OWN_IDS = {id(value) for value in _AT_IMPORT.values() if value is not None}
_SEEN: dict[Any, Any] = {}  # another callable -> what a mode runs for it


def original(func: Any) -> Any:
    """The torch function a mode should run for ``func``: ``func`` itself, or, for a
    user's replacement of a torch function (``F.layer_norm = wrapper``, a
    ``functools.partial``, a callable object), the torch function it replaced. Raises
    if that one was replaced before funcensemble was imported (it cannot be found: the
    replacement would run twice)."""
    if torch.compiler.is_compiling() or id(func) in _OWN_IDS:
        return func  # (compiled: as given, Dynamo traces no such look-up)
    try:
        found = _SEEN.get(func)
    except TypeError:  # unhashable: looked up each time
        found = None
    if found is not None:
        return found
    result = func  # a function of the user's own that dispatches like torch's, say
    for (module, name), own in _AT_IMPORT.items():
        if own is not func and getattr(module, name, None) is func:
            if own is None:
                raise RuntimeError(
                    f"{_entry.current()}: {module.__name__}.{name} was replaced before "
                    "funcensemble was imported, and the ensemble's calls inside vmap would "
                    "run the replacement twice for one call of the members' modules "
                    f"(expected torch's own {name} under that name when funcensemble is "
                    "imported, got a replacement). Import funcensemble before replacing it."
                )
            result = own
            break
    with contextlib.suppress(TypeError):  # (unhashable: not kept)
        _SEEN[func] = result
    return result


# The functions torch's forwards of the plain-MLP classes call, looked up at each call,
# as (class, ((module, name, torch's function at import), ...)): plain tuples and
# identity tests, which Dynamo traces (the fast path's plan runs compiled too).
_CALLS = tuple(
    (kind, tuple((module, name, _AT_IMPORT.get((module, name))) for module, name in calls))
    for kind, calls in (
        (nn.Linear, ((F, "linear"),)),
        (nn.Tanh, ((torch, "tanh"),)),
        (nn.ReLU, ((F, "relu"), (torch, "relu"), (torch, "relu_"))),
        (nn.Sigmoid, ((torch, "sigmoid"),)),
        (nn.SiLU, ((F, "silu"),)),
        (nn.Mish, ((F, "mish"),)),
        (nn.GELU, ((F, "gelu"),)),
        (nn.LeakyReLU, ((F, "leaky_relu"),)),
        (nn.ELU, ((F, "elu"),)),
        (nn.Softplus, ((F, "softplus"),)),
        (nn.Dropout, ((F, "dropout"),)),
    )
)


def calls_unchanged(kinds: Iterable[type]) -> bool:
    """Whether every function the forwards of modules of ``kinds`` call is torch's own
    (one replaced, before or after funcensemble's import, changes what they compute)."""
    kinds = list(kinds)
    for kind, calls in _CALLS:
        if kind in kinds:  # (a class compares by identity)
            for module, name, at_import in calls:
                now = getattr(module, name)
                if now is not at_import and not torch_own(now):
                    return False
    return True


def module_calls_are_torch_own(kind: type) -> bool:
    """Whether instances of ``kind`` are called as torch defines it: a wrapper of
    ``nn.Module.__call__`` (a profiler's or logger's, class-wide) is the user's; torch's
    own tracers (symbolic tracing, make_fx, export) wrap it with code of torch's."""
    return (kind.__call__ is _MODULE_CALLS[0] or torch_own(kind.__call__)) and (
        kind._call_impl is _MODULE_CALLS[1] or torch_own(kind._call_impl)
    )


_MODULE_CALLS = (nn.Module.__call__, nn.Module._call_impl)
