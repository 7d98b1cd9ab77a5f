"""Whether two Python values found in two members' modules are the same value.

Used to compare the non-tensor state of ensemble members (attributes, hooks, captured
values). The rule is strict on purpose: two values are the same only if they have the
same type and the same contents, so a difference can never slip through unseen:

- numbers, strings, ``None`` and other builtins compare with ``==``; floats (and the
  parts of complex numbers) are equal when ``==`` holds with the same sign of zero, or
  when both are NaN;
- tuples, lists, dicts (keys in order), sets compare element by element, keys and set
  elements as strictly as values; a subclass's attributes (and a ``defaultdict``'s
  factory) are compared too;
- tensors and NumPy arrays and scalars compare by shape, dtype, device and values (NaN
  equal to NaN, zeros by sign);
- functions are the same if they are the same object, or have the same code, defaults,
  globals, attributes and equal captured (closure) values; bound methods,
  ``functools.partial`` and weak references compare what they wrap;
- a dataclass compares its fields as attributes (strictly, every field); an object
  with its own ``__eq__`` compares with it; a C object (no attributes) whose type
  reduces itself (``__reduce_ex__``, ``__reduce__``) compares what copying and
  pickling rebuild it from, and one with its own ``__getstate__`` the state they see;
  any other object compares its attributes (``__dict__`` and ``__slots__``); an opaque
  object only equals itself. One random generator or iterator held by both members is
  a difference: the loop's members draw from it in turn.

``pairs`` maps ``id`` of an object of member *k* (a submodule, parameter or buffer) to
its counterpart in member 0, so an attribute referring to a member's own submodule
equals the one referring to member 0's submodule at the same path.
"""

import collections
import dataclasses
import enum
import functools
import io
import math
import random
import sys
import types
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

_BUILTIN_SCALARS = (bool, int, str, bytes, type(None), range, slice, type)
_BUILTIN_CONTAINERS = frozenset({tuple, list, dict, set, frozenset, collections.OrderedDict})
_BUILTIN_CALLABLES = (
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.ModuleType,
)
EMPTY = object()  # a closure cell not yet assigned
_DEFAULT_GETSTATE = getattr(object, "__getstate__", None)


