"""Tensors that ``forward`` can reach outside a module's registered slots.

An ensemble runs every member through one copy of member 0 and swaps each member's
tensors into the *registered* slots only (``_parameters``, ``_buffers``). Two kinds of
tensor held elsewhere (an attribute, a list, a dict, an object's fields, a function's
captured values) would then silently compute something the loop does not:

- a reference to one of the member's own parameters or buffers (``self.watch =
  [self.lin.weight]``): in the copy it reaches the stacked ``[N, ...]`` tensor, so every
  member would read all members' values; an alias of one's memory (``.data``,
  ``.detach()``, a view) would be copied as a constant, frozen at member 0's values
  while the loop's alias follows its parameter as it trains;
- a tensor that requires grad and is not registered, or a module holding one (a shared
  encoder kept in a list to hide it from ``parameters()``): the copy runs on a copy of
  it, so the gradient the loop gives it would be lost.

A weak reference to the member's own module or tensor is refused too: copying keeps it
as it is, so in the copy it would still reach member 0's original. So is a function
that captured the member's own module (a hook's closure over ``m``, a default ``m=m``):
copying keeps functions as they are, with what they captured. Optimizers and
schedulers kept on a member are not searched (they hold the parameters for training).

All are refused, naming the member, the submodule and the attribute. Other unregistered
tensors (constants) are values like any other attribute: compared across members and
copied.
"""

import functools
import operator
import types
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from .attributes import BOOKKEEPING, HOOKS, LEGACY_HINT, TORCH_OWN
from .same_value import EMPTY, closure_values, slot_names

_DEPTH = 32  # how deep containers and plain objects are followed
# Objects that hold a member's parameters for training, not for its forward to read
# (an RL agent keeps its optimizer on the module).
_NOT_READ_BY_FORWARD = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
_SKIP = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType)
# torch's wrapper of a hook registered with the module (register_load_state_dict_pre_hook):
# it holds the module weakly, and its copy holds the copy (its __getstate__ and
# __setstate__ swap the weak reference for the module), so only its hook is searched.
_WRAPPED_HOOK = getattr(torch.nn.modules.module, "_WrappedHook", None)


def _quantization_config(value: Any) -> bool:
    """A torch.ao QConfig: observer factories ``prepare`` calls, not ``forward``."""
    cls = type(value)
    return cls.__name__ in ("QConfig", "QConfigDynamic") and cls.__module__.startswith(
        "torch.ao.quantization"
    )


class _Found(Exception):
    def __init__(self, path: str, value: Any) -> None:
        self.path, self.value = path, value


def check_no_hidden_tensors(where: str, index: int, module: nn.Module) -> None:
    """Raise if a submodule's attributes or hooks reach a registered tensor of ``module``
    or an unregistered tensor (or foreign module) that requires grad."""
    registered: dict[int, tuple[str, str]] = {}
    storages: dict[int, tuple[int, str, str]] = {}  # address -> (end, noun, name)
    for noun, named in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for name, t in named:
            registered.setdefault(id(t), (noun, name))
            address = _storage_address(t)
            if address:
                end = address + t.untyped_storage().nbytes()
                storages.setdefault(address, (end, noun, name))
    own_modules = {id(m) for m in module.modules()}
    # The members' modules' __dict__ ids: a weak proxy shows its target's.
    own = _Own(registered, own_modules, {id(vars(m)) for m in module.modules()}, storages, [])
    for path, sub in module.named_modules():
        entries = [(k, v) for k, v in vars(sub).items() if k not in BOOKKEEPING]
        for table, noun in HOOKS.items():
            entries += [
                (f"{noun} {k}", h) for k, h in enumerate((vars(sub).get(table) or {}).values())
            ]
        for attribute, value in entries:
            if isinstance(value, _SKIP):
                continue
            start = len(own.held)
            try:
                _visit(value, attribute, own, set(), 0)
            except _Found as found:
                raise _error(where, index, path, sub, found, registered) from None
            if path:  # named from the member's root, for the check after the walk
                own.held[start:] = [(*h[:3], f"{path}.{h[3]}") for h in own.held[start:]]
    linked = _shared_memory(own.held)
    if linked is not None:
        first, second = linked
        found = _Found(second, _SharedArray(first))
        raise _error(where, index, "", module, found, registered)


