"""Tensors a vectorized call left in Python containers that outlive it.

A member's ``forward`` or forward hook may keep what it computes in a list or dict
(``self.cache["h"] = h``, ``self.log.append(h)``, a hook's ``features[name] = out``).
The loop's members each keep their own value there. In one vectorized call the
skeleton module stands for every member, and what it keeps is ``torch.func``'s
internal wrapper of all members' values: it cannot be read after the call ("escaped
from inside a function being vmapped"), breaks copies and selections of the ensemble,
and the other members' containers (a hook's per-member dicts) keep stale values,
without an error.

[`check`][] looks, after the forward of a call that runs nothing of the caller's
after it (an ``Ensemble`` call, ``fe.vmap(fmodel)``), in the containers the call can
reach without running user code: the modules' own attributes, what their forward hooks
and pre-hooks captured (closure, defaults, ``functools.partial`` arguments, a bound
method's or a callable object's attributes) and the module-level names those hooks and
the members' own ``forward`` load as globals. A tensor put there by this call (not in
[`snapshot`][] before it), wrapped at this call's level or deeper, is removed and the
call refused. Tensors of the caller's own outer transform, and those an earlier call
left (a loss may read in its call what a hook kept), are not this call's. Each
container is looked at in its last ``_SCANNED`` entries (where appends land), nested
ones to ``_DEPTH``. Attributes re-assigned on the module itself (``self.prev = out``)
are ``_forward_state``'s.
"""

import collections
import dis
import functools
import itertools
import types
import weakref
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from .. import _torch_compat

_CONTAINERS = (list, dict, set, collections.deque)
_MODULE_OWN = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
_PLAIN = frozenset({int, float, str, bool, bytes, type(None)})  # skipped at once
_SCANNED = 256  # entries looked at per container, the last ones: appends land there
_DEPTH = 3


def _from_user_code(kind: type) -> bool:
    return not kind.__module__.startswith(("torch.", "funcensemble."))