class SameValue:
    """A comparison of member ``k``'s values against member 0's.

    Args:
        pairs: ``id`` of member ``k``'s structural objects to member 0's counterparts.
        own: ``id`` of every structural object of member 0 (the values of ``pairs``).
        members: The values are two members' (not two states of one object): a random
            generator or iterator they share is a difference, since the loop's members
            draw from it in turn.
    """

    def __init__(self, pairs: dict[int, object], own: set[int], *, members: bool = True) -> None:
        self.pairs = pairs
        self.own = own
        # Comparing two members' values: one generator or iterator both hold differs.
        self.members = members
        self._visiting: set[tuple[int, int]] = set()

    def __call__(self, a: Any, b: Any) -> bool:
        if a is b:  # unless member k holds member 0's own submodule or tensor
            # One generator or iterator shared by the members: the loop's members draw
            # from it in turn (different values), the ensemble's call draws once.
            return id(a) not in self.own and not (self.members and draws(a))
        counterpart = self.pairs.get(id(b), b)
        if counterpart is not b or id(a) in self.own:
            return counterpart is a
        if type(a) is not type(b):
            return False
        key = (id(a), id(b))
        if key in self._visiting:
            return True  # a cycle: equal unless some other part differs
        self._visiting.add(key)
        try:
            return self._compare(a, b)
        finally:
            self._visiting.discard(key)

    def _all(self, xs: Any, ys: Any) -> bool:
        xs, ys = list(xs), list(ys)
        return len(xs) == len(ys) and all(self(x, y) for x, y in zip(xs, ys, strict=True))

    def _compare(self, a: Any, b: Any) -> bool:
        if isinstance(a, float):
            return _same_float(a, b)
        if isinstance(a, complex):
            return _same_float(a.real, b.real) and _same_float(a.imag, b.imag)
        if isinstance(a, (*_BUILTIN_SCALARS, enum.Enum)):
            return a == b
        if isinstance(a, Tensor):
            return same_tensor(a, b)
        if isinstance(a, (tuple, list)):
            return self._all(a, b) and self._same_extras(a, b)
        if isinstance(a, dict):
            return (
                self._all(a.keys(), b.keys())
                and self._all(a.values(), b.values())
                and self._same_extras(a, b)
            )
        if isinstance(a, (set, frozenset)):
            # Sets whose elements match strictly ({0.0} is not {-0.0}, {1} is not
            # {True}, a NaN made by each member matches the other's): compared by a
            # strict key each, in linear time.
            return (
                len(a) == len(b)
                and collections.Counter(map(_strict_key, a))
                == collections.Counter(map(_strict_key, b))
                and self._same_extras(a, b)
            )
        if isinstance(a, types.FunctionType):
            return self._same_function(a, b)
        if isinstance(a, types.MethodType):
            return self(a.__func__, b.__func__) and self(a.__self__, b.__self__)
        if isinstance(a, functools.partial):
            return (
                self(a.func, b.func)
                and self(a.args, b.args)
                and self(a.keywords, b.keywords)
                and self._same_extras(a, b)
            )
        if isinstance(a, weakref.ref):
            return self(a(), b())
        if isinstance(a, _BUILTIN_CALLABLES):
            return a == b
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(a, numpy.ndarray):
            return a.dtype == b.dtype and a.shape == b.shape and _same_array(numpy, a, b)
        if numpy is not None and isinstance(a, numpy.generic):  # a NumPy scalar
            return a.dtype == b.dtype and _same_array(numpy, numpy.asarray(a), numpy.asarray(b))
        if isinstance(a, RemovableHandle):
            # A hook's handle: ids count up across all modules, so compare which hook of
            # its table it removes (the hooks themselves are compared as hooks).
            return _handle_position(a) == _handle_position(b)
        if dataclasses.is_dataclass(a):
            # Field by field, strictly: a dataclass's __eq__ compares tuples (NaN unlike
            # itself, -0.0 like 0.0) and skips fields with compare=False.
            return self._same_attributes(a, b)
        if type(a).__eq__ is not object.__eq__ and not isinstance(a, torch.nn.Module):
            try:
                result = a == b
            except Exception:  # an __eq__ that cannot compare these: compare attributes
                result = None
            if isinstance(result, bool):
                return result
        reduced = _reduced(a, b)
        if reduced is not None:  # what copying and pickling rebuild the object from
            return self(*reduced)
        getstate = getattr(type(a), "__getstate__", None)
        if getstate is not None and getstate is not _DEFAULT_GETSTATE:
            try:  # the state that copying and pickling see (e.g. a hook wrapper's)
                state_a, state_b = a.__getstate__(), b.__getstate__()
            except Exception:  # a __getstate__ that refuses: compare attributes
                pass
            else:
                return self(state_a, state_b)
        return self._same_attributes(a, b)

    def _same_function(self, a: types.FunctionType, b: types.FunctionType) -> bool:
        if a.__code__ != b.__code__ or a.__globals__ is not b.__globals__:
            return False
        cells_a, cells_b = closure_values(a), closure_values(b)
        return (
            self(a.__defaults__, b.__defaults__)
            and self(a.__kwdefaults__, b.__kwdefaults__)
            and self(dict(vars(a)), dict(vars(b)))  # attributes set on the function
            and self._all(cells_a, cells_b)
        )

    def _same_extras(self, a: Any, b: Any) -> bool:
        """What a container's subclass holds besides its elements: its attributes, and
        a ``defaultdict``'s factory."""
        if isinstance(a, collections.defaultdict) and not self(
            a.default_factory, b.default_factory
        ):
            return False
        if type(a) in _BUILTIN_CONTAINERS:
            return True
        return self._same_attributes(a, b) if hasattr(a, "__dict__") else True

    def _same_attributes(self, a: Any, b: Any) -> bool:
        slots = slot_names(type(a))
        has_dict = hasattr(a, "__dict__")
        if not has_dict and not slots:
            return False  # opaque (a C object such as a Generator): only itself is equal
        if has_dict and not self(dict(vars(a)), dict(vars(b))):
            return False
        missing = object()
        return self._all(
            (getattr(a, s, missing) for s in slots), (getattr(b, s, missing) for s in slots)
        )


def _reduced(a: Any, b: Any) -> tuple[Any, Any] | None:
    """``a`` and ``b`` as copying and pickling see them, if they are C objects whose
    type reduces itself.

    A C object (no ``__dict__`` or slots) with its own ``__reduce_ex__`` or
    ``__reduce__`` (NumPy's ``Generator``, whose ``__getstate__`` returns None and whose
    state lives in its bit generator) says there what it is made of; ``None`` for any
    other object, or when reducing fails.
    """
    if isinstance(a, torch.Generator):
        return None  # one generator per member is refused as such (attributes.py)
    if hasattr(a, "__dict__") or slot_names(type(a)):
        # Its attributes are its state: a reduction may leave some out (one that
        # rebuilds the object from its constructor's arguments only).
        return None
    first = reduced_state(a)
    if first is None:
        return None
    second = reduced_state(b)
    return None if second is None else (first, second)


def draws(x: Any) -> bool:
    """Whether ``x`` gives a new value each time it is used: a random generator or an
    iterator (files aside)."""
    if isinstance(x, (random.Random, torch.Generator)):
        return True
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(
        x, (numpy.random.Generator, numpy.random.RandomState, numpy.random.BitGenerator)
    ):
        return True
    return hasattr(type(x), "__next__") and not isinstance(x, io.IOBase)


