"""Members grouped by architecture: which group each joins, and their results put back in order.

A [`HeteroEnsemble`][funcensemble.HeteroEnsemble] runs one vectorized group per
architecture. "Same architecture" is exactly what [`stack`][funcensemble.stack]
requires (``_architecture.check_same_architecture``), so a member joins the first group
whose first member it could be stacked with. Inputs split over members are split into
the groups' members; the groups' ``[N_g, ...]`` results are put back into member order
``[N, ...]``.
"""

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .. import _tree
from .._core.in_dims import leaf_dims
from .._structure.architecture import (
    Architecture,
    Owners,
    check_is_module,
    check_same_architecture,
    check_unshared,
)


def group_by_architecture(where: str, modules: Sequence[nn.Module]) -> list[list[int]]:
    """The members' indices, grouped by architecture, groups in order of first appearance."""
    refs: list[Architecture] = []
    groups: list[list[int]] = []
    owners = Owners()  # every member's tensors: the modules are all alive in `modules`
    for i, module in enumerate(modules):
        check_is_module(where, i, module)
        check_unshared(where, i, module, owners, add=True)
        for ref, members in zip(refs, groups, strict=True):
            try:
                check_same_architecture(where, i, ref, module)
            except (TypeError, ValueError):
                continue  # another architecture: try the next group
            members.append(i)
            break
        else:
            refs.append(Architecture.of(module))
            groups.append([i])
    return groups


def select_inputs(args: tuple[Any, ...], dims: tuple[Any, ...], index: Tensor) -> tuple[Any, ...]:
    """The positional inputs of the members ``index``: mapped leaves indexed, others shared.

    ``dims`` as ``_in_dims.per_argument`` returns them (checked there, trusted here).
    """
    out = []
    for k, (arg, dim) in enumerate(zip(args, dims, strict=True)):
        if dim is None:
            out.append(arg)
            continue
        leaves, flat = leaf_dims(k, arg, dim)
        picked = [
            x if d is None else x.index_select(d, index.to(x.device))
            for x, d in zip(leaves, flat, strict=True)
        ]
        out.append(_tree.unflatten(_tree.flatten(arg)[1], picked))
    return tuple(out)


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        if x.dim() == 0:
            return "a 0-dim tensor (no member axis)"
        return f"shape {tuple(x.shape[1:])}, {x.dtype}, {x.device} per member"
    return f"the value {x!r}"


@functools.lru_cache(maxsize=64)
def member_order(groups: tuple[tuple[int, ...], ...]) -> Tensor:
    """Where member i's result sits in the groups' results concatenated: ``[N]`` indices.

    Cached (it is the same for every call of one ensemble); never written to.
    """
    order = [i for members in groups for i in members]
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return inverse


def regroup(
    where: str, what: str, per_group: Sequence[Any], groups: Sequence[Sequence[int]], fix: str
) -> Any:
    """The groups' stacked results ``[N_g, ...]`` as one ``[N, ...]`` result in member order.

    Every group's result must have the same structure and, leaf by leaf, the same shape
    after the member axis, dtype and device; otherwise a ValueError names two members
    whose results differ, and says ``fix``. Differentiable: the groups' tensors are concatenated and
    reordered, so gradients flow back to each group.
    """
    if len(per_group) == 1:  # one group holds every member, in member order
        return per_group[0]
    flat = [_tree.flatten(out) for out in per_group]
    spec0, leaves0 = flat[0][1], flat[0][0]
    first = groups[0][0]
    for g, (leaves, spec) in enumerate(flat[1:], start=1):
        member = groups[g][0]
        if spec != spec0:
            raise ValueError(
                f"{where}: member {member}'s {what} has the structure {spec}; member "
                f"{first}'s has {spec0}. {fix}"
            )
        for leaf, ref in zip(leaves, leaves0, strict=True):
            same = (
                isinstance(leaf, Tensor)
                and isinstance(ref, Tensor)
                and leaf.dim() > 0
                and ref.dim() > 0
                and (leaf.shape[1:], leaf.dtype, leaf.device)
                == (ref.shape[1:], ref.dtype, ref.device)
            )
            tensors = isinstance(leaf, Tensor) or isinstance(ref, Tensor)
            if (tensors and not same) or (not tensors and leaf != ref):
                raise ValueError(
                    f"{where}: member {member}'s {what} has {_describe(leaf)}; member "
                    f"{first}'s has {_describe(ref)}. {fix}"
                )
    inverse = member_order(tuple(tuple(m) for m in groups))
    out = []
    for k, ref in enumerate(leaves0):
        if not isinstance(ref, Tensor):
            out.append(ref)  # a non-tensor leaf equal in structure: the first group's
            continue
        joined = torch.cat([leaves[k] for leaves, _ in flat])
        out.append(joined.index_select(0, inverse.to(joined.device)))
    return _tree.unflatten(spec0, out)


def per_member(per_group: Sequence[Any], groups: Sequence[Sequence[int]], n: int) -> list[Any]:
    """The groups' stacked results as a list of N per-member results, in member order."""
    out: list[Any] = [None] * n
    for result, members in zip(per_group, groups, strict=True):
        for position, i in enumerate(members):
            out[i] = _tree.tree_map(
                lambda x, p=position: x[p] if isinstance(x, Tensor) and x.dim() else x, result
            )
    return out