class _Own(NamedTuple):
    """What belongs to the member being checked, by id."""

    registered: dict[int, tuple[str, str]]  # its parameters and buffers: (noun, name)
    modules: set[int]
    dicts: set[int]  # its modules' __dict__s
    storages: dict[int, tuple[int, str, str]]  # its tensors' memory: address -> (end, noun, name)
    # Unregistered arrays and tensors: (it, lo, hi, its path from the member's root).
    held: list[tuple[Any, int, int, str]]


def _storage_address(t: Tensor) -> int:
    """The address of ``t``'s memory, or 0 where it has none to share (empty, meta)."""
    if t.numel() == 0 or t.device.type == "meta":
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a subclass or wrapper without storage
        return 0


def _visit(value: Any, path: str, own: _Own, seen: set, depth: int, captured: bool = False) -> None:
    """Raise ``_Found`` for what ``value`` reaches that the member's copy cannot hold.

    ``captured``: reached through a function's captured values, defaults or attributes,
    which copying a module does not copy (``copy.deepcopy`` keeps functions as they are).
    """
    key = (id(value), captured)
    if isinstance(value, _SKIP) or depth > _DEPTH or key in seen:
        return
    if isinstance(value, _NOT_READ_BY_FORWARD) or _quantization_config(value):
        return
    seen.add(key)
    if _WRAPPED_HOOK is not None and isinstance(value, _WRAPPED_HOOK):
        _visit(value.hook, f"{path}.hook", own, seen, depth + 1, captured)
        return
    if isinstance(value, weakref.ProxyTypes):
        # A proxy passes every attribute to its target, __class__ and __dict__ too.
        if id(getattr(value, "__dict__", None)) in own.dicts:
            raise _Found(path, _WeakToOwn(value))
        return  # not copied either: the ensemble reaches the user's object itself
    if isinstance(value, Tensor):
        if id(value) in own.registered or value.requires_grad:
            raise _Found(path, value)
        address = _storage_address(value)
        if address and address in own.storages:
            raise _Found(path, _Alias(value, own.storages[address][1:]))
        if address and value.device.type == "cpu":
            end = address + value.untyped_storage().nbytes()
            own.held.append((value, address, end, path))
        return
    if isinstance(value, np.ndarray):
        # A NumPy view of a member's tensor (t.numpy()): memory inside one of its storages.
        start = value.__array_interface__["data"][0]
        for base, (end, noun, name) in own.storages.items():
            if value.nbytes and base <= start < end:
                raise _Found(path, _Alias(value, (noun, name)))
        if value.size:
            own.held.append((value, *_byte_bounds(value), path))
        return
    if isinstance(value, nn.Module):
        if id(value) in own.modules:
            if captured:
                # The copy's function still reaches member 0's original module.
                raise _Found(path, _CapturedOwn(value))
            return  # the member's own submodules are checked as such
        tensors = (*value.named_parameters(), *value.named_buffers())
        for name, t in tensors:
            if id(t) in own.registered:
                raise _Found(f"{path}.{name}", t)
        if any(t.requires_grad for _, t in tensors):
            raise _Found(path, value)
        # A foreign frozen module is a value, but what it holds may be the member's.
        for k, v in vars(value).items():
            if k not in TORCH_OWN:
                _visit(v, f"{path}.{k}", own, seen, depth + 1, captured)
        for k, v in value._modules.items():
            _visit(v, f"{path}.{k}", own, seen, depth + 1, captured)
        return
    if isinstance(value, weakref.ref):
        target = value()
        if id(target) in own.modules or id(target) in own.registered:
            # Copying the member copies no weak reference: the ensemble's would still
            # reach member 0's original module, and every member its tensors.
            raise _Found(path, _WeakToOwn(target))
        return  # not copied either: the ensemble reaches the user's object itself
    step = depth + 1
    if isinstance(value, dict):
        for k, v in value.items():
            _visit(k, f"{path} (a key)", own, seen, step, captured)
            _visit(v, f"{path}[{k!r}]", own, seen, step, captured)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for k, v in enumerate(value):
            _visit(v, f"{path}[{k}]", own, seen, step, captured)
    elif isinstance(value, functools.partial):
        for field in ("func", "args", "keywords"):
            _visit(getattr(value, field), f"{path}.{field}", own, seen, step, captured)
    elif isinstance(value, types.MethodType):
        # Copying rebinds a method to the copy of its module (unless the method itself
        # was reached through a function, which is not copied).
        _visit(value.__func__, path, own, seen, step, captured)
        _visit(value.__self__, f"{path}.__self__", own, seen, step, captured)
    elif isinstance(value, types.FunctionType):
        code = value.__code__
        positional = code.co_varnames[: code.co_argcount]
        defaults = value.__defaults__ or ()
        extras = {
            **{
                f"its captured variable {name}": v
                for name, v in zip(code.co_freevars, closure_values(value), strict=True)
                if v is not EMPTY
            },
            **dict(
                zip(
                    [f"its default {n}" for n in positional[len(positional) - len(defaults) :]],
                    defaults,
                    strict=True,
                )
            ),
            **{f"its default {k}": v for k, v in (value.__kwdefaults__ or {}).items()},
            **{f"its attribute {k}": v for k, v in vars(value).items()},
        }
        for where, v in extras.items():
            # functools.wraps' __wrapped__ is a record of what was wrapped, not called
            # through it (a wrapper that calls it holds it among its captured values).
            wrapped = where == "its attribute __wrapped__"
            _visit(v, f"{path} ({where})", own, seen, step, captured=not wrapped)
        return
    if isinstance(value, type):
        return
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict):  # (an object may answer __dict__ with anything)
        for k, v in list(fields.items()):
            _visit(v, f"{path}.{k}", own, seen, step, captured)
    for name in slot_names(type(value)):
        if hasattr(value, name):
            _visit(getattr(value, name), f"{path}.{name}", own, seen, step, captured)


