"""What makes two modules the same architecture, and the errors when they are not."""

import dataclasses
import hashlib
import json
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import UninitializedTensorMixin

from .. import _torch_compat
from .._core.skeleton import modes, named_tensors
from .._messages import a, key_difference, submodule
from . import backward_hooks as _backward_hooks
from .attributes import (
    check_same_state,
    check_same_tree,
    class_names,
    original_class,
    twin_classes,
)
from .hidden_tensors import check_no_hidden_tensors
from .same_value import slot_names

# Layers whose fused kernels have no vmap batching rule. torch.func.vmap would raise
# an obscure "Batching rule not implemented" error or fall back to a per-member loop.
_UNBATCHABLE = (nn.RNNBase, nn.RNNCellBase)
_UNBATCHABLE_HINT = (
    "torch.func.vmap has no batching rule for the fused recurrent kernels "
    "(aten::lstm, aten::gru, aten::lstm_cell, cuDNN RNNs), so an ensemble of them cannot "
    "run as one vectorized call. Write the recurrence as a loop over time steps with "
    "nn.Linear layers (e.g. gates = x @ W_ih.T + h @ W_hh.T + b) inside your module, "
    "or keep a plain Python loop over the members for this layer."
)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), t.dtype, t.device, t.requires_grad)


@dataclass(frozen=True)
class Architecture:
    """The parts of a module that all members of one ensemble must share."""

    cls: type
    params: dict[str, TensorSpec]
    buffers: dict[str, TensorSpec]
    modes: dict[str, bool]
    # The module itself, for the comparison of everything that is not a tensor.
    module: nn.Module = dataclasses.field(compare=False, repr=False)

    @classmethod
    def of(cls, module: nn.Module) -> "Architecture":
        params, buffers = named_tensors(module)
        return cls(
            type(module),
            {k: TensorSpec.of(v) for k, v in params.items()},
            {k: TensorSpec.of(v) for k, v in buffers.items()},
            modes(module),
            module,
        )

    def fingerprint(self) -> str:
        """A short hash of class, names, per-member shapes and dtypes (not values)."""
        desc = {
            "class": f"{self.cls.__module__}.{self.cls.__qualname__}",
            "params": {k: [list(s.shape), str(s.dtype)] for k, s in self.params.items()},
            "buffers": {k: [list(s.shape), str(s.dtype)] for k, s in self.buffers.items()},
        }
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def check_is_module(where: str, index: int, module: object) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{where}: member {index} is {a(type(module).__name__)}, not a module (expected "
            f"an nn.Module, got {type(module).__name__}). Pass one nn.Module per member."
        )
    _check_no_cycle(where, index, module)
    for name, sub in module.named_modules():
        if getattr(type(sub), "_is_funcensemble_ensemble", False):
            kind = f"an fe.{type(sub).__name__}"
            raise TypeError(
                f"{where}: member {index} "
                + (f"has {kind} at {submodule(name)} " if name else f"is {kind} ")
                + "(expected members made of ordinary modules, got an ensemble: a member's "
                "ensemble would be vectorized a second time, which funcensemble does not "
                "do). Keep that member's modules in an nn.ModuleList inside it (its "
                "forward looping over them), or join ensembles with ens.concat(...)."
            )
        if isinstance(sub, _UNBATCHABLE):
            raise TypeError(
                f"{where}: member {index} contains {type(sub).__name__} at {submodule(name)}. "
                + _UNBATCHABLE_HINT
            )
        slots = [n for n in slot_names(type(sub)) if hasattr(sub, n)]
        if slots:
            raise TypeError(
                f"{where}: member {index} has {submodule(name)} ({type(sub).__name__}) "
                f"with values in __slots__ ({', '.join(f'`{n}`' for n in slots)}; expected "
                "a module's attributes in its __dict__). Copying a module keeps only its "
                "__dict__ (nn.Module.__getstate__), so the one copy every member runs "
                "through would lose them, and they would not be compared across members. "
                "Drop __slots__ from the class, so that these are ordinary attributes."
            )
        compiled = _torch_compat.compiled_module(sub)
        if compiled is not None:
            raise ValueError(
                f"{where}: member {index} has {submodule(name)} ({type(sub).__name__}) "
                f"compiled with {compiled} (expected plain modules: the ensemble runs "
                "its own stacked copy, never the member's compiled call). Build the "
                "ensemble from modules not compiled, then compile the ensemble "
                "(torch.compile(ens) or torch.compile of the training step; see the "
                "compile how-to)."
            )
        kind = _backward_hooks.kind_on(sub)
        if kind is not None:
            raise _backward_hooks.member_error(where, index, kind, name)
        for slot, t in sub._buffers.items():
            if isinstance(t, Tensor) and t.requires_grad:
                _buffer_requires_grad(where, index, f"{name}.{slot}" if name else slot, t)
        for slot, t in (*sub._parameters.items(), *sub._buffers.items()):
            if isinstance(t, Tensor) and (
                getattr(t, "_backward_hooks", None)
                or getattr(t, "_post_accumulate_grad_hooks", None)
            ):
                _tensor_hook(where, index, f"{name}.{slot}" if name else slot, sub)
            if (
                isinstance(t, Tensor)
                and type(t) not in _PLAIN
                and not isinstance(t, UninitializedTensorMixin)
            ):
                _tensor_subclass(where, index, f"{name}.{slot}" if name else slot, sub, t)
            if isinstance(t, UninitializedTensorMixin):
                full = f"{name}.{slot}" if name else slot
                raise ValueError(
                    f"{where}: member {index} has `{full}` of {submodule(name)} "
                    f"({type(sub).__name__}) uninitialized: a lazy module has no shape "
                    "until its first forward. Run one forward pass on each member first "
                    "(e.g. module(example_input)), then build the ensemble."
                )
    check_no_hidden_tensors(where, index, module)
    return module


