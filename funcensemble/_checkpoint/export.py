"""Per-member ``state_dict``s: out of an ensemble for plain PyTorch, and back in."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._core.ensemble import Ensemble
from .._core.functional_module import FunctionalModule
from .._core.stack import StackedTensors, put_member, unstack
from .._hetero.ensemble import HeteroEnsemble
from .._messages import key_difference
from .._structure.same_value import SameValue, show


def export_state_dicts(
    ensemble: Ensemble | HeteroEnsemble | FunctionalModule,
    params: StackedTensors | None = None,
    buffers: StackedTensors | None = None,
) -> list[dict[str, Any]]:
    """Each member's ``state_dict``, as the original architecture would write it.

    Member ``i``'s dict is exactly what ``module.state_dict()`` returns for an ordinary
    module holding member ``i``: every key the architecture has (tied weights under
    each of their names, non-persistent buffers left out, state-dict hooks applied),
    so ``module.load_state_dict(sd)`` (strict) loads it into the original
    architecture. The tensors are fresh copies that share nothing with the ensemble.

    Args:
        ensemble: An [`Ensemble`][funcensemble.Ensemble], a
            [`HeteroEnsemble`][funcensemble.HeteroEnsemble] (each member's dict as its
            own architecture writes it, in member order), or the
            [`FunctionalModule`][funcensemble.FunctionalModule] returned by
            [`stack`][funcensemble.stack] together with its ``params`` and ``buffers``.
        params: The stacked parameters, with a ``FunctionalModule`` only.
        buffers: The stacked buffers, with a ``FunctionalModule`` only.

    Returns:
        A list of N state_dicts, member 0 first.

    Raises:
        TypeError: An ``Ensemble`` with ``params``/``buffers``, or a
            ``FunctionalModule`` without them.

    Example:
        >>> import torch, funcensemble as fe
        >>> ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(4)])
        >>> state_dicts = fe.export_state_dicts(ens)
        >>> plain = torch.nn.Linear(3, 2)
        >>> _ = plain.load_state_dict(state_dicts[2])
        >>> len(state_dicts), torch.equal(plain.weight, ens.stacked.weight[2])
        (4, True)
    """
    where = "export_state_dicts"
    if isinstance(ensemble, Ensemble | HeteroEnsemble):
        if params is not None or buffers is not None:
            raise TypeError(
                f"{where}: pass an {type(ensemble).__name__} alone; params and buffers go with the "
                "FunctionalModule returned by fe.stack."
            )
        members = ensemble.unstack()
    elif not isinstance(ensemble, FunctionalModule):
        raise TypeError(
            f"{where}: expected an fe.Ensemble, an fe.HeteroEnsemble, or a FunctionalModule "
            f"with its stacked params and buffers, got {type(ensemble).__name__}. A plain "
            "module's own state_dict() is its export."
        )
    else:
        if params is None or buffers is None:
            raise TypeError(
                f"{where}: a FunctionalModule needs its stacked params and buffers: "
                "export_state_dicts(fmodel, params, buffers)."
            )
        members = unstack(ensemble, params, buffers)
    return [member.state_dict() for member in members]


def import_state_dicts(
    ensemble: Ensemble | HeteroEnsemble, state_dicts: Sequence[Mapping[str, Any]]
) -> Ensemble | HeteroEnsemble:
    """Copy N per-member ``state_dict``s into ``ensemble``, in place.

    The inverse of [`export_state_dicts`][funcensemble.export_state_dicts]: member
    ``i`` of ``ensemble`` receives ``state_dicts[i]``, e.g. ``torch.load``-ed
    checkpoints of N separately trained models. All dicts are checked against the
    ensemble's architecture before anything is copied: the same keys as the
    architecture's own ``state_dict`` (tied weights under each of their names, with
    equal values), the same per-member shapes and the same dtypes. Tensors may be on
    any device. A module's non-tensor extra state (``get_extra_state``) is not stacked:
    it must be the same in every dict, and is set once with ``set_extra_state``. Where
    the architecture's modules have state-dict hooks, or classes of your own override
    how they save or load, each dict is instead loaded into a copy of its member with
    ``load_state_dict`` (the hooks run as in the loop; keys and shapes checked, dtypes
    cast as it casts them), and the copies are written in once all have loaded.

    Args:
        ensemble: The ensemble to overwrite: an [`Ensemble`][funcensemble.Ensemble], or a
            [`HeteroEnsemble`][funcensemble.HeteroEnsemble] (member ``i``'s dict for
            its own architecture; every group's dicts are checked before any is
            copied).
        state_dicts: One mapping from state-dict names to tensors per member.

    Returns:
        ``ensemble`` itself.

    Raises:
        TypeError: ``ensemble`` is not an ``Ensemble`` or ``HeteroEnsemble``, or
            ``state_dicts`` is not a sequence of mappings of tensors.
        ValueError: A tensor sharing memory with the ensemble's own (a slice of
            ``ens.state_dict()``: clone it first, or use ``copy_members_``). Not one
            dict per member, or a dict with missing or extra keys, a
            different shape or dtype, tied names holding different values, or extra
            states that differ between members.

    Example:
        >>> import torch, funcensemble as fe
        >>> trained = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> ens = fe.Ensemble.from_factory(lambda: torch.nn.Linear(3, 2), num_members=4)
        >>> _ = fe.import_state_dicts(ens, [m.state_dict() for m in trained])
        >>> torch.equal(ens.stacked.bias[3], trained[3].bias)
        True
    """
    where = "import_state_dicts"
    if not isinstance(ensemble, (Ensemble, HeteroEnsemble)):
        hint = (
            "For the functional face, build new stacked tensors from loaded modules: "
            "fe.stack(modules)."
            if isinstance(ensemble, FunctionalModule)
            else "Load a plain module with its own load_state_dict."
        )
        raise TypeError(
            f"{where}: expected an fe.Ensemble or fe.HeteroEnsemble to copy the members "
            f"into, got {type(ensemble).__name__}. {hint}"
        )
    if isinstance(state_dicts, Mapping) or not isinstance(state_dicts, Sequence):
        raise TypeError(
            f"{where}: expected a sequence of state_dicts, one per member, got a "
            f"{type(state_dicts).__name__}. Wrap a single state_dict in a list."
        )
    n = (
        ensemble.num_members
        if isinstance(ensemble, HeteroEnsemble)
        else ensemble._checked_num_members(where)
    )
    if len(state_dicts) != n:
        raise ValueError(
            f"{where}: got {len(state_dicts)} state_dicts; the ensemble has {n} members. "
            "Pass exactly one state_dict per member."
        )
    if isinstance(ensemble, HeteroEnsemble):
        parts = [
            (ens, list(members))
            for ens, members in zip(ensemble.groups, ensemble.group_members, strict=True)
        ]
    else:
        parts = [(ensemble, list(range(n)))]
    _refuse_own_memory(where, ensemble, state_dicts)
    # Every group's dicts are checked before any group is written.
    writes = [
        _checked(where, ens, [state_dicts[i] for i in members], members) for ens, members in parts
    ]
    for write in writes:
        write()
    return ensemble


def _refuse_own_memory(
    where: str, ensemble: Ensemble | HeteroEnsemble, state_dicts: Sequence[Any]
) -> None:
    """Refuse dicts holding the ensemble's own memory (``ens.state_dict()`` sliced per
    member): the members are written one after another, so a later member's dict would
    read what an earlier one's write has already replaced."""
    own: list[tuple[torch.device, int, int, str]] = []  # (device, start, end, name)
    for name, t in (*ensemble.named_parameters(), *ensemble.named_buffers()):
        start = _address(t)
        if start:
            own.append((t.device, start, start + t.untyped_storage().nbytes(), name))
    for i, state_dict in enumerate(state_dicts):
        if not isinstance(state_dict, Mapping):
            continue  # (refused by the checks that follow, naming the member)
        for key, value in state_dict.items():
            start = _address(value) if isinstance(value, Tensor) else 0
            if not start:
                continue  # (not a tensor with memory: the checks that follow say so)
            end = start + value.untyped_storage().nbytes()
            name = next(
                (n for d, lo, hi, n in own if d == value.device and lo < end and start < hi),
                None,
            )
            if name is not None:
                raise ValueError(
                    f"{where}: member {i}'s `{key}` shares memory with the ensemble's own "
                    f"`{name}` (expected tensors of their own, such as "
                    "fe.export_state_dicts gives; got a view of the ensemble's, e.g. a "
                    "slice of ens.state_dict()). The members are written one after "
                    "another, so a later member would read values an earlier write has "
                    "already replaced. Clone the dicts first "
                    "({k: v.clone() for k, v in d.items()}), or reorder or copy members "
                    "with ens.copy_members_(destinations, sources)."
                )


