"""torch's own functions, told apart from a user's replacement of one.

A user may replace a function torch's modules call (``F.layer_norm = logged``, in a
notebook, before or after ``import funcensemble``). The loop's modules then call the
replacement once per call. Two places of ours must do the same:

- the MLP fast path, which calls no module and so none of those functions: it steps
  aside while any is replaced ([`called_unchanged`][]);
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

import os
import types
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def torch_own(fn: Any) -> bool:
    """Whether ``fn`` is torch's own: a builtin, or Python code in torch's files (a
    user's replacement, even one made before funcensemble was imported or dressed with
    ``functools.wraps``, runs code of the user's; torch's tracers patch with torch's)."""
    if isinstance(fn, types.BuiltinFunctionType):
        return True
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith(_TORCH_DIR)


def _foreign(fn: Any) -> bool:
    """Whether ``fn`` is Python code outside torch (other callables are left alone)."""
    code = getattr(fn, "__code__", None)
    return code is not None and not code.co_filename.startswith(_TORCH_DIR)


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
_SEEN: dict[Any, Any] = {}  # a function outside torch -> what a mode runs for it


def original(func: Any) -> Any:
    """The torch function a mode should run for ``func``: ``func`` itself, or, for a
    user's replacement of a torch function (``F.layer_norm = wrapper``), the torch
    function it replaced. Raises if that one was replaced before funcensemble was
    imported (it cannot be found: the replacement would run twice)."""
    if torch.compiler.is_compiling() or not _foreign(func):
        return func  # (Dynamo cannot trace the look at the code: compiled, as given)
    found = _SEEN.get(func)
    if found is not None:
        return found
    for (module, name), own in _AT_IMPORT.items():
        if getattr(module, name, None) is func:
            if own is None:
                raise RuntimeError(
                    f"{module.__name__}.{name} was replaced before funcensemble was "
                    "imported, and the ensemble's calls inside vmap would run the "
                    "replacement twice for one call of the members' modules (expected "
                    f"torch's own {name} under that name when funcensemble is imported, "
                    "got a replacement). Import funcensemble before replacing it."
                )
            _SEEN[func] = own
            return own
    _SEEN[func] = func  # a function of the user's own that dispatches like torch's
    return func


# The functions torch's forwards of the plain-MLP classes call, looked up at each call.
_CALLED = (
    (F, ("linear", "relu", "silu", "mish", "gelu", "leaky_relu", "elu", "softplus", "dropout")),
    (torch, ("tanh", "sigmoid", "relu", "relu_")),
)
_CALLED_AT_IMPORT = [getattr(where, name) for where, names in _CALLED for name in names]
_CALLED_ARE_TORCH_OWN = all(torch_own(f) for f in _CALLED_AT_IMPORT)


def called_unchanged() -> bool:
    """Whether every function the plain MLP's forwards call is torch's, as at import."""
    k = 0
    for where, names in _CALLED:
        for name in names:
            if getattr(where, name) is not _CALLED_AT_IMPORT[k]:
                return False
            k += 1
    return _CALLED_ARE_TORCH_OWN


def module_calls_are_torch_own(kind: type) -> bool:
    """Whether instances of ``kind`` are called as torch defines it: a wrapper of
    ``nn.Module.__call__`` (a profiler's or logger's, class-wide) is the user's; torch's
    own tracers (symbolic tracing, make_fx, export) wrap it with code of torch's."""
    return (kind.__call__ is _MODULE_CALLS[0] or torch_own(kind.__call__)) and (
        kind._call_impl is _MODULE_CALLS[1] or torch_own(kind._call_impl)
    )


_MODULE_CALLS = (nn.Module.__call__, nn.Module._call_impl)