_PLAIN = (Tensor, nn.Parameter)


def _tensor_subclass(where: str, index: int, full: str, sub: nn.Module, t: Tensor) -> None:
    kind = type(t).__name__
    raise TypeError(
        f"{where}: member {index}'s tensor `{full}` ({type(sub).__name__}) is {a(kind)}, a "
        f"subclass of torch.Tensor (expected a plain Tensor or nn.Parameter, got {kind}). "
        "The ensemble stacks the members' tensors into plain tensors, so what the subclass "
        "changes (its __torch_function__ or __torch_dispatch__) would be dropped. Store a "
        "plain tensor (t.as_subclass(torch.Tensor)) and apply the subclass's behaviour in "
        "forward."
    )


def _tensor_hook(where: str, index: int, full: str, sub: nn.Module) -> None:
    raise ValueError(
        f"{where}: member {index}'s tensor `{full}` ({type(sub).__name__}) has a gradient "
        "hook (register_hook or register_post_accumulate_grad_hook; expected none). The "
        "ensemble trains stacked copies of the members' tensors, whose gradients the "
        "member's hooks would never see. Build the ensemble from members without them, "
        "then hook the stacked tensor (e.g. ens.stacked.<layer>.weight.register_hook) or "
        "transform the stacked gradients (e.g. fe.optim.clip_by_global_norm, per member)."
    )


def _check_no_cycle(where: str, index: int, module: nn.Module) -> None:
    """Refuse a module registered below itself (``self.child.root = self``, or a
    ``weakref.proxy`` of an ancestor, which ``nn.Module`` registers as a submodule):
    torch's own walks of the tree (``state_dict``, ``named_modules(remove_duplicate=False)``)
    never end on it, and neither would the ensemble's."""
    # A proxy shows its target's __dict__: compare those, not the objects.
    stack = [(module, "", {id(vars(module)): ""})]
    done: set[int] = set()
    while stack:
        sub, path, above = stack.pop()
        if id(vars(sub)) in done:
            continue  # a shared submodule: walked once
        done.add(id(vars(sub)))
        # (A scripted module keeps its children elsewhere; one that never ran
        # nn.Module.__init__ has none: the checks after this one name what is wrong.)
        children = vars(sub).get("_modules")
        if children is None:
            children = getattr(sub, "_modules", None)
        if not hasattr(children, "items"):
            continue
        for name, child in children.items():
            if child is None:
                continue
            full = f"{path}.{name}" if path else name
            ancestor = above.get(id(vars(child)))
            if ancestor is not None:
                proxy = isinstance(child, weakref.ProxyTypes)
                kind = "a weakref.proxy, which nn.Module registers as a submodule, of "
                raise ValueError(
                    f"{where}: member {index}'s submodule `{full}` is "
                    f"{kind if proxy else ''}{submodule(ancestor)}, its own ancestor, so "
                    "the module tree has a cycle (expected a tree). torch's walks of a "
                    "module (state_dict, named_modules(remove_duplicate=False)) never end "
                    "on it, and neither would the ensemble's. Keep the back-reference out "
                    f"of the registered submodules: object.__setattr__(self, '{name}', "
                    "module) holds a plain reference torch does not register."
                )
            stack.append((child, full, {**above, id(vars(child)): full}))