def _address(t: Tensor) -> int:
    """Where ``t``'s memory starts, or 0 where it has none to share (empty, meta)."""
    if t.numel() == 0 or t.device.type == "meta":
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a subclass or wrapper without storage
        return 0


# The tables of hooks that change what a state_dict holds or how it loads.
_STATE_DICT_HOOKS = (
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_STATE_DICT_METHODS = (
    "state_dict",
    "load_state_dict",
    "_save_to_state_dict",
    "_load_from_state_dict",
)


def _custom_state_dicts(module: nn.Module) -> bool:
    """Whether a submodule's state_dict is not simply its tensors by name: state-dict
    hooks, or a class outside torch overriding how it saves or loads."""
    for sub in module.modules():
        own = vars(sub)
        if any(own.get(table) for table in _STATE_DICT_HOOKS):
            return True
        cls = type(sub)
        if not cls.__module__.startswith("torch.") and any(
            getattr(cls, name) is not getattr(nn.Module, name) for name in _STATE_DICT_METHODS
        ):
            return True
    return False


def _checked(
    where: str, ensemble: Ensemble, state_dicts: list[Any], members: list[int]
) -> Callable[[], None]:
    """Check ``state_dicts`` (of the ensemble's members ``members``, named so in errors)
    against ``ensemble``; return the function that copies them in."""
    if _custom_state_dicts(ensemble.stacked):
        return _checked_by_loading(where, ensemble, state_dicts, members)
    # The architecture's state_dict names, each mapped to its live stacked tensor, and
    # the names of its modules' non-tensor extra states (get_extra_state).
    own = ensemble.stacked.state_dict(keep_vars=True)
    targets: dict[str, Tensor] = {k: v for k, v in own.items() if isinstance(v, Tensor)}
    extras = [k for k, v in own.items() if not isinstance(v, Tensor)]
    tied: dict[int, list[str]] = {}
    for key, target in targets.items():
        tied.setdefault(id(target), []).append(key)
    for i, state_dict in zip(members, state_dicts, strict=True):
        _check_member(where, i, state_dict, targets, extras, list(tied.values()))
    _check_extra_states(where, state_dicts, extras, members)
    stacked = {names[0]: targets[names[0]] for names in tied.values()}

    def write() -> None:
        for key in extras:
            path = key.removesuffix(_EXTRA_STATE).removesuffix(".")
            ensemble.stacked.get_submodule(path).set_extra_state(state_dicts[0][key])
        for i, state_dict in enumerate(state_dicts):
            put_member(stacked, i, state_dict)

    return write


_EXTRA_STATE = "_extra_state"


def _checked_by_loading(
    where: str, ensemble: Ensemble, state_dicts: list[Any], members: list[int]
) -> Callable[[], None]:
    """``_checked`` for architectures whose state_dicts hooks or overrides transform:
    each dict is loaded into an independent copy of its member with
    ``load_state_dict`` (its hooks run as the loop runs them; strict, so keys and
    shapes are checked), and only once every member has loaded are the copies'
    tensors written into the ensemble."""
    copies = []
    for k, (i, state_dict) in enumerate(zip(members, state_dicts, strict=True)):
        _check_is_mapping(where, i, state_dict)
        member = ensemble.member(k)
        try:
            member.load_state_dict(state_dict)
        except (RuntimeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"{where}: member {i}'s state_dict does not load into the ensemble's "
                f"architecture (its modules' state-dict hooks run as in load_state_dict): "
                f"{' '.join(str(error).split())}"
            ) from error
        copies.append(member)
    own = ensemble.stacked.state_dict(keep_vars=True)
    extras = [k for k, v in own.items() if not isinstance(v, Tensor)]
    loaded_extras = [
        {key: m.get_submodule(_extra_path(key)).get_extra_state() for key in extras} for m in copies
    ]
    _check_extra_states(where, loaded_extras, extras, members)
    stacked = {**ensemble.stacked_params(), **ensemble.stacked_buffers()}

    def write() -> None:
        for key in extras:
            ensemble.stacked.get_submodule(_extra_path(key)).set_extra_state(loaded_extras[0][key])
        for k, member in enumerate(copies):
            put_member(
                stacked, k, {**dict(member.named_parameters()), **dict(member.named_buffers())}
            )

    return write


def _extra_path(key: str) -> str:
    return key.removesuffix(_EXTRA_STATE).removesuffix(".")


def _check_extra_states(
    where: str, state_dicts: Sequence[Mapping[str, Any]], extras: list[str], members: list[int]
) -> None:
    same = SameValue({}, set())
    for key in extras:
        first = state_dicts[0][key]
        for i, state_dict in zip(members[1:], state_dicts[1:], strict=True):
            if not same(first, state_dict[key]):
                raise ValueError(
                    f"{where}: member {i} has `{key}` = {show(state_dict[key])}; member "
                    f"{members[0]} has {show(first)}. The ensemble runs one copy of this "
                    "module for all members, so its extra state (get_extra_state) must be the "
                    "same in every member: make it equal, or build one ensemble per value."
                )


def _check_is_mapping(where: str, i: int, state_dict: Any) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{where}: state_dicts[{i}] is a {type(state_dict).__name__}, not a mapping "
            f"(expected a mapping from names to tensors, got {type(state_dict).__name__}). "
            "Pass each member's module.state_dict()."
        )


