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
What an attribute holds is copied deeply (a counter inside a schedule object, a nested
list, a ``random.Random``'s state) and compared strictly; lists, dicts and sets are put
back in place, other objects as fresh copies. An object ``deepcopy`` refuses (a lock) is
compared and put back by identity only.
"""

import contextlib
import contextvars
import copy
import enum
import types
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from .same_value import SameValue

# nn.Module's own tables (parameters, buffers, submodules, hooks) and its train flag.
_TORCH_OWN = frozenset(vars(nn.Module()))
# Values that cannot change in place, or that are kept by reference (tensors are the
# buffers' and forward_state's; modules are tracked as such).
_BY_REFERENCE = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    type,
    enum.Enum,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.ModuleType,
    Tensor,
    nn.Module,
)
_SAME = object()  # held by reference: nothing inside it to put back
_UNCOPYABLE = object()  # deepcopy refused it: kept by reference, as a last resort

# name -> (the value, a copy of what it holds then, or _SAME / _UNCOPYABLE)
Snapshot = dict[str, tuple[Any, Any]]


def _held(value: Any, memo: dict[int, Any]) -> Any:
    """A deep copy of what ``value`` holds (nested lists, dicts, objects: a counter in a
    schedule object, a ``random.Random``), sharing its tensors and modules."""
    if isinstance(value, _BY_REFERENCE):
        return _SAME
    try:
        return copy.deepcopy(value, memo)
    except Exception:  # a lock, a file: what can be compared is its identity
        return _UNCOPYABLE


def _tracked(name: str, value: Any) -> bool:
    return name not in _TORCH_OWN and not isinstance(value, Tensor)


def _snapshot(module: nn.Module, memo: dict[int, Any]) -> Snapshot:
    return {k: (v, _held(v, memo)) for k, v in vars(module).items() if _tracked(k, v)}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _differs(a: Snapshot, b: Snapshot) -> str | None:
    """The first attribute whose value (or what it holds) differs between ``a`` and ``b``."""
    strict = SameValue({}, set())
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            return name
        (va, ha), (vb, hb) = a[name], b[name]
        if ha is _SAME or hb is _SAME or ha is _UNCOPYABLE or hb is _UNCOPYABLE:
            if not _same(va, vb):
                return name
        elif not strict(ha, hb):
            return name
    return None


def _restore(module: nn.Module, snap: Snapshot, memo: dict[int, Any]) -> None:
    """Put back the attributes as ``snap`` holds them (from fresh copies, so that the
    snapshot serves every chunk)."""
    current = vars(module)
    for name in [k for k, v in current.items() if _tracked(k, v) and k not in snap]:
        del current[name]
    for name, (value, held) in snap.items():
        if held is _SAME or held is _UNCOPYABLE:
            current[name] = value
            continue
        fresh = copy.deepcopy(held, memo)
        if type(value) is list:  # the same container (others may hold it), old contents
            value[:] = fresh
        elif type(value) in (dict, set):
            value.clear()
            value.update(fresh)
        else:
            value = fresh
        current[name] = value


def _shared(modules: list[nn.Module]) -> dict[int, Any]:
    """A deepcopy memo that keeps the skeleton's modules and tensors themselves."""
    memo: dict[int, Any] = {}
    for m in modules:
        memo[id(m)] = m
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                memo[id(t)] = t
    return memo


class _Call:
    """One chunked call: the skeletons' submodules its chunks ran, as they were before
    it, and the state the first chunk left."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.before: dict[int, tuple[nn.Module, Snapshot]] = {}
        self.first_end: dict[int, Snapshot] | None = None

    def seen(self, skeleton: nn.Module) -> None:
        subs = [sub for sub in skeleton.modules() if id(sub) not in self.before]
        if not subs:
            return
        memo = _shared(list(skeleton.modules()))
        for sub in subs:
            self.before[id(sub)] = (sub, _snapshot(sub, memo))

    def _memo(self) -> dict[int, Any]:
        return _shared([sub for sub, _ in self.before.values()])

    def _now(self) -> dict[int, Snapshot]:
        memo = self._memo()
        return {key: _snapshot(sub, memo) for key, (sub, _) in self.before.items()}

    def put_back(self) -> None:
        memo = self._memo()
        for sub, snap in self.before.values():
            _restore(sub, snap, memo)

    def next_chunk(self) -> None:
        """Before every chunk after the first: check the chunk before, then start anew."""
        self._check(self._now())
        self.put_back()

    def finish(self) -> None:
        if self.first_end is not None:
            self._check(self._now())

    def _check(self, now: dict[int, Snapshot]) -> None:
        if self.first_end is None:
            self.first_end = now
            return
        for key, snap in now.items():
            name = _differs(self.first_end.get(key, {}), snap)
            if name is None:
                continue
            sub = self.before[key][0]
            self.put_back()
            raise ValueError(
                f"{self.where}: forward changed the attribute `{name}` of a "
                f"{type(sub).__name__} differently in two chunks of members (expected "
                "every member to end with the same value, as the loop's members, which "
                "start from the same one, do). The attribute is put back as it was. "
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
    except BaseException:
        call.put_back()
        raise
    finally:
        _current.reset(token)
