"""Stacking N same-architecture modules into one stateless function plus stacked state."""

import collections
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._messages import key_difference
from .._structure.architecture import (
    Architecture,
    Owners,
    check_is_module,
    check_same_architecture,
    check_unshared,
)
from .._types import StackedTensors
from .functional_module import FunctionalModule
from .skeleton import held_by_all, keep_shared, meta_skeleton, replace_tensors, user_objects


def stack(
    modules: Sequence[nn.Module] | nn.ModuleList,
) -> tuple[FunctionalModule, StackedTensors, StackedTensors]:
    """Stack N same-architecture modules into one stateless function and its state.

    Only the members' tensors may differ. ``fmodel`` runs every member through one
    copy of ``modules[0]``, so the members must agree on everything else ``forward``
    can read: submodule classes and tree, every non-tensor attribute of every
    submodule (except ``nn.Module``'s own bookkeeping), hooks and parametrizations
    (see the how-to page "Unsupported layers"). Modules parametrized with
    ``torch.nn.utils.parametrize`` stack their original tensors.

    Args:
        modules: A non-empty sequence of modules of one architecture (same class,
            parameter and buffer names, shapes, dtypes, devices, train/eval modes,
            and the same non-tensor state).

    Returns:
        ``(fmodel, params, buffers)``: ``fmodel`` is a
        [`FunctionalModule`][funcensemble.FunctionalModule] computing one member;
        ``params`` and ``buffers`` are dicts keyed by state-dict names whose tensors
        have a leading member axis of size N. Stacked parameters
        are fresh autograd leaves: nothing aliases the input modules' tensors. They
        keep the members' ``requires_grad``: a frozen parameter stays frozen (see
        [`value_and_grad`][funcensemble.value_and_grad]).

    Raises:
        ValueError: No modules, or members differing in names, shapes, dtypes,
            devices, ``requires_grad``, train/eval mode, submodule tree, any non-tensor
            attribute, hooks or parametrizations (the message names the member, the
            submodule, the attribute and both values).
        TypeError: A member that is not an ``nn.Module``, members (or submodules) of
            different classes, or a layer that cannot run under ``vmap`` (fused RNNs).

    Example:
        >>> import torch, funcensemble as fe
        >>> heads = [torch.nn.Linear(8, 4) for _ in range(16)]
        >>> fmodel, params, buffers = fe.stack(heads)
        >>> params["weight"].shape
        torch.Size([16, 4, 8])
        >>> fe.vmap(fmodel)(params, buffers, torch.randn(32, 8)).shape
        torch.Size([16, 32, 4])
    """
    return stack_as("stack", modules)


def member_list(
    where: str,
    modules: object,  # checked here: a single module or nothing gets a clear error
    sequences: str = "a list or an nn.ModuleList",
) -> list[nn.Module]:
    """``modules`` as a non-empty list, or a clear error for a single module or none.

    ``sequences`` names what ``where`` accepts in the error message.
    """
    if type(modules).__name__ in ("Ensemble", "HeteroEnsemble") and isinstance(
        modules, nn.Module
    ):  # (by name: the ensemble classes import this module)
        parts = (
            "Its functional parts are ens.fmodel, ens.stacked_params() and ens.stacked_buffers(); "
            if type(modules).__name__ == "Ensemble"
            else ""
        )
        raise TypeError(
            f"{where}: modules is an fe.{type(modules).__name__}, already stacked "
            f"(expected a sequence of ordinary modules, got an ensemble). {parts}"
            "ens.unstack() gives its members as ordinary modules."
        )
    if isinstance(modules, nn.Module) and not isinstance(modules, nn.ModuleList):
        raise TypeError(
            f"{where}: modules is a single module (expected a sequence of modules such as "
            f"{sequences}, got a single {type(modules).__name__}). Wrap it in a list."
        )
    members: list[nn.Module] = list(modules)  # type: ignore[call-overload]
    if not members:
        raise ValueError(
            f"{where}: modules is empty (expected at least one module, got 0). Pass one "
            "module per member."
        )
    return members


def stack_as(
    where: str, modules: Sequence[nn.Module] | nn.ModuleList
) -> tuple[FunctionalModule, dict[str, Tensor], dict[str, Tensor]]:
    """[`stack`][funcensemble.stack], with errors naming the public entry point ``where``."""
    modules = member_list(where, modules)
    first, params, buffers = stack_members(where, iter(modules), len(modules), alive=True)
    return FunctionalModule(meta_skeleton(first, where=where)), params, buffers


def put_member(stacked: Mapping[str, Tensor], i: int, values: Mapping[str, Any]) -> None:
    """Copy one member's tensors into slot ``i`` of the stacked tensors of the same names
    (``values`` may hold more names; only those of ``stacked`` are read)."""
    with torch.no_grad():
        for name, target in stacked.items():
            target[i].copy_(values[name])


