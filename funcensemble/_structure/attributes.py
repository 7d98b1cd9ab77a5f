"""What members must share besides their tensors: classes, submodules, attributes, hooks.

An ensemble runs every member through one copy of member 0 (its *skeleton*) holding the
stacked tensors. Everything ``forward`` reads that is not a parameter or buffer, such
as a LeakyReLU's slope, a BatchNorm's momentum, a Conv's padding, a hook or a
parametrization, therefore comes from member 0 for all members. So members must agree on
all of it, compared submodule by submodule:

- the class (for a parametrized module, the class before parametrization), the names
  and order of the child modules, which submodules are one shared instance, which
  parameter and buffer slots exist (including slots set to ``None``), and which of
  them hold one tied tensor;
- every entry of the submodule's ``__dict__`` except ``nn.Module``'s own bookkeeping
  (`BOOKKEEPING`: the tensors, children and train/eval flag, checked elsewhere, and the
  hook tables), with values compared by ``SameValue`` (``_same_value``);
  user-defined modules are covered by the same rule;
- the hooks: forward, forward pre-, backward, backward pre-, state-dict and
  load-state-dict hooks, in order, each the same function (or the same code with equal
  captured values), with the same ``with_kwargs``/``always_call`` flags (backward
  hooks never get here: ``backward_hooks`` refuses them, as they do not run in ``vmap``).

Parametrizations (``torch.nn.utils.parametrize``) are submodules (``parametrizations``),
so they are compared by the same rules.
"""

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._messages import submodule
from .same_value import SameValue, draws, show
from .tensor_tags import tensor_tags

# nn.Module's own bookkeeping: tensors and children (compared as the tree and by the
# architecture's tensor specs), the train/eval flag (compared as modes), hook tables
# (compared below, by hook rather than by handle id).
HOOKS = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
    "_state_dict_pre_hooks": "state-dict pre-hook",
    "_state_dict_hooks": "state-dict hook",
    "_load_state_dict_pre_hooks": "load-state-dict pre-hook",
    "_load_state_dict_post_hooks": "load-state-dict post-hook",
}
# Sets of handle ids flagging hooks of the table named beside them.
_HOOK_FLAGS = {
    "_forward_hooks_with_kwargs": "_forward_hooks",
    "_forward_hooks_always_called": "_forward_hooks",
    "_forward_pre_hooks_with_kwargs": "_forward_pre_hooks",
}
# Every entry nn.Module's own __init__ makes (tables, flags): none is the user's.
TORCH_OWN = frozenset(vars(nn.Module()))
BOOKKEEPING = frozenset({"training", "_parameters", "_buffers", "_modules", *HOOKS, *_HOOK_FLAGS})

_SAME_ARCHITECTURE = "All members must share one architecture"
_SLOTS = (("_parameters", "parameter"), ("_buffers", "buffer"))
# Attributes of torch's modules that only reset_parameters reads (PReLU's init is the
# slope it starts from; forward reads the weight): members may differ in them.
_INIT_ONLY: dict[type, tuple[str, ...]] = {nn.PReLU: ("init",)}


def _instance(first: str, path: str) -> str:
    return "its own instance" if first == path else f"the same instance as `{first}`"


def _tensor_instance(first: str, slot: str) -> str:
    return "its own tensor" if first == slot else f"the same tensor as `{first}` (tied)"


def _parametrized(module: nn.Module) -> bool:
    # parametrize.is_parametrized, without nn.Module.__getattr__'s cost on a miss.
    return isinstance(module._modules.get("parametrizations"), nn.ModuleDict)


def original_class(module: nn.Module) -> type:
    """The module's class, before torch.nn.utils.parametrize replaced it."""
    cls = type(module)
    return cls.__bases__[0] if _parametrized(module) and _made_by_parametrize(cls) else cls


def _made_by_parametrize(cls: type) -> bool:
    """Whether ``cls`` is the subclass parametrize makes (``Parametrized<Base>``, with
    nothing of its own that forward reads), not a class of the user's that happens to
    hold a ``parametrizations`` ModuleDict (whose own forward would then go unseen)."""
    if len(cls.__bases__) != 1 or cls.__module__ != parametrize.__name__:
        return False
    return cls.__name__ == f"Parametrized{cls.__bases__[0].__name__}"


def _class_name(module: nn.Module) -> str:
    return original_class(module).__qualname__


def class_names(a: nn.Module, b: nn.Module) -> tuple[str, str]:
    """The two modules' classes (before parametrization), qualified where names clash."""
    cls_a, cls_b = original_class(a), original_class(b)
    if cls_a.__qualname__ != cls_b.__qualname__:
        return cls_a.__qualname__, cls_b.__qualname__
    return f"{cls_a.__module__}.{cls_a.__qualname__}", f"{cls_b.__module__}.{cls_b.__qualname__}"