def reduced_state(x: Any) -> Any:
    """What copying and pickling rebuild ``x`` from, if its type reduces itself (see
    ``_reduced``); None otherwise."""
    cls = type(x)
    if cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__:
        return None
    try:
        with warnings.catch_warnings():
            # Python 3.12 and 3.13 warn that itertools objects stop pickling in 3.14.
            warnings.simplefilter("ignore", DeprecationWarning)
            reduced = x.__reduce_ex__(4)
    except Exception:  # an object that cannot be copied
        return None
    if not isinstance(reduced, tuple):
        # The name of a global, which says nothing of the state (an lru_cache wrapper
        # reduces to its name, whatever function it wraps): compared otherwise.
        return None
    # Items 3 and 4, where present, are iterators of list items and dict items.
    return tuple(
        list(part) if k >= 3 and part is not None else part for k, part in enumerate(reduced)
    )


def _handle_position(handle: RemovableHandle) -> tuple[int, int] | None:
    """Which entry of its hook table a handle removes, and the table's size."""
    table = handle.hooks_dict_ref()
    if table is None or handle.id not in table:
        return None
    return list(table).index(handle.id), len(table)


def _strict_key(x: Any) -> Any:
    """A hashable key that tells apart set elements ``==`` equates (``1``, ``1.0`` and
    ``True``; ``0.0`` and ``-0.0``) and matches NaNs, which ``==`` never does."""
    if isinstance(x, float):
        return (type(x), _float_key(x))
    if isinstance(x, complex):
        return (type(x), _float_key(x.real), _float_key(x.imag))
    if isinstance(x, tuple):
        return (type(x), tuple(_strict_key(e) for e in x))
    if isinstance(x, frozenset):  # a set inside a set: its elements strictly too
        return (type(x), frozenset(collections.Counter(map(_strict_key, x)).items()))
    return (type(x), x)


def _float_key(x: float) -> tuple[Any, float]:
    """``x`` with its sign (``-0.0`` apart from ``0.0``); every NaN of one sign alike."""
    return ("nan" if math.isnan(x) else x, math.copysign(1.0, x))


def _same_float(a: float, b: float) -> bool:
    """Equal with the same sign of zero, or both NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _same_array(numpy: Any, a: Any, b: Any) -> bool:
    """Equal NumPy arrays of one dtype and shape: NaN equal to NaN, and the same sign of
    every zero (``atan2`` and division tell ``-0.0`` from ``0.0``)."""
    floating = a.dtype.kind in "fc"
    if not numpy.array_equal(a, b, equal_nan=floating):
        return False
    if a.dtype.kind == "f":
        return bool(numpy.array_equal(numpy.signbit(a), numpy.signbit(b)))
    if a.dtype.kind == "c":
        return _same_array(numpy, a.real, b.real) and _same_array(numpy, a.imag, b.imag)
    return True


def closure_values(fn: types.FunctionType) -> list[Any]:
    """The values a function captured, ``EMPTY`` for a cell not yet assigned."""
    return [_cell(c) for c in fn.__closure__ or ()]


def slot_names(cls: type) -> list[str]:
    """The ``__slots__`` names of ``cls`` and its bases (a lone string is one name)."""
    names = []
    for c in cls.__mro__:
        declared = c.__dict__.get("__slots__", ())
        names += [declared] if isinstance(declared, str) else list(declared)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def _cell(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a variable not yet assigned)
        return EMPTY


def same_tensor(a: Tensor, b: Tensor) -> bool:
    """Same shape, dtype, device, layout and values (NaN equals NaN)."""
    if (a.shape, a.dtype, a.device, a.layout) != (b.shape, b.dtype, b.device, b.layout):
        return False
    if a.device.type == "meta":
        return True  # meta tensors have no values to differ in
    a, b = a.detach(), b.detach()
    if a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    if a.is_complex():
        return same_tensor(torch.view_as_real(a), torch.view_as_real(b))
    if not torch.equal(a, b) and not (
        a.is_floating_point()
        and bool(torch.isclose(a, b, rtol=0.0, atol=0.0, equal_nan=True).all())
    ):
        return False
    # The same sign of every zero (atan2 and division tell -0.0 from 0.0).
    return not a.is_floating_point() or torch.equal(torch.signbit(a), torch.signbit(b))


def show(value: Any, limit: int = 80) -> str:
    """A short description of ``value`` for an error message."""
    if isinstance(value, Tensor):
        if value.numel() <= 6 and value.device.type != "meta":
            return f"tensor({value.detach().cpu().tolist()}, dtype={value.dtype})"
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, types.FunctionType):
        code = value.__code__
        text = f"function {value.__qualname__} ({code.co_filename}:{code.co_firstlineno})"
        captured = closure_values(value)
        extras = [("defaults", value.__defaults__), ("kwdefaults", value.__kwdefaults__)]
        extras.append(("capturing", tuple(captured) if captured else None))
        for label, values in extras:
            if values:
                text += f" {label} {show(values, limit)}"
        return text
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