def stack_members(
    where: str, members: Iterator[nn.Module], num_members: int, *, alive: bool
) -> tuple[nn.Module, dict[str, Tensor], dict[str, Tensor]]:
    """The one stacking loop (``stack``, ``Ensemble``, ``Ensemble.from_factory``).

    Takes ``num_members`` modules from ``members`` one at a time, checks each against
    member 0 and copies it into preallocated ``[N, ...]`` tensors, so that a lazy
    ``members`` (a factory) never holds more than one member besides member 0. Returns
    member 0 and the stacked parameters (fresh autograd leaves with the members'
    ``requires_grad``) and buffers. ``alive``: the members outlive this call (a list),
    so a tensor shared by any two is found; else (a factory) one shared with member 0.
    """
    first = check_is_module(where, 0, next(members))
    ref = Architecture.of(first)
    # Tensor ids are unique among live tensors only: record those that stay alive.
    owners = Owners()
    check_unshared(where, 0, first, owners, add=True)

    def empty(specs: Mapping[str, Any]) -> dict[str, Tensor]:
        return {
            k: torch.empty((num_members, *s.shape), dtype=s.dtype, device=s.device)
            for k, s in specs.items()
        }

    params, buffers = empty(ref.params), empty(ref.buffers)
    put_member(params, 0, dict(first.named_parameters()))
    put_member(buffers, 0, dict(first.named_buffers()))
    # Objects every member holds (one object, not equal ones): kept, not copied.
    common = user_objects(first)
    for i in range(1, num_members):
        member = check_is_module(where, i, next(members))
        check_same_architecture(where, i, ref, member)
        check_unshared(where, i, member, owners, add=alive)
        put_member(params, i, dict(member.named_parameters()))
        put_member(buffers, i, dict(member.named_buffers()))
        common = held_by_all(common, [member])
        del member
    for k, s in ref.params.items():
        params[k].requires_grad_(s.requires_grad)
    keep_shared(first, common)
    return first, params, buffers


def check_state_dicts(where: str, params: Any, buffers: Any) -> None:
    """Check that ``params`` and ``buffers`` are dicts of tensors, as ``stack`` returns."""
    for argument, tree in (("params", params), ("buffers", buffers)):
        if not isinstance(tree, dict):
            raise TypeError(
                f"{where}: {argument} must be a dict of stacked tensors keyed by state-dict "
                f"names, as fe.stack returns (expected a dict, got {type(tree).__name__}). "
                f"Pass the "
                f"{argument} dict from fe.stack"
                + (" ({} for a module without buffers)." if argument == "buffers" else ".")
            )
        for name, t in tree.items():
            if not isinstance(t, Tensor):
                raise TypeError(
                    f"{where}: {argument}[{name!r}] is a {type(t).__name__}, not a tensor "
                    f"(expected a tensor with the member axis first, got {type(t).__name__}). "
                    "Pass the dicts from fe.stack."
                )
    if params.keys() & buffers.keys():
        name = sorted(params.keys() & buffers.keys())[0]
        raise ValueError(
            f"{where}: {name!r} is in both params and buffers (expected each name in one "
            "of them: parameters in params, buffers in buffers, as fe.stack returns "
            "them). Remove it from the one it does not belong to."
        )


def _num_members(
    where: str, params: Any, buffers: Any, *, checked: bool = False, computing: bool = False
) -> int:
    """N, the one leading size of every stacked tensor; ``checked``: the dicts have
    passed [`check_state_dicts`][] already; ``computing``: a call computing the members'
    results, which refuses N = 0 (``unstack`` of no members gives no modules)."""
    if not checked:
        check_state_dicts(where, params, buffers)
    sizes = {
        name: (t.shape[0] if t.dim() else None)
        for name, t in list(params.items()) + list(buffers.items())
    }
    if not sizes:
        raise ValueError(
            f"{where}: the module has no state to map over (expected stacked parameters or "
            "buffers with a leading member axis, got none). Pass the parameters and "
            "buffers that fe.stack returned."
        )
    first_name, n = next(iter(sizes.items()))
    counts = collections.Counter(size for size in sizes.values() if size is not None)
    ranked = counts.most_common(2)
    if len(ranked) == 2 and ranked[0][1] == ranked[1][1]:
        # No size is shared by most tensors: naming one as N would blame the other.
        listed = "; ".join(f"`{name}`: {size}" for name, size in list(sizes.items())[:6])
        raise ValueError(
            f"{where}: the stacked tensors' leading sizes disagree ({listed}"
            f"{'; ...' if len(sizes) > 6 else ''}), and no size is shared by most of them "
            "(expected one member axis of one size N first in every tensor). A tensor "
            "of one member's shape lacks the member axis: pass the params and buffers "
            "fe.stack returned, or stack that tensor's members along a new first axis."
        )
    if ranked and ranked[0][0] != n:  # most tensors agree: theirs is N
        n = ranked[0][0]
        first_name = next(name for name, size in sizes.items() if size == n)
    for name, size in sizes.items():
        if size != n or size is None:
            raise ValueError(
                f"{where}: `{name}` has leading size {size}, but `{first_name}` has {n} "
                f"(expected {n}, got {size}). Every stacked tensor must have the member "
                "axis first, of one size N."
            )
    assert n is not None
    if n == 0 and computing:
        raise ValueError(
            f"{where}: the stacked tensors have no members (expected a leading member axis "
            f"of at least 1, got 0 in `{first_name}`), as fe.stack and Ensemble.select "
            "refuse an empty ensemble. Select at least one member."
        )
    return n