# np.shares_memory's "too hard to tell" (np.exceptions since NumPy 1.25, np before).
_TOO_HARD = getattr(np, "exceptions", np).TooHardError


def _byte_bounds(a: np.ndarray) -> tuple[int, int]:
    """The first and one-past-last byte addresses an array's elements occupy."""
    lo = hi = a.__array_interface__["data"][0]
    for size, stride in zip(a.shape, a.strides, strict=True):
        reach = (size - 1) * stride
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + a.itemsize


def _shared_memory(held: list[tuple[Any, int, int, str]]) -> tuple[str, str] | None:
    """The paths of two held arrays (or an array and a tensor) that share memory, if any.

    ``copy.deepcopy`` copies arrays one by one (a tensor's views keep their link), so a
    write through one would no longer reach the other in the copy every member runs
    through, where it does in the loop. One sweep over the memory ranges in address
    order: only ranges that overlap are compared.
    """
    active: list[tuple[Any, int, int, str]] = []
    for item in sorted(held, key=operator.itemgetter(1)):
        value, lo, _, path = item
        active = [a for a in active if a[2] > lo]
        for other in active:
            if _linked(value, other[0]):
                return other[3], path
        active.append(item)
    return None


def _linked(a: Any, b: Any) -> bool:
    """Whether a write through one of two objects whose memory ranges overlap can reach
    the other's elements (and so would not, in a copy)."""
    if a is b or (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return False  # one object; or tensors, whose views a copy keeps linked
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if not (a.flags.writeable or b.flags.writeable):
            return False  # nothing can write through either (a read-only table)
        try:
            return bool(np.shares_memory(a, b, max_work=10_000))  # not a[::2] and a[1::2]
        except _TOO_HARD:
            return True  # could not tell: taken as sharing
    return True


class _SharedArray(NamedTuple):
    """An unregistered array (or tensor) sharing memory with one held at ``other``."""

    other: str


class _Alias(NamedTuple):
    """An unregistered tensor or array sharing memory with the member's own ``(noun, name)``."""

    tensor: Any
    of: tuple[str, str]


class _CapturedOwn:
    """The member's own module, found among a function's captured values."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


class _WeakToOwn:
    """What a weak reference to the member's own module or tensor was found to hold."""

    def __init__(self, target: Any) -> None:
        self.target = target


def _error(
    where: str,
    index: int,
    path: str,
    sub: nn.Module,
    found: _Found,
    registered: dict[int, tuple[str, str]],
) -> ValueError:
    holder = f"member {index}" + (f"'s submodule `{path}`" if path else "")
    holder += f" ({type(sub).__name__})"
    value = found.value
    if isinstance(value, _WeakToOwn):
        return ValueError(
            f"{where}: {holder} holds a weak reference to its own "
            f"{value.target.__class__.__name__} in `{found.path}` (expected references to its "
            "own modules to be plain ones). Copying a module keeps a weak reference as it "
            "is, so in the one copy every member runs through it would still reach member "
            "0's original, and every member would compute with member 0's tensors. Hold a "
            "plain reference that torch does not register "
            "(object.__setattr__(self, name, module)), or reach the module through the tree."
        )
    if isinstance(value, _CapturedOwn):
        state_dicts = "state-dict" in found.path
        effect = (
            "the ensemble's state_dict() and load_state_dict() would run it on member 0's "
            "original module, not on the ensemble's stacked tensors. Use the module the "
            "hook is given (hook(module, state_dict, prefix, ...))"
            if state_dicts
            else "every member would compute with member 0's tensors. Use the module a "
            "hook is given (hook(module, args, output))"
        )
        return ValueError(
            f"{where}: {holder} holds a function that captures its own "
            f"{type(value.module).__name__} in `{found.path}` (a closure's variable, a "
            "default argument or an attribute of the function; expected functions to reach "
            "the module through their arguments). Copying a module does not copy "
            "functions, so in the one copy every member runs through, the function would "
            f"still reach member 0's original module, and {effect}, self in a method of "
            "the module's class, or a bound method (module.method), which the copy "
            "rebinds to itself."
        )
    if isinstance(value, _SharedArray):
        return ValueError(
            f"{where}: {holder} holds NumPy memory under two names, `{value.other}` and "
            f"`{found.path}` (a view of an array, or an array and a tensor made from "
            "it with torch.from_numpy; expected each array held once). An ensemble runs "
            "every member through one copy of member 0, and copying a module copies each "
            "array on its own: a write through one name would no longer reach the other, "
            "where it does in the loop. Hold the array once and take the view in forward "
            "(e.g. self.hist[:1] there)."
        )
    if isinstance(value, _Alias):
        noun, name = value.of
        kind = "an array" if isinstance(value.tensor, np.ndarray) else "a tensor"
        return ValueError(
            f"{where}: {holder} holds {kind} sharing memory with its {noun} `{name}` in "
            f"`{found.path}` (an alias such as .data, .detach(), .numpy() or a view; expected "
            f"`{name}` read through its module only). An ensemble runs every member through "
            "one copy of member 0 with each member's tensors swapped into the registered "
            f"slots: `{found.path}` would be a copy of member 0's values, frozen while the "
            f"loop's alias follows its {noun} as it trains. Read it through the module in "
            f"forward (e.g. self.{name}, or a view of it computed there)."
            + (f" {LEGACY_HINT}" if name.endswith("_orig") else "")
        )
    if isinstance(value, Tensor) and id(value) in registered:
        noun, name = registered[id(value)]
        return ValueError(
            f"{where}: {holder} holds its {noun} `{name}` in `{found.path}`, outside the "
            f"registered parameters and buffers (expected `{name}` read through its module "
            "only). An ensemble swaps each member's tensors into the registered slots, so "
            f"through `{found.path}` every member would read the stacked tensor of all "
            f"members, not its own. Read it through the module in forward (e.g. "
            f"self.{name}), or keep its name and look it up when needed."
        )
    what = (
        "a tensor that requires grad"
        if isinstance(value, Tensor)
        else f"a {type(value).__name__} module with trainable tensors"
    )
    legacy = f" {LEGACY_HINT}" if isinstance(value, Tensor) and value.grad_fn else ""
    return ValueError(
        f"{where}: {holder} holds {what} in `{found.path}`, not registered as its "
        "parameter, buffer or submodule (expected trainable tensors registered). An "
        "ensemble runs the members on a copy of what they hold, so the gradient the "
        "loop's backward gives it would be lost. Register it (nn.Parameter, or the "
        "module as a submodule) so that each member has its own; for a part shared by "
        "all members (a common encoder), keep it out of the ensemble and give its output "
        f"as the input.{legacy}"
    )
