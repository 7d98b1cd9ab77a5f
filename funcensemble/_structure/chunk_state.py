"""Python attributes a member's ``forward`` changes, alike in every chunk of one call.

The loop runs each member's ``forward`` from that member's own attributes. Members are
checked to be one architecture, so those are equal: every member sees the same counter,
flag or setting, and ends with the same (``self.calls += 1`` leaves 1 in each). A call
with ``chunk_size`` runs the one skeleton's ``forward`` once per chunk, each chunk
starting from what the chunk before it left (``self.calls`` 1, 2, 3, ...: the members of
later chunks would compute with another warm-up factor than the loop's).

So every chunk after the first starts from the attributes the call started from, and
must end where the first chunk ended: then the skeleton ends as each loop member does.
A chunk that ends otherwise would give members states one skeleton cannot hold; the
call is refused with the attributes put back. Only non-tensor attributes are tracked
here (torch's own tables aside): tensors are the buffers' and ``forward_state``'s.
What the attributes reach counts too (a counter inside a schedule object, a list in a
dict, a closure's cell, a ``random.Random``): every mutable object reached is recorded by
its own shallow state (a list's items, a dict's entries, an object's fields, a cell's
value), and put back in place, so every object stays the object it was (a reference the
user keeps still reaches the ensemble's). Modules and tensors are not followed; nor are
the items of a collection of more than 4,096 (data such as a replay buffer: the
collection itself is still put back); NumPy arrays of more than 65,536 elements (tables
forward reads) are compared by identity only. NumPy's generators (``Generator``,
``RandomState``, bit generators) are put back by their state. Other C objects that
reduce themselves for pickling (an ``itertools.count``) cannot be put back: a change
in what they reduce to is seen, and the call refused (unless they hold more than 4,096
items: compared by identity only, as the rest, such as a lock, are). A ``deque``, a
``bytearray`` and an ``array.array`` are put back like lists.
"""

import array
import collections
import contextlib
import contextvars
import enum
import operator
import random
import sys
import types
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from .. import _torch_compat
from .._core import turns as _turns
from .attributes import TORCH_OWN
from .same_value import EMPTY, SameValue, closure_values, reduced_state, slot_names

# Values with no state of their own to put back, or not followed: tensors are the
# buffers' and forward_state's, modules are tracked as such.
_NOT_FOLLOWED = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    type,
    enum.Enum,
    range,
    slice,
    types.BuiltinFunctionType,
    types.ModuleType,
    Tensor,
    nn.Module,
)
# Values whose state is followed otherwise (their parts, or their attributes and cells):
# their reduction need not be recorded.
_NO_STATE = (tuple, frozenset, types.MethodType, types.FunctionType)
_ARRAY_ELEMENTS = 65536  # NumPy arrays up to this size are recorded and put back
_FOLLOWED_ITEMS = 4096  # the items of larger collections are not followed

# id -> (the object, its kind, its shallow state)
Record = dict[int, tuple[Any, str, Any]]


def _slots(obj: Any) -> dict[str, Any]:
    return {n: getattr(obj, n) for n in slot_names(type(obj)) if hasattr(obj, n)}


_CONTAINERS = (list, dict, set, collections.deque, bytearray, array.array)


def _shallow(obj: Any) -> tuple[str, Any, list[Any]] | None:
    """``(kind, state, what it refers to)`` for a mutable object, None for one without
    state of its own (its parts are followed) or one that cannot be put back."""
    found = _shallow_own(obj)
    if found is not None and isinstance(obj, _CONTAINERS):
        fields, slots = getattr(obj, "__dict__", None), _slots(obj)
        if (isinstance(fields, dict) and fields) or slots:
            # A container subclass's own attributes (a running total beside its items).
            kind, state, refers = found
            fields = dict(fields) if isinstance(fields, dict) else {}
            attrs = [*fields.values(), *slots.values()]
            return f"{kind}+object", (state, (fields, slots)), refers + attrs
    return found