def _check_member(
    where: str,
    i: int,
    state_dict: Any,
    targets: dict[str, Tensor],
    extras: list[str],
    tied_groups: list[list[str]],
) -> None:
    _check_is_mapping(where, i, state_dict)
    expected = targets.keys() | set(extras)
    difference = key_difference(expected - state_dict.keys(), state_dict.keys() - expected)
    if difference:
        raise ValueError(
            f"{where}: member {i} {difference} compared with the ensemble's "
            "architecture. All members must share one architecture (same names, and the "
            "same tied weights)."
        )
    for key, target in targets.items():
        value = state_dict[key]
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{where}: member {i} has `{key}` of type {type(value).__name__} (expected a "
                f"Tensor, got {type(value).__name__}). Every value of a state_dict must be a "
                "tensor."
            )
        if value.layout != torch.strided:
            raise ValueError(
                f"{where}: member {i} has `{key}` as a {value.layout} tensor (expected a "
                f"dense (strided) tensor, got {value.layout}). Convert it first "
                "(value.to_dense())."
            )
        if value.is_meta:
            raise ValueError(
                f"{where}: member {i} has `{key}` on the meta device, which holds no values "
                "(expected a tensor with values, got a meta tensor). Pass state_dicts of "
                "materialized modules (module.to_empty(...) and load or initialize them)."
            )
        if value.shape != target.shape[1:]:
            raise ValueError(
                f"{where}: member {i} has `{key}` with shape {tuple(value.shape)}; the "
                f"ensemble has {tuple(target.shape[1:])} (expected "
                f"{tuple(target.shape[1:])}, got {tuple(value.shape)}). All members must "
                "share one architecture."
            )
        if value.dtype != target.dtype:
            raise ValueError(
                f"{where}: member {i} has `{key}` with dtype {value.dtype}; the ensemble "
                f"has {target.dtype} (expected {target.dtype}, got {value.dtype}). Convert "
                "the state_dicts or the ensemble first (e.g. ens.to(...))."
            )
    for names in tied_groups:
        first = state_dict[names[0]]
        for other in names[1:]:
            value = state_dict[other]
            if value is not first and not torch.equal(value.to(first.device), first):
                raise ValueError(
                    f"{where}: member {i} has different values under `{names[0]}` and "
                    f"`{other}`, which are one tied weight in this architecture."
                )
