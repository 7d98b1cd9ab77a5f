"""Tensors a vectorized call left in Python containers that outlive it.

A member's ``forward`` or forward hook may keep what it computes in a list or dict
(``self.cache["h"] = h``, ``self.log.append(h)``, a hook's ``features[name] = out``).
The loop's members each keep their own value there. In one vectorized call the
skeleton module stands for every member, and what it keeps is ``torch.func``'s
internal wrapper of all members' values: it cannot be read after the call ("escaped
from inside a function being vmapped"), breaks copies and selections of the ensemble,
and the other members' containers (a hook's per-member dicts) keep stale values,
without an error.

[`check_module`][] looks, after the forward of each vectorized call, in the containers a call
can reach without running user code: the modules' own attributes, the values their
forward hooks and pre-hooks captured (closure, defaults, ``functools.partial``
arguments, a bound method's object) and the module-level names those hooks and the
members' own ``forward`` refer to. A wrapped tensor there is removed and the call
refused. Attributes re-assigned on the module itself (``self.prev = out``) are
``_forward_state``'s.
"""

import collections
import functools
import types
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from .. import _torch_compat

_CONTAINERS = (list, dict, set, collections.deque)
_MODULE_OWN = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
_SCANNED = 256  # elements looked at per container: appends land last, so the last ones
_DEPTH = 3


def _from_user_code(kind: type) -> bool:
    return not kind.__module__.startswith(("torch.", "funcensemble."))


def _globals_named(code: types.CodeType, names: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for name in code.co_names:
        value = names.get(name)
        if isinstance(value, _CONTAINERS):
            yield name, value


def _captured(fn: Any) -> Iterator[tuple[str, Any]]:
    """The containers a hook function can reach: what it captured and the module-level
    names it uses."""
    while isinstance(fn, functools.partial):
        yield from (("an argument", v) for v in (*fn.args, *fn.keywords.values()))
        fn = fn.func
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        if not isinstance(owner, nn.Module):  # a module's own attributes are seen as such
            yield from ((f"self.{k}", v) for k, v in vars(owner).items())
        fn = fn.__func__
    if not isinstance(fn, types.FunctionType):
        return
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield name, cell.cell_contents
        except ValueError:  # a cell not yet assigned
            continue
    yield from (("a default", v) for v in fn.__defaults__ or ())
    yield from (fn.__kwdefaults__ or {}).items()
    yield from _globals_named(code, fn.__globals__)


def roots(sub: nn.Module, seen_forwards: set[int]) -> Iterator[tuple[str, Any]]:
    """``(what it is in ``sub``, container)`` for every container a call can write into
    through ``sub``: its attributes, its forward hooks' captures, the module-level
    names its own ``forward`` uses (once per ``forward`` in ``seen_forwards``)."""
    own = vars(sub)
    for name in own.keys() - _MODULE_OWN:  # (one set operation: most have none)
        value = own[name]
        if isinstance(value, _CONTAINERS):
            yield f"attribute `{name}`", value
    if sub._forward_hooks or sub._forward_pre_hooks:
        for table in _HOOKS:
            kind = "forward pre-hook" if table == "_forward_pre_hooks" else "forward hook"
            for hook in getattr(sub, table).values():
                label = getattr(hook, "__name__", type(hook).__name__)
                for name, value in _captured(hook):
                    if isinstance(value, _CONTAINERS):
                        yield f"`{name}`, used by its {kind} {label},", value
    forward = type(sub).forward
    if id(forward) in seen_forwards or not _from_user_code(type(sub)):
        return
    seen_forwards.add(id(forward))
    if isinstance(forward, types.FunctionType):
        for name, value in _globals_named(forward.__code__, forward.__globals__):
            yield f"the module-level `{name}` its forward uses", value


def _elements(container: Any) -> list[tuple[Any, Any]]:
    """``(key, value)`` of the last ``_SCANNED`` elements (key: a dict key, else the
    value itself)."""
    if isinstance(container, dict):
        items = list(container.items())
    else:
        items = [(v, v) for v in container]
    return items[-_SCANNED:]


def _escaped(container: Any, depth: int = 0) -> Iterator[tuple[Any, Any]]:
    """``(container, key)`` of every wrapped tensor inside, nested containers included."""
    for key, value in _elements(container):
        if isinstance(value, Tensor):
            if _torch_compat.is_wrapped(value):
                yield container, key
        elif depth < _DEPTH and isinstance(value, (*_CONTAINERS, tuple)):
            if isinstance(value, tuple):
                if any(isinstance(v, Tensor) and _torch_compat.is_wrapped(v) for v in value):
                    yield container, key  # a tuple cannot lose an element: drop it whole
                    continue
                inner = [v for v in value if isinstance(v, _CONTAINERS)]
                for v in inner:
                    yield from _escaped(v, depth + 1)
            else:
                yield from _escaped(value, depth + 1)


def _remove(container: Any, key: Any) -> None:
    if isinstance(container, dict):
        container.pop(key, None)
    elif isinstance(container, set):
        container.discard(key)
    else:
        for i in reversed(range(len(container))):
            if container[i] is key:
                del container[i]


def _needs_a_look(sub: nn.Module, seen: set[int]) -> bool:
    """A quick test, run on every module at every call: whether ``roots`` can find
    anything (a container attribute, a hook, a user ``forward`` not yet looked at)."""
    if sub._forward_hooks or sub._forward_pre_hooks:
        return True
    kind = type(sub)
    user = _USER_CLASSES.get(kind)
    if user is None:
        user = _USER_CLASSES[kind] = _from_user_code(kind)
    if user and id(kind.forward) not in seen:
        return True
    own = vars(sub)
    known = _ATTRIBUTES.get(id(sub))
    if known is None or known[0] != len(own):  # (an attribute added or deleted)
        if len(_ATTRIBUTES) > 100_000:
            _ATTRIBUTES.clear()
        known = _ATTRIBUTES[id(sub)] = (len(own), tuple(own.keys() - _MODULE_OWN))
    return any(isinstance(own.get(name), _CONTAINERS) for name in known[1])


_USER_CLASSES: dict[type, bool] = {}
# id(module) -> (how many attributes it had, the names beyond nn.Module's own): the set
# difference costs more than the rest of the test. (A module freed and another made at
# its address with as many attributes at worst goes unlooked at: never a refusal.)
_ATTRIBUTES: dict[int, tuple[int, tuple[str, ...]]] = {}


def check_module(where: str, skeleton: nn.Module, sub: nn.Module, seen: set[int]) -> None:
    """Refuse (after removing them) tensors of this call left in the containers a call
    reaches through ``sub``, a module of ``skeleton`` (see ``roots``)."""
    if not _needs_a_look(sub, seen):
        return
    for what, container in roots(sub, seen):
        found = list(_escaped(container))
        if not found:
            continue
        for inner, key in found:
            _remove(inner, key)
        path = next((p for p, m in skeleton.named_modules() if m is sub), "")
        module = f"`{path}` ({type(sub).__name__})" if path else type(sub).__name__
        raise ValueError(
            f"{where}: a tensor computed from the members' data was left in {what} of "
            f"{module}, a container outliving the call: in one vectorized call the module "
            "stands for every member, so what it keeps there is torch.func's internal "
            "tensor of all members at once, which cannot be read after the call, and "
            "each member's own container would not get its value (expected state in "
            "registered buffers, or values returned). Return the value from forward "
            "(the ensemble stacks it per member, e.g. as a second output), or register "
            "a buffer and update it in place; the entries were removed."
        )