def twin_classes(a: nn.Module, b: nn.Module) -> str:
    """A note for two modules of different classes with one qualified name, else ``""``."""
    names = class_names(a, b)
    if names[0] != names[1]:
        return ""
    return (
        " They are two class objects of the same name: the class was defined again (a "
        "notebook cell run twice, a class made inside a function); build every member "
        "from one class object."
    )


def _walk(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every (path, submodule), shared submodules under each of their paths."""
    stack = [("", module)]
    seen: set[int] = set()
    while stack:
        path, sub = stack.pop()
        yield path, sub
        if id(sub) in seen:
            continue  # a shared submodule: its subtree is walked once
        seen.add(id(sub))
        prefix = f"{path}." if path else ""
        children = [(f"{prefix}{k}", c) for k, c in sub._modules.items() if c is not None]
        stack.extend(reversed(children))


Pairs = list[tuple[str, nn.Module, nn.Module]]


def check_same_tree(where: str, index: int, ref: nn.Module, module: nn.Module) -> Pairs:
    """Raise if member ``index``'s submodule tree differs from member 0's (``ref``).

    Compares classes, parametrizations, child names and shared submodules, and returns
    the ``(path, member 0's submodule, member index's)`` pairs, each instance once, for
    ``check_same_state``.
    """
    first_path: dict[int, str] = {}
    ref_first: dict[int, str] = {}
    pairs: Pairs = []
    for (path, a), (_, b) in zip(_walk(ref), _walk(module), strict=False):
        _check_node(where, index, path, a, b)
        if ref_first.setdefault(id(a), path) != first_path.setdefault(id(b), path):
            raise ValueError(
                f"{where}: member {index} has {submodule(path)} as "
                f"{_instance(first_path[id(b)], path)}; member 0 has it as "
                f"{_instance(ref_first[id(a)], path)}. {_SAME_ARCHITECTURE}: share (tie) "
                "the same submodules in every member."
            )
        if first_path[id(b)] == path:
            pairs.append((path, a, b))
    return pairs


def check_same_state(where: str, index: int, pairs: Pairs) -> None:
    """Raise if the pairs of submodules differ in tensor slots, attributes or hooks."""
    same_as: dict[int, object] = {}
    first_a: dict[int, str] = {}  # a tensor of member 0 -> the first slot holding it
    first_b: dict[int, str] = {}
    for path, a, b in pairs:
        same_as[id(b)] = a
        dict_a, dict_b = vars(a), vars(b)
        for kind, noun in _SLOTS:
            table_a, table_b = dict_a[kind], dict_b[kind]
            if table_a.keys() != table_b.keys() or any(
                (t is None) is not (table_b[k] is None) for k, t in table_a.items()
            ):
                raise ValueError(
                    f"{where}: member {index} has {submodule(path)} with {noun}s "
                    f"{_slots(table_b)}; member 0 has {_slots(table_a)}. "
                    f"{_SAME_ARCHITECTURE}: the same names."
                )
            if list(table_a) != list(table_b):
                # self.parameters() lists them in this order: a forward that iterates
                # them would see member 0's order.
                raise ValueError(
                    f"{where}: member {index} has {submodule(path)} with its {noun}s "
                    f"registered in the order {list(table_b)}; member 0 has "
                    f"{list(table_a)} (the same names; torch.nn.utils.prune.remove and "
                    "parametrize.remove_parametrizations register the tensor again, "
                    f"last). {_SAME_ARCHITECTURE}, including this order, which "
                    f"self.{noun}s() follows. Build the members alike (remove "
                    "pruning or parametrizations on every member, or on none), or put "
                    f"the {noun}s in member 0's order: "
                    f"module._{noun}s = {{k: module._{noun}s[k] for k in {list(table_a)}}}."
                )
            for k, t in table_b.items():
                if t is not None:
                    same_as.setdefault(id(t), table_a[k])
                    slot = f"{path}.{k}" if path else k
                    tied_a = first_a.setdefault(id(table_a[k]), slot)
                    tied_b = first_b.setdefault(id(t), slot)
                    if tied_a != tied_b:
                        raise ValueError(
                            f"{where}: member {index} has {noun} `{slot}` as "
                            f"{_tensor_instance(tied_b, slot)}; member 0 has it as "
                            f"{_tensor_instance(tied_a, slot)}. {_SAME_ARCHITECTURE}: tie "
                            "the same parameters and buffers in every member."
                        )
    same = SameValue(same_as, {id(v) for v in same_as.values()})
    for path, a, b in pairs:
        _check_hooks(where, index, path, a, b, same)
        _check_attributes(where, index, path, a, b, same)
        _check_tensor_attributes(where, index, path, a, b, same)


def _check_tensor_attributes(
    where: str, index: int, path: str, a: nn.Module, b: nn.Module, same: SameValue
) -> None:
    """Python attributes set on the tensors themselves (``p.no_decay = True``, a tag
    that builds optimizer groups): the ensemble's stacked tensors carry member 0's."""
    for kind, noun in _SLOTS:
        table_a, table_b = vars(a)[kind], vars(b)[kind]
        for k, tb in table_b.items():
            ta = table_a[k]
            if ta is None or tb is None or (not vars(ta) and not vars(tb)):
                continue
            attrs_a, attrs_b = tensor_tags(ta), tensor_tags(tb)
            slot = f"{path}.{k}" if path else k
            for name in sorted(attrs_a.keys() | attrs_b.keys()):
                if name not in attrs_a or name not in attrs_b:
                    has, hasnt = (0, index) if name in attrs_a else (index, 0)
                    raise ValueError(
                        f"{where}: member {has} has {noun} `{slot}` with the attribute "
                        f"`{name}`; member {hasnt} has no such attribute. "
                        f"{_SAME_ARCHITECTURE}, including the attributes set on its "
                        "tensors: set it on every member or on none."
                    )
                if not same(attrs_a[name], attrs_b[name]):
                    raise ValueError(
                        f"{where}: member {index} has {noun} `{slot}` with `{name}` = "
                        f"{show(attrs_b[name])}; member 0 has `{name}` = "
                        f"{show(attrs_a[name])}. The ensemble's stacked tensor carries "
                        "one value for all members, so it must be the same in all: give "
                        f"`{name}` one value in every member, or build one ensemble per "
                        "value."
                    )


def _check_node(where: str, index: int, path: str, a: nn.Module, b: nn.Module) -> None:
    if original_class(a) is not original_class(b):
        cls_a, cls_b = class_names(a, b)
        raise TypeError(
            f"{where}: member {index} has {submodule(path)} of class {cls_b}; member 0 has "
            f"{cls_a} (expected {cls_a} as member 0, got {cls_b}). {_SAME_ARCHITECTURE}: "
            "build every member with the same classes." + twin_classes(a, b)
        )
    if _parametrized(a) != _parametrized(b):
        has, hasnt = (index, 0) if _parametrized(b) else (0, index)
        names = sorted((a if has == 0 else b).parametrizations.keys())
        raise ValueError(
            f"{where}: member {has} has parametrizations (torch.nn.utils.parametrize) of "
            f"{', '.join(f'`{n}`' for n in names)} on {submodule(path)}; member {hasnt} has "
            f"none there. {_SAME_ARCHITECTURE}: register the same parametrizations on "
            "every member (or on none)."
        )
    kids_a, kids_b = _slots(a._modules), _slots(b._modules)
    if kids_a != kids_b:
        raise ValueError(
            f"{where}: member {index} has {submodule(path)} with child modules {kids_b}; "
            f"member 0 has {kids_a} (expected {kids_a} as member 0, got {kids_b}). "
            f"{_SAME_ARCHITECTURE}: the same submodules, in the same order."
        )


def _slots(table: dict[str, object]) -> list[str]:
    """The names in a ``_modules``/``_parameters``/``_buffers`` table, ``None`` entries marked."""
    return [name if value is not None else f"{name}=None" for name, value in table.items()]


def _check_hooks(
    where: str, index: int, path: str, a: nn.Module, b: nn.Module, same: SameValue
) -> None:
    dict_a, dict_b = vars(a), vars(b)
    for table, noun in HOOKS.items():
        hooks_a, hooks_b = dict_a.get(table), dict_b.get(table)
        if not hooks_a and not hooks_b:
            continue
        hooks_a, hooks_b = list((hooks_a or {}).values()), list((hooks_b or {}).values())
        fix = (
            f"Register the same {noun}s on every member (or on none), e.g. in the function "
            "that builds a member, or register one on the Ensemble instead."
        )
        if len(hooks_a) != len(hooks_b):
            raise ValueError(
                f"{where}: member {index} has {len(hooks_b)} {noun}(s) on {submodule(path)}; "
                f"member 0 has {len(hooks_a)} (expected {len(hooks_a)} as member 0, got "
                f"{len(hooks_b)}). {fix}"
            )
        for k, (ha, hb) in enumerate(zip(hooks_a, hooks_b, strict=True)):
            if not same(ha, hb):
                raise ValueError(
                    f"{where}: member {index} has {noun} {k} on {submodule(path)} = "
                    f"{show(hb)}; member 0 has {show(ha)}. A hook must be the same function "
                    "(or the same code with equal captured values) on every member. " + fix
                )
    for flags, table in _HOOK_FLAGS.items():
        if not dict_a.get(flags) and not dict_b.get(flags):
            continue
        positions_a = _flagged(dict_a, flags, table)
        positions_b = _flagged(dict_b, flags, table)
        if positions_a != positions_b:
            raise ValueError(
                f"{where}: member {index} has {HOOKS[table]}s on {submodule(path)} at "
                f"positions {positions_b} registered with {flags.split('_hooks_')[1]}; "
                f"member 0 at {positions_a} (expected positions {positions_a} as member 0, got "
                f"{positions_b}). Register the same hooks with the same options on every "
                "member."
            )


def _flagged(attributes: dict, flags: str, table: str) -> list[int]:
    marked = attributes.get(flags) or {}
    return [k for k, handle in enumerate(attributes.get(table) or {}) if handle in marked]


# Types whose ``==`` is the whole comparison (floats are not: NaN and -0.0).
_PLAIN = frozenset({int, str, bool, type(None)})


def _check_attributes(
    where: str, index: int, path: str, a: nn.Module, b: nn.Module, same: SameValue
) -> None:
    dict_a, dict_b = vars(a), vars(b)
    if dict_a.keys() != dict_b.keys():
        for name in sorted((dict_a.keys() ^ dict_b.keys()) - BOOKKEEPING):
            has, hasnt = (0, index) if name in dict_a else (index, 0)
            raise ValueError(
                f"{where}: member {has} has {submodule(path)} with attribute `{name}`; member "
                f"{hasnt} has no such attribute. {_SAME_ARCHITECTURE}, including every "
                "attribute that forward may read: set it on every member or on none."
            )
    init_only = _INIT_ONLY.get(original_class(a), ())
    for name, va in dict_a.items():
        if name in BOOKKEEPING or name in init_only:
            continue
        vb = dict_b[name]
        if va is vb and draws(va):
            own = (
                "draw from torch's global generator (the ensemble's randomness option "
                "decides whether members draw alike)"
                if isinstance(va, torch.Generator)
                else "give each member its own (seeded alike, the members draw alike, as "
                "the ensemble does)"
            )
            raise ValueError(
                f"{where}: member {index} holds the same {type(va).__name__} as member 0 "
                f"in `{name}` of {submodule(path)} ({_class_name(b)}). In a loop the "
                "members draw from it in turn, each its own values; the ensemble runs "
                f"forward once for all members, which would all get one draw. Instead, "
                f"{own}, or pass the random values in as an input. If forward never "
                f"draws from it (it served __init__ only), delete it before building "
                f"(del member.{name} on that submodule)."
            )
        if (va is vb and id(va) not in same.own) or (
            type(va) is type(vb) and type(va) in _PLAIN and va == vb
        ):
            continue
        if isinstance(va, torch.Generator) and isinstance(vb, torch.Generator):
            raise ValueError(
                f"{where}: member {index} has {submodule(path)} ({_class_name(b)}) with "
                f"`{name}` = a torch.Generator of its own, as has member 0. Every member "
                "runs with member 0's non-tensor state, so all members would draw from "
                "member 0's generator, not each from its own as in a loop. Keep "
                "generators out of the members: draw from torch's global generator "
                "(the ensemble's randomness option decides whether members draw alike), "
                "or pass the random numbers in as an input."
            )
        if not same(va, vb):
            shown_b, shown_a = show(vb), show(va)
            if shown_a == shown_b:  # two large tensors alike in shape and dtype
                shown_b, shown_a = f"{shown_b} (other values)", f"{shown_a} (its own values)"
            raise ValueError(
                f"{where}: member {index} has {submodule(path)} ({_class_name(b)}) with "
                f"`{name}` = {shown_b}; member 0 has `{name}` = {shown_a}. Every member "
                "runs with member 0's non-tensor state, so it must be the same in all "
                f"members: give `{name}` one value in every member, or build one ensemble "
                f"per value.{_tensor_hint(va, vb)}"
            )


def _tensor_hint(va: object, vb: object) -> str:
    if not isinstance(va, Tensor) and not isinstance(vb, Tensor):
        return ""
    return (
        " A tensor stored as a plain attribute is neither stacked nor trained: register "
        "it with register_buffer (or as an nn.Parameter) so that each member keeps its "
        f"own. {LEGACY_HINT}"
    )


LEGACY_HINT = (
    "torch.nn.utils.weight_norm, torch.nn.utils.spectral_norm and torch.nn.utils.prune "
    "store such attributes: use torch.nn.utils.parametrizations.weight_norm / "
    "spectral_norm instead, or call prune.remove before stacking."
)