_GLOBALS: dict[types.CodeType, tuple[str, ...]] = {}


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` loads as globals (``co_names`` holds attribute names too)."""
    names = _GLOBALS.get(code)
    if names is None:
        if len(_GLOBALS) > 10_000:
            _GLOBALS.clear()
        found = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
        names = _GLOBALS[code] = tuple(n for n in found if isinstance(n, str))
    return names


def _globals_used(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    space = fn.__globals__
    for name in _global_names(fn.__code__):
        value = space.get(name)
        if isinstance(value, _CONTAINERS):
            yield f"the module-level `{name}`", value


def _captured(fn: Any) -> Iterator[tuple[str, Any]]:
    """The containers a hook can reach: what it captured and the module-level names it
    loads."""
    while isinstance(fn, functools.partial):
        yield from (("an argument", v) for v in (*fn.args, *fn.keywords.values()))
        fn = fn.func
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        if not isinstance(owner, nn.Module):  # a module's own attributes are seen as such
            yield from ((f"`self.{k}`", v) for k, v in vars(owner).items())
        fn = fn.__func__
    if not isinstance(fn, types.FunctionType):
        if hasattr(fn, "__dict__") and not isinstance(fn, nn.Module):  # a callable object
            yield from ((f"`{type(fn).__name__}.{k}`", v) for k, v in vars(fn).items())
            call = next(
                (vars(k)["__call__"] for k in type(fn).__mro__ if "__call__" in vars(k)), None
            )
            if isinstance(call, types.FunctionType):
                yield from _globals_used(call)
        return
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield f"`{name}`", cell.cell_contents
        except ValueError:  # a cell not yet assigned
            continue
    yield from (("a default", v) for v in fn.__defaults__ or ())
    yield from ((f"`{k}`", v) for k, v in (fn.__kwdefaults__ or {}).items())
    yield from _globals_used(fn)


def _roots(sub: nn.Module, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """``(what it is in ``sub``, container)`` for every container a call can write into
    through ``sub`` (its own ``forward``'s globals once per ``forward`` in ``seen``)."""
    own = vars(sub)
    for name in _user_attributes(sub, own):
        if isinstance(own[name], _CONTAINERS):
            yield f"attribute `{name}`", own[name]
    if sub._forward_hooks or sub._forward_pre_hooks:
        for table in _HOOKS:
            kind = "forward pre-hook" if table == "_forward_pre_hooks" else "forward hook"
            for hook in getattr(sub, table).values():
                label = getattr(hook, "__name__", type(hook).__name__)
                for what, value in _captured(hook):
                    if isinstance(value, _CONTAINERS):
                        yield f"{what}, used by its {kind} {label},", value
    forward = type(sub).forward
    if isinstance(forward, types.FunctionType) and id(forward) not in seen:
        seen.add(id(forward))
        if _user_class(type(sub)):
            for what, value in _globals_used(forward):
                yield f"{what} its forward uses", value


_USER_CLASSES: dict[type, bool] = {}
# id(module) -> (the module, how many attributes it had, the names beyond nn.Module's
# own): the set difference costs more than the rest of a module's look. The weak
# reference tells a module made at a freed one's address (common: test modules come
# and go) from the one the entry is for.
_ATTRIBUTES: dict[int, tuple[weakref.ref, int, tuple[str, ...]]] = {}


def _user_class(kind: type) -> bool:
    user = _USER_CLASSES.get(kind)
    if user is None:
        user = _USER_CLASSES[kind] = _from_user_code(kind)
    return user


def _user_attributes(sub: nn.Module, own: dict[str, Any]) -> tuple[str, ...]:
    """The names of ``sub``'s attributes beyond nn.Module's own (``own`` its dict)."""
    known = _ATTRIBUTES.get(id(sub))
    # Kept while it is this module's (not one made at a freed one's address) and lists
    # the attributes there are (none added or deleted, nor one deleted and another added).
    if known is not None and known[0]() is sub and known[1] == len(own):
        for name in known[2]:
            if name not in own:
                break
        else:
            return known[2]
    if len(_ATTRIBUTES) > 100_000:
        _ATTRIBUTES.clear()
    names = tuple(own.keys() - _MODULE_OWN)
    _ATTRIBUTES[id(sub)] = (weakref.ref(sub), len(own), names)
    return names


def _needs_a_look(sub: nn.Module, seen: set[int]) -> bool:
    """A quick test, run on every module at every call: whether ``_roots`` can find
    anything (a container attribute, a hook, a user ``forward`` not yet looked at)."""
    if sub._forward_hooks or sub._forward_pre_hooks:
        return True
    kind = type(sub)
    if _user_class(kind) and id(kind.forward) not in seen:
        return True
    own = sub.__dict__
    for name in _user_attributes(sub, own):  # noqa: SIM110  (no generator: runs per module)
        if isinstance(own[name], _CONTAINERS):
            return True
    return False


def _last(container: Any, limit: int) -> Iterator[tuple[Any, Any]]:
    """``(key, value)`` of the container's last ``limit`` entries; the key is a dict's
    key, else the value itself."""
    if isinstance(container, dict):
        items: Any = reversed(container.items())
    elif isinstance(container, (list, collections.deque)):
        items = ((v, v) for v in reversed(container))
    else:
        items = ((v, v) for v in container)
    return itertools.islice(items, limit)


def _wrapped(container: Any, limit: int = _SCANNED, depth: int = 0) -> Iterator[Any]:
    """``(container, key, tensor)`` of the wrapped tensors in the container's last
    ``limit`` entries, nested ones too (in their last ``_SCANNED``)."""
    for key, value in _last(container, limit):
        if type(value) in _PLAIN:
            continue
        if isinstance(value, Tensor):
            if _torch_compat.is_wrapped(value):
                yield container, key, value
        elif depth < _DEPTH and isinstance(value, tuple):
            # A tuple cannot lose an element: a wrapped tensor anywhere in it (nested
            # tuples too) takes the whole tuple out of its container.
            for t in _in_tuple(value, depth + 1):
                yield container, key, t
            for v in value:
                if isinstance(v, _CONTAINERS):
                    yield from _wrapped(v, _SCANNED, depth + 1)
        elif depth < _DEPTH and isinstance(value, _CONTAINERS):
            yield from _wrapped(value, _SCANNED, depth + 1)


def _in_tuple(value: tuple, depth: int) -> Iterator[Tensor]:
    for v in value:
        if isinstance(v, Tensor) and _torch_compat.is_wrapped(v):
            yield v
        elif isinstance(v, tuple) and depth < _DEPTH:
            yield from _in_tuple(v, depth + 1)


class Before:
    """What the reachable containers held before a call: the wrapped tensors in their
    last ``_SCANNED`` entries (an earlier call's, the caller's outer transform's: not
    this call's to refuse), and each container's size (what the call adds is looked
    for past the last ``_SCANNED`` entries too, and nothing older is removed)."""

    __slots__ = ("sizes", "tensors")

    def __init__(self) -> None:
        self.tensors: dict[int, Tensor] = {}  # kept alive: their ids are not reused
        self.sizes: dict[int, tuple[Any, int]] = {}


def snapshot(modules: list[nn.Module]) -> Before:
    """The wrapped tensors and sizes of the reachable containers before a call."""
    before = Before()
    seen: set[int] = set()
    for sub in modules:
        if _needs_a_look(sub, seen):
            for _, container in _roots(sub, seen):
                before.sizes[id(container)] = (container, len(container))
                for _, _, t in _wrapped(container):
                    before.tensors[id(t)] = t
    return before


def _remove(container: Any, key: Any) -> None:
    if isinstance(container, dict):
        container.pop(key, None)
    elif isinstance(container, set):
        container.discard(key)
    else:
        for i in reversed(range(len(container))):
            if container[i] is key:
                del container[i]


def check(where: str, skeleton: nn.Module, modules: list[nn.Module], before: Before) -> None:
    """Refuse (after removing them) tensors of this call left in reachable containers:
    wrapped at this call's level or deeper, and not there ``before`` it."""
    level = _torch_compat.vmap_level() or 0

    def new(t: Tensor) -> bool:
        return id(t) not in before.tensors and (_torch_compat.wrapper_level(t) or 0) >= level

    def added(container: Any) -> int:
        """The last entries that can hold this call's tensors: the window looked at
        before, and whatever the container grew by."""
        found = before.sizes.get(id(container))
        if found is None or found[0] is not container:
            return len(container)  # a container made during the call: all of it
        return _SCANNED + max(len(container) - found[1], 0)

    seen: set[int] = set()
    first = None
    for sub in modules:
        if not _needs_a_look(sub, seen):
            continue
        for what, container in _roots(sub, seen):
            found = [f for f in _wrapped(container, added(container)) if new(f[2])]
            for inner, key, _ in found:
                _remove(inner, key)
            if not found:
                continue
            if first is None:
                first = (what, sub)
    if first is not None:
        what, sub = first
        path = next((p for p, m in skeleton.named_modules() if m is sub), "")
        module = f"`{path}` ({type(sub).__name__})" if path else type(sub).__name__
        raise ValueError(
            f"{where}: a tensor computed from the members' data was left in {what} of "
            f"{module}, a container outliving the call: in one vectorized call the "
            "module stands for every member, so what it keeps there is torch.func's "
            "internal tensor of all members at once, which cannot be read after the "
            "call, and each member's own container would not get its value "
            "(expected state in registered buffers, or values returned). Return the "
            "value from forward (the ensemble stacks it per member, e.g. as a second "
            "output), keep scratch values forward reads back in a local variable, "
            "or register a buffer and update it in place; the entries were removed."
        )
