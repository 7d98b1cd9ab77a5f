"""Tensors that ``forward`` can reach outside a module's registered slots.

An ensemble runs every member through one copy of member 0 and swaps each member's
tensors into the *registered* slots only (``_parameters``, ``_buffers``). Two kinds of
tensor held elsewhere (an attribute, a list, a dict, an object's fields, a function's
captured values) would then silently compute something the loop does not:

- a reference to one of the member's own parameters or buffers (``self.watch =
  [self.lin.weight]``): in the copy it reaches the stacked ``[N, ...]`` tensor, so every
  member would read all members' values;
- a tensor that requires grad and is not registered, or a module holding one (a shared
  encoder kept in a list to hide it from ``parameters()``): the copy runs on a copy of
  it, so the gradient the loop gives it would be lost.

Both are refused, naming the member, the submodule and the attribute. Other unregistered
tensors (constants) are values like any other attribute: compared across members and
copied.
"""

import contextlib
import functools
import types
from typing import Any

import torch
from torch import Tensor, nn

_DEPTH = 8  # how deep containers and plain objects are followed
# Objects that hold a member's parameters for training, not for its forward to read
# (an RL agent keeps its optimizer on the module).
_NOT_READ_BY_FORWARD = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
_SKIP = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType)


class _Found(Exception):
    def __init__(self, path: str, value: Any) -> None:
        self.path, self.value = path, value


def check_no_hidden_tensors(
    where: str,
    index: int,
    module: nn.Module,
    bookkeeping: frozenset[str],
    hooks: dict[str, str],
    legacy_hint: str,
) -> None:
    """Raise if a submodule's attributes or hooks reach a registered tensor of ``module``
    or an unregistered tensor (or foreign module) that requires grad.

    ``bookkeeping``: ``nn.Module``'s own entries of ``vars(submodule)``, skipped but for
    ``hooks`` (table name: what one hook is called), whose hooks are followed;
    ``legacy_hint``: what to use instead of torch's hook-based reparametrizations, which
    keep a computed tensor as a plain attribute."""
    registered: dict[int, tuple[str, str]] = {}
    for noun, named in (
        ("parameter", module.named_parameters(remove_duplicate=False)),
        ("buffer", module.named_buffers(remove_duplicate=False)),
    ):
        for name, t in named:
            registered.setdefault(id(t), (noun, name))
    own_modules = {id(m) for m in module.modules()}
    for path, sub in module.named_modules():
        entries = [(k, v) for k, v in vars(sub).items() if k not in bookkeeping]
        for table, noun in hooks.items():
            entries += [
                (f"{noun} {k}", h) for k, h in enumerate((vars(sub).get(table) or {}).values())
            ]
        for attribute, value in entries:
            if isinstance(value, _SKIP):
                continue
            try:
                _visit(value, attribute, registered, own_modules, set(), 0)
            except _Found as found:
                raise _error(legacy_hint, where, index, path, sub, found, registered) from None


def _visit(
    value: Any,
    path: str,
    registered: dict[int, tuple[str, str]],
    own_modules: set[int],
    seen: set[int],
    depth: int,
) -> None:
    if isinstance(value, _SKIP) or depth > _DEPTH or id(value) in seen:
        return
    if isinstance(value, _NOT_READ_BY_FORWARD):
        return
    seen.add(id(value))
    if isinstance(value, Tensor):
        if id(value) in registered or value.requires_grad:
            raise _Found(path, value)
        return
    if isinstance(value, nn.Module):
        if id(value) not in own_modules and any(
            t.requires_grad for t in (*value.parameters(), *value.buffers())
        ):
            raise _Found(path, value)
        return  # its own submodules are checked as such; a foreign frozen one is a value
    step = depth + 1
    if isinstance(value, dict):
        for k, v in value.items():
            _visit(v, f"{path}[{k!r}]", registered, own_modules, seen, step)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for k, v in enumerate(value):
            _visit(v, f"{path}[{k}]", registered, own_modules, seen, step)
    elif isinstance(value, functools.partial):
        _visit((value.func, value.args, value.keywords), path, registered, own_modules, seen, step)
    elif isinstance(value, types.MethodType):
        _visit(value.__func__, path, registered, own_modules, seen, step)
    elif isinstance(value, types.FunctionType):
        cells = []
        for cell in value.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                cells.append(cell.cell_contents)
        extras = (cells, value.__defaults__, value.__kwdefaults__)
        _visit(extras, f"{path} (its captured values)", registered, own_modules, seen, step)
    if hasattr(value, "__dict__") and not isinstance(value, (type, types.FunctionType)):
        for k, v in vars(value).items():
            _visit(v, f"{path}.{k}", registered, own_modules, seen, step)


def _error(
    legacy_hint: str,
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
    legacy = f" {legacy_hint}" if isinstance(value, Tensor) and value.grad_fn else ""
    return ValueError(
        f"{where}: {holder} holds {what} in `{found.path}`, not registered as its "
        "parameter, buffer or submodule (expected trainable tensors registered). An "
        "ensemble runs the members on a copy of what they hold, so the gradient the "
        "loop's backward gives it would be lost. Register it (nn.Parameter, or the "
        "module as a submodule) so that each member has its own; for a part shared by "
        "all members (a common encoder), keep it out of the ensemble and give its output "
        f"as the input.{legacy}"
    )
