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
Containers (lists, dicts, sets) are compared and put back by their contents too.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

# nn.Module's own tables (parameters, buffers, submodules, hooks) and its train flag.
_TORCH_OWN = frozenset(vars(nn.Module()))
_NO_CONTENTS = object()

Snapshot = dict[str, tuple[Any, Any]]  # name -> (value, its contents if a container)


def _contents(value: Any) -> Any:
    if type(value) is list:
        return list(value)
    if type(value) is dict:
        return dict(value)
    if type(value) is set:
        return set(value)
    return _NO_CONTENTS


def _tracked(name: str, value: Any) -> bool:
    return name not in _TORCH_OWN and not isinstance(value, Tensor)


def _snapshot(module: nn.Module) -> Snapshot:
    return {k: (v, _contents(v)) for k, v in vars(module).items() if _tracked(k, v)}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _differs(a: Snapshot, b: Snapshot) -> str | None:
    """The first attribute whose value (or contents) differs between ``a`` and ``b``."""
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            return name
        (va, ca), (vb, cb) = a[name], b[name]
        if not _same(va, vb) or not _same(ca, cb):
            return name
    return None


def _restore(module: nn.Module, snap: Snapshot) -> None:
    current = vars(module)
    for name in [k for k, v in current.items() if _tracked(k, v) and k not in snap]:
        del current[name]
    for name, (value, contents) in snap.items():
        if contents is not _NO_CONTENTS:  # the same container, its old contents
            value.clear()
            if type(value) is list:
                value.extend(contents)
            else:
                value.update(contents)
        current[name] = value


class _Call:
    """One chunked call: the skeletons' submodules its chunks ran, as they were before
    it, and the state the first chunk left."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.before: dict[int, tuple[nn.Module, Snapshot]] = {}
        self.first_end: dict[int, Snapshot] | None = None

    def seen(self, skeleton: nn.Module) -> None:
        for sub in skeleton.modules():
            if id(sub) not in self.before:
                self.before[id(sub)] = (sub, _snapshot(sub))

    def _now(self) -> dict[int, Snapshot]:
        return {key: _snapshot(sub) for key, (sub, _) in self.before.items()}

    def put_back(self) -> None:
        for sub, snap in self.before.values():
            _restore(sub, snap)

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