def _buffer_requires_grad(where: str, index: int, name: str, t: Tensor) -> None:
    """Refuse a buffer that requires grad: the loop's backward reaches it (or, through
    its history, the parameter it was computed from); an ensemble's stacked buffers are
    plain state, so that gradient would be lost without a word."""
    made = " (it was computed from a parameter: it has a grad_fn)" if t.grad_fn else ""
    raise ValueError(
        f"{where}: member {index}'s buffer `{name}` requires grad{made} (expected buffers "
        "with requires_grad=False). An ensemble stacks buffers without autograd, so the "
        "gradient the loop's backward gives it would be lost. Make it a parameter "
        "(nn.Parameter) if it is to be trained, or register it detached "
        "(register_buffer(name, tensor.detach())) if not."
    )


class Owners:
    """The tensors of the members checked so far: by id, and by the memory they span."""

    def __init__(self) -> None:
        self.ids: dict[int, tuple[int, str, str]] = {}  # id -> (member, "parameter", name)
        # storage address -> [((first byte, byte past the last), (member, noun, name, id))]
        self.spans: Spans = {}


Spans = dict[int, list[tuple[tuple[int, int], tuple[int, str, str, int]]]]


def _span(t: Tensor) -> tuple[int, int, int] | None:
    """The bytes of its storage that ``t`` can reach, or None where it has none."""
    if t.device.type == "meta" or t.numel() == 0 or t.layout != torch.strided:
        return None
    try:
        address = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without plain storage
        return None
    size = t.element_size()
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    low = t.storage_offset() * size
    return address, low, low + extent * size


def _overlapping(span: tuple[int, int, int], spans: Spans) -> Any:
    """The owner of a recorded span of the same storage that ``span`` overlaps, if any
    (looked up by storage address: members' tensors rarely share one)."""
    address, low, high = span
    for (other_low, other_high), owner in spans.get(address, ()):
        if low < other_high and other_low < high:
            return owner
    return None


def check_unshared(where: str, index: int, module: nn.Module, owners: Owners, *, add: bool) -> None:
    """Raise if member ``index`` holds a tensor that another member in ``owners`` holds.

    The loop trains a tensor two members share (a common backbone, one module passed
    twice) as one; an ensemble copies each member's tensors, which would then train
    apart. ``add``: record this member's tensors in ``owners`` for later members (only
    while the tensors stay alive: an id is unique among live objects only).
    """
    own: Spans = {}
    for noun, named in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for name, t in named:
            owner = owners.ids.get(id(t))
            if owner is not None and owner[0] != index:
                other, other_noun, other_name = owner
                raise ValueError(
                    f"{where}: member {index}'s {noun} `{name}` is the same tensor as member "
                    f"{other}'s {other_noun} `{other_name}`. An ensemble holds its own copy of "
                    "each member's tensors, so a change to one (a training step, an in-place "
                    "update, a parameter unfrozen later) would not reach the other, where the "
                    "loop's members share the one tensor. Pass separate modules (e.g. "
                    "copy.deepcopy(module) for each member), or keep the shared part out of "
                    "the ensemble and give its output as the input."
                )
            span = _span(t)
            if span is not None and (owner is None or owner[0] != index):
                other = _overlapping(span, own) or _overlapping(span, owners.spans)
                if other is not None and other[3] != id(t):
                    whose = "its" if other[0] == index else f"member {other[0]}'s"
                    raise ValueError(
                        f"{where}: member {index}'s {noun} `{name}` shares memory with "
                        f"{whose} {other[1]} `{other[2]}` (views of one tensor). An ensemble "
                        "holds a separate copy of each, so they would train apart, while "
                        "the loop writes the one memory they share. Give each its own "
                        "tensor (e.g. nn.Parameter(t.clone())), or use one tensor under "
                        "both names."
                    )
                own.setdefault(span[0], []).append((span[1:], (index, noun, name, id(t))))
            if add:
                owners.ids[id(t)] = (index, noun, name)
    if add:
        for address, entries in own.items():
            owners.spans.setdefault(address, []).extend(entries)