def _shallow_own(obj: Any) -> tuple[str, Any, list[Any]] | None:
    if isinstance(obj, list):
        return "list", list(obj), list(obj)
    if isinstance(obj, dict):
        return "dict", dict(obj), list(obj.values())
    if isinstance(obj, set):
        return "set", set(obj), []
    if isinstance(obj, collections.deque):  # (a C object: no __dict__ to record)
        return "deque", list(obj), list(obj)
    if isinstance(obj, (bytearray, array.array)):
        return "sequence", obj[:], []
    if isinstance(obj, random.Random):
        return "random", obj.getstate(), []
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(obj, numpy.ndarray):
            # A small array may be state (a counter vector); a large one is a table
            # forward reads, which copying at every chunk would make slow.
            small = obj.size <= _ARRAY_ELEMENTS
            return ("array", obj.copy(), []) if obj.flags.writeable and small else None
        if isinstance(obj, numpy.random.Generator):
            return "generator", obj.bit_generator.state, []
        if isinstance(obj, numpy.random.BitGenerator):
            return "bit generator", obj.state, []
        if isinstance(obj, numpy.random.RandomState):
            return "random state", obj.get_state(legacy=False), []
    if isinstance(obj, types.FunctionType):
        cells, fields = closure_values(obj), dict(vars(obj))
        return "function", (cells, fields), cells + list(fields.values())
    own = getattr(obj, "__dict__", None)
    slots = _slots(obj)
    if isinstance(own, dict) or slots:  # (an object may answer __dict__ with anything)
        fields = dict(own) if isinstance(own, dict) else {}
        return "object", (fields, slots), list(fields.values()) + list(slots.values())
    if not isinstance(obj, _NO_STATE) and _size(obj) <= _FOLLOWED_ITEMS:
        # A C object that says what it is made of (an itertools.count): it cannot be
        # put back, but a change is seen, and the call refused rather than computing
        # later chunks from where earlier ones left it.
        reduced = reduced_state(obj)
        if reduced is not None:
            return "opaque", reduced, []
    return None


def _size(obj: Any) -> int:
    """How many items ``obj`` holds, 0 for an object without a length."""
    try:
        return len(obj)
    except Exception:  # no __len__ (or one that fails)
        return 0


def _parts(obj: Any) -> list[Any]:
    """What an object without state of its own refers to (tuples, partials, methods)."""
    if isinstance(obj, (tuple, frozenset)):
        return list(obj)
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    return []


def _record(roots: list[Any]) -> Record:
    """The shallow state of every mutable object ``roots`` reach."""
    out: Record = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, _NOT_FOLLOWED) or id(obj) in seen:
            continue
        seen.add(id(obj))
        found = _shallow(obj)
        if found is None:
            stack.extend(_parts(obj))
            continue
        kind, state, refers = found
        out[id(obj)] = (obj, kind, state)
        if len(refers) <= _FOLLOWED_ITEMS:  # a large collection is data, not state
            stack.extend(refers)
            if isinstance(obj, dict):
                stack.extend(_parts(tuple(obj.keys())))
    return out


def _same_state(a: Any, b: Any, strict: SameValue) -> bool:
    """Two shallow states alike: the same objects item by item (a fast pass in C), or
    else strictly equal values."""
    if type(a) is type(b) and isinstance(a, (list, dict)) and len(a) == len(b):
        if isinstance(a, list) and all(map(operator.is_, a, b)):
            return True
        if (
            isinstance(a, dict)
            and all(map(operator.is_, a.keys(), b.keys()))
            and all(map(operator.is_, a.values(), b.values()))
        ):
            return True
    return strict(a, b)


def _put_back(obj: Any, kind: str, state: Any) -> None:
    if kind.endswith("+object"):
        items, attributes = state
        _put_back(obj, kind.removesuffix("+object"), items)
        _put_back(obj, "object", attributes)
    elif kind == "list":
        obj[:] = state
    elif kind in ("dict", "set"):
        obj.clear()
        obj.update(state)
    elif kind == "deque":
        obj.clear()
        obj.extend(state)
    elif kind == "sequence":
        obj[:] = state
    elif kind == "random":
        obj.setstate(state)
    elif kind == "array":
        obj[...] = state
    elif kind == "generator":
        obj.bit_generator.state = state
    elif kind == "bit generator":
        obj.state = state
    elif kind == "random state":
        obj.set_state(state)
    elif kind == "opaque":
        pass  # cannot be put back: a change is refused (``_State.differs``)
    elif kind == "function":
        cells, fields = state
        for cell, value in zip(obj.__closure__ or (), cells, strict=True):
            if value is not EMPTY:
                cell.cell_contents = value
        vars(obj).clear()
        vars(obj).update(fields)
    else:
        fields, slots = state
        own = getattr(obj, "__dict__", None)
        if isinstance(own, dict):
            own.clear()
            own.update(fields)
        for name, value in slots.items():
            setattr(obj, name, value)


def _attributes(module: nn.Module) -> dict[str, Any]:
    """A module's own attributes (torch's tables and tensors aside)."""
    return {
        k: v for k, v in vars(module).items() if k not in TORCH_OWN and not isinstance(v, Tensor)
    }