def unstack(
    fmodel: FunctionalModule,
    params: StackedTensors | None = None,
    buffers: StackedTensors | None = None,
) -> list[nn.Module]:
    """Turn a stacked ensemble back into N ordinary modules.

    Each returned module is an independent, contiguous copy (same class, hooks,
    tied weights and train/eval flags as the stacked architecture) that shares no
    storage with ``params`` or ``buffers``.

    Args:
        fmodel: The function returned by [`stack`][funcensemble.stack].
        params: Stacked parameters, leading member axis first.
        buffers: Stacked buffers, leading member axis first.

    Returns:
        A list of N modules; ``stack(unstack(fmodel, params, buffers))`` gives back
        exactly ``params`` and ``buffers``.

    Example:
        >>> import torch, funcensemble as fe
        >>> fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 2) for _ in range(4)])
        >>> heads = fe.unstack(fmodel, params, buffers)
        >>> len(heads), torch.equal(heads[2].weight, params["weight"][2])
        (4, True)
    """
    if not isinstance(fmodel, FunctionalModule):
        face = (
            " An Ensemble unstacks itself: ens.unstack()."
            if hasattr(fmodel, "unstack") and isinstance(fmodel, nn.Module)
            else ""
        )
        raise TypeError(
            f"unstack: fmodel is not a FunctionalModule (expected the one returned by "
            f"stack, got {type(fmodel).__name__}). Pass the three values fe.stack "
            f"returned: fe.unstack(fmodel, params, buffers).{face}"
        )
    if params is None or buffers is None:
        raise TypeError(
            "unstack: params and buffers are missing (expected the stacked parameters and "
            "buffers, as fe.stack returns them beside fmodel). Call "
            "fe.unstack(fmodel, params, buffers)."
        )
    check_state_dicts("unstack", params, buffers)
    ref = Architecture.of(fmodel.skeleton)
    for kind, expected, got in (
        ("parameters", ref.params, params),
        ("buffers", ref.buffers, buffers),
    ):
        difference = key_difference(expected.keys() - got.keys(), got.keys() - expected.keys())
        if difference:
            raise ValueError(
                f"unstack: the {kind} do not match the architecture: the dict {difference}. "
                f"Pass the {kind} that fe.stack returned with this fmodel."
            )
    n = checked_num_members("unstack", fmodel, params, buffers)
    return [member_module(fmodel.skeleton, params, buffers, i) for i in range(n)]


def checked_num_members(
    where: str, fmodel: FunctionalModule, params: Any, buffers: Any, *, computing: bool = False
) -> int:
    """N, after checking every stacked tensor's shape: the member axis first, then the
    member's shape ``fmodel`` recorded at build (a tensor of another shape would be
    sliced as if stacked); ``computing`` as for ``_num_members``."""
    n = _num_members(where, params, buffers, computing=computing)
    for name, t in (*params.items(), *buffers.items()):
        kind, shape = fmodel._member_shapes.get(name, ("tensor", None))
        if shape is not None and t.shape[1:] != shape:
            want, got = (n, *shape), tuple(t.shape)
            raise ValueError(
                f"{where}: {kind} `{name}` has shape {got}, but the members were built with "
                f"{tuple(shape)} (expected {want}: the member axis N={n}, then that shape; "
                f"got {got}). Keep the shapes the members were built with; to change them, "
                "build a new ensemble from modules of the new shapes."
            )
    return n


def member_module(
    skeleton: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor], i: int
) -> nn.Module:
    """An independent module holding member ``i`` of the stacked tensors."""

    def param(name: str, t: Tensor) -> Tensor:
        value = params[name][i].detach().clone(memory_format=torch.contiguous_format)
        return nn.Parameter(value, requires_grad=t.requires_grad)

    def buffer(name: str, _: Tensor) -> Tensor:
        return buffers[name][i].detach().clone(memory_format=torch.contiguous_format)

    return replace_tensors(skeleton, param, buffer)