def _check_tensors(
    where: str, index: int, kind: str, ref: dict[str, TensorSpec], got: dict[str, TensorSpec]
) -> None:
    difference = key_difference(ref.keys() - got.keys(), got.keys() - ref.keys(), kind=kind)
    if difference:
        raise ValueError(
            f"{where}: member {index} {difference} compared with member 0. "
            "All members must share one architecture (same names, and the same tied "
            "weights)."
        )
    for name, spec in ref.items():
        other = got[name]
        for field in ("shape", "dtype", "device"):
            a, b = getattr(other, field), getattr(spec, field)
            if a != b:
                shown_a = tuple(a) if field == "shape" else a
                shown_b = tuple(b) if field == "shape" else b
                raise ValueError(
                    f"{where}: member {index} has {kind[:-1]} `{name}` with {field} "
                    f"{shown_a}; member 0 has {shown_b} (expected {shown_b} as member 0, got "
                    f"{shown_a}). "
                    + (
                        "All members must share one architecture."
                        if field == "shape"
                        else f"All members must share one {field}: convert them first "
                        f"(e.g. module.to({shown_b!r}))."
                    )
                )
        if kind == "parameters" and other.requires_grad != spec.requires_grad:
            raise ValueError(
                f"{where}: member {index} has parameter `{name}` with requires_grad="
                f"{other.requires_grad}; member 0 has requires_grad={spec.requires_grad} "
                f"(expected requires_grad={spec.requires_grad} as member 0, got "
                f"{other.requires_grad}). Freeze or unfreeze the same parameters in every "
                "member."
            )


def check_same_architecture(
    where: str, index: int, ref: Architecture, module: nn.Module
) -> Architecture:
    """Raise a clear error if ``module`` (member ``index``) differs from ``ref``.

    Compares the class, the parameters and buffers (names, shapes, dtypes, devices,
    ``requires_grad``), the train/eval modes, then everything else ``forward`` may
    read (see ``_structure``).
    """
    got = Architecture.of(module)
    if original_class(got.module) is not original_class(ref.module):
        ref_name, got_name = class_names(ref.module, got.module)
        raise TypeError(
            f"{where}: member {index} is a {got_name}; member 0 is a {ref_name} (expected "
            f"{a(ref_name)} as member 0, got {a(got_name)}). All members must share one "
            "architecture." + twin_classes(ref.module, got.module)
        )
    pairs = check_same_tree(where, index, ref.module, module)
    _check_tensors(where, index, "parameters", ref.params, got.params)
    _check_tensors(where, index, "buffers", ref.buffers, got.buffers)
    if got.modes != ref.modes:
        name = next(
            (k for k in ref.modes if got.modes.get(k) != ref.modes[k]),
            next(iter(got.modes.keys() - ref.modes.keys()), ""),
        )
        label = submodule(name)
        mode = "train" if got.modes.get(name) else "eval"
        ref_mode = "train" if ref.modes.get(name) else "eval"
        raise ValueError(
            f"{where}: member {index} has {label} in {mode} mode; member 0 has it in "
            f"{ref_mode} mode (expected {ref_mode} mode as member 0, got {mode}). Call "
            ".train() or .eval() on all members first."
        )
    check_same_state(where, index, pairs)
    return got
