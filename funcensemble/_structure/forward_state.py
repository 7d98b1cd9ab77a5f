"""State a member's ``forward`` leaves on its module besides its outputs.

Two kinds of it would be lost, or worse, in a vectorized call, where one skeleton module
stands for every member:

- a buffer re-assigned (``self.avg = 0.9 * self.avg + ...``) rather than updated in
  place: ``functional_call`` puts the skeleton's own tensor back after the call and the
  new value is dropped (the loop keeps it). It is written into the member's buffer
  instead, as an in-place update would be, when it has the buffer's shape and dtype;
  otherwise, and for a re-assigned parameter, the call is refused;
- a tensor computed from a member's data kept on ``self`` (``self.prev = out``): under
  a transform it is a wrapped tensor that outlives the call (read in the next call as
  whatever that call's transform makes of it). The call is refused and the attribute
  put back.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import _torch_compat

# (module, slot table or None for the module's __dict__, name) -> the value before.
Kept = dict[tuple[int, int, str], tuple[nn.Module, dict | None, str, Any]]


def _tables(module: nn.Module) -> list[tuple[dict | None, dict]]:
    return [(None, vars(module)), (module._buffers, module._buffers)]


def kept_tensors(modules: list[nn.Module]) -> Kept:
    """The tensor attributes and buffer slots of the skeleton's ``modules``, before a
    call."""
    out: Kept = {}
    for sub in modules:
        for table, values in _tables(sub):
            for name, value in values.items():
                if isinstance(value, Tensor) or value is None:  # None: a slot to fill
                    out[(id(sub), id(table), name)] = (sub, table, name, value)
    return out


def check_kept(where: str, skeleton: nn.Module, modules: list[nn.Module], before: Kept) -> None:
    """Refuse (after putting every one back) wrapped tensors the call left on the
    skeleton's ``modules``."""
    first = None
    for sub in modules:
        for table, values in _tables(sub):
            for name, value in list(values.items()):
                if not isinstance(value, Tensor) or not _torch_compat.is_wrapped(value):
                    continue
                key = (id(sub), id(table), name)
                old = before.get(key)
                if old is not None and old[3] is value:
                    continue
                if old is None:
                    delattr(sub, name) if table is None else values.pop(name)
                else:
                    values[name] = old[3]
                if first is None:
                    first = (sub, name)
    if first is not None:
        sub, name = first
        names = {id(m): p for p, m in skeleton.named_modules(remove_duplicate=False)}
        path = f"{names.get(id(sub), '')}.{name}".lstrip(".")
        raise ValueError(
            f"{where}: the forward kept a tensor computed from a member's data on "
            f"the module, as `{path}` (self.{name} = ...), which one module "
            "standing for every member cannot hold (expected state in registered "
            "buffers only). Register it as a buffer (register_buffer) and update "
            "it in place, or return it from forward; the attribute was put back."
        )


class _PassedIn:
    """The tensors passed in, tested by identity: ``t in passed``.

    By ``id()`` eagerly (a set); compiled, by ``is`` against each (torch 2.10 to 2.12
    cannot trace ``id()`` of a tensor made inside the traced call, such as vmap's
    wrappers, and stop ``fullgraph`` there).
    """

    def __init__(self, tensors: list[Tensor]) -> None:
        self.tensors = tensors
        self.ids = None if torch.compiler.is_compiling() else {id(t) for t in tensors}

    def __contains__(self, value: object) -> bool:
        if self.ids is not None:
            return id(value) in self.ids
        return any(value is t for t in self.tensors)


def carry_rebound(
    where: str,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    after: dict[str, Any],
    before_writing: Callable[[list[str]], None],
) -> None:
    """Write buffers the forward re-assigned into the member's buffers; refuse the rest.

    ``after`` is the dict handed to ``functional_call``, which writes back what the
    module held at the end of the call. A slot holding another tensor passed in is a
    tie (``tie_weights``: one tensor stands for every name of a tied slot), not a new
    value. Everything is checked before anything is written; ``before_writing`` gets
    the names about to be written (saved, to be put back if the call fails later).
    """
    passed = _PassedIn([*params.values(), *buffers.values()])
    for name, old in params.items():
        if after.get(name, old) not in passed:
            raise ValueError(
                f"{where}: the forward re-assigned the parameter `{name}` (expected "
                "parameters to stay the tensors passed in). Compute the new value as a "
                "local tensor, or change the parameter outside forward."
            )
    rebound: list[tuple[str, Tensor, Tensor]] = []
    for name, old in buffers.items():
        new = after.get(name, old)
        if new in passed:
            continue
        if (
            not isinstance(new, Tensor)
            or new.shape != old.shape
            or new.dtype != old.dtype
            or new.device != old.device
        ):
            got = (
                f"shape {tuple(new.shape)}, dtype {new.dtype}"
                if isinstance(new, Tensor)
                else type(new).__name__
            )
            raise ValueError(
                f"{where}: the forward re-assigned the buffer `{name}` with {got} "
                f"(expected shape {tuple(old.shape)}, dtype {old.dtype}: the members' "
                "buffers are one stacked tensor, which a new value is written into). "
                "Keep the buffer's shape and dtype, or update it in place."
            )
        rebound.append((name, old, new))
    if not rebound:
        return
    before_writing([name for name, _, _ in rebound])
    with torch.no_grad():
        for _, old, new in rebound:
            old.copy_(new)