class _State:
    """The tracked modules' attributes and the shallow state of all they reach."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.attributes = {id(m): _attributes(m) for m in modules}
        self.reached = _record([v for table in self.attributes.values() for v in table.values()])

    def restore(self, modules: dict[int, nn.Module]) -> None:
        for key, table in self.attributes.items():
            current = vars(modules[key])
            for name in [k for k in _attributes(modules[key]) if k not in table]:
                del current[name]
            current.update(table)
        for obj, kind, state in self.reached.values():
            _put_back(obj, kind, state)

    def differs(
        self, other: "_State", modules: dict[int, nn.Module]
    ) -> tuple[nn.Module, str, bool] | None:
        """A module and the attribute through which ``other`` differs from this, if any,
        and whether what differs can be put back."""
        strict = SameValue({}, set(), members=False)
        for key, table in self.attributes.items():
            theirs = other.attributes.get(key, {})
            for name in sorted(table.keys() | theirs.keys()):
                if name not in table or name not in theirs or not strict(table[name], theirs[name]):
                    return modules[key], name, True
        for key, (obj, kind, state) in self.reached.items():
            found = other.reached.get(key)
            if found is None or not _same_state(state, found[2], strict):
                module = modules[next(iter(self.attributes))]
                return module, _path_to(obj, self, modules), kind != "opaque"
        return None


def _path_to(obj: Any, state: _State, modules: dict[int, nn.Module]) -> str:
    """The attribute through which ``obj`` was reached, for the message."""
    for table in state.attributes.values():
        for name, value in table.items():
            if obj is value or id(obj) in _record([value]):
                return name
    return "(an object its attributes reach)"


class _Call:
    """One chunked call: the skeletons' submodules its chunks ran, their state before
    it, and the state the first chunk left."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.modules: dict[int, nn.Module] = {}
        self.before: list[_State] = []  # one per skeleton, as its forward first ran
        self.first_end: _State | None = None
        self.skeletons: list[nn.Module] = []

    def seen(self, skeleton: nn.Module) -> None:
        new = [m for m in skeleton.modules() if id(m) not in self.modules]
        if new:
            self.modules.update((id(m), m) for m in new)
            self.before.append(_State(new))
            self.skeletons.append(skeleton)

    def _turn(self) -> contextlib.ExitStack:
        """The skeletons' locks (see ``_core.turns``), in one order for every thread:
        another thread's call must not see their attributes half put back."""
        stack = contextlib.ExitStack()
        for skeleton in sorted(self.skeletons, key=id):
            stack.enter_context(_turns.lock(skeleton))
        return stack

    def put_back(self) -> None:
        with self._turn():
            for state in self.before:
                state.restore(self.modules)

    def next_chunk(self) -> None:
        """Before every chunk after the first: check the chunk before, then start anew."""
        with self._turn():
            self._check()
            self.put_back()

    def finish(self) -> None:
        if self.first_end is not None:
            with self._turn():
                self._check()

    def _check(self) -> None:
        if not self.modules:
            return
        now = _State(list(self.modules.values()))
        if self.first_end is None:
            self.first_end = now
            return
        found = self.first_end.differs(now, self.modules)
        if found is None:
            return
        sub, name, restorable = found
        self.put_back()
        back = (
            "The attribute is put back as it was."
            if restorable
            else f"`{name}` reaches an object that cannot be put back between chunks (such "
            "as an iterator): it stays where the chunks left it."
        )
        raise ValueError(
            f"{self.where}: forward changed the attribute `{name}` of a "
            f"{type(sub).__name__} differently in two chunks of members (expected "
            "every member to end with the same value, as the loop's members, which "
            f"start from the same one, do). {back} "
            "Call without chunk_size, or keep per-member values in buffers."
        )


_current: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "funcensemble_chunked_call", default=None
)


def seen(skeleton: nn.Module) -> None:
    """A skeleton's ``forward`` is about to run: within a chunked call, keep its
    attributes as they were before the call (once per call)."""
    call = _current.get()
    if call is not None:
        call.seen(skeleton)


@contextlib.contextmanager
def chunked(where: str) -> Iterator[_Call]:
    """One chunked call: call ``next_chunk()`` on the result before every chunk after
    the first. On an error, the attributes are put back as before the call."""
    call = _Call(where)
    token = _current.set(call)
    try:
        yield call
        call.finish()
    except BaseException as error:
        if not _torch_compat.ends_recomputation(type(error)):  # (not a failure)
            call.put_back()
        raise
    finally:
        _current.reset(token)
