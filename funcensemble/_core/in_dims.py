"""``in_dims``: checked once where a user gives it, then trusted below.

``in_dims`` says how the positional arguments after ``params`` and ``buffers`` are split
over members, as in ``torch.func.vmap``: ``None`` (shared by all members), an int (the
member dim of every mapped tensor), or a tuple with one entry per argument (each
``None``, an int, or a pytree of those matching a prefix of the argument). The public
entry points ([`vmap`][funcensemble.vmap], [`value_and_grad`][funcensemble.value_and_grad],
``Ensemble.forward``, ``ShardedEnsemble.map``) call [`check_type`][] when they are
built and [`per_argument`][] once per call; the layers below take its result as given.
"""

from collections.abc import Mapping
from typing import Any

import torch

from .. import _tree

InDims = int | None | tuple[Any, ...]

# Tensor types that pytrees take as one leaf.
_LEAF_TENSORS = (torch.Tensor, torch.nn.Parameter)


def check_type(where: str, in_dims: Any) -> None:
    """Refuse an ``in_dims`` that is not ``None``, an int or a tuple."""
    if not (in_dims is None or isinstance(in_dims, (int, tuple))) or isinstance(in_dims, bool):
        raise TypeError(
            f"{where}: in_dims must be None, an int or a tuple (expected e.g. (0, None), got "
            f"{type(in_dims).__name__}). Give one entry per positional argument, or one int "
            "for all."
        )
    if isinstance(in_dims, tuple):
        for entry in _tree.leaves(in_dims):
            if isinstance(entry, bool) or not (entry is None or isinstance(entry, int)):
                raise TypeError(
                    f"{where}: in_dims holds {entry!r}, a {type(entry).__name__} (expected "
                    "None or an int for every entry, nested ones included). Give the member "
                    "dim as an int, or None for what all members share."
                )


def arg_dims(in_dims: InDims, num_args: int, where: str = "vmap") -> tuple[Any, ...]:
    """One ``in_dims`` entry per positional argument."""
    if isinstance(in_dims, tuple):
        if len(in_dims) != num_args:
            raise ValueError(
                f"{where}: in_dims has {len(in_dims)} entries but the call passed {num_args} "
                f"positional argument(s){_after(where)}. Give one entry per "
                "argument (None = shared by all members, 0 = one slice per member)."
            )
        return in_dims
    if isinstance(in_dims, int) and num_args == 0:
        call = "ens(x, y, in_dims=0)" if where == "Ensemble" else "f(params, buffers, x, y)"
        raise ValueError(
            f"{where}: in_dims={in_dims} splits positional arguments over members, but the "
            f"call passed none{_after(where)} (expected at least one; keyword "
            "arguments are shared by all members, never split). Pass the per-member "
            f"inputs positionally, e.g. {call} rather than x=x, y=y."
        )
    if in_dims is None or isinstance(in_dims, int):
        return (in_dims,) * num_args
    raise TypeError(
        f"{where}: in_dims must be None, an int or a tuple with one entry per argument, got "
        f"{type(in_dims).__name__}."
    )


def leaf_dims(index: int, arg: Any, dim: Any, where: str = "vmap") -> tuple[list[Any], list[Any]]:
    """``arg``'s leaves and the member dim of each (``dim`` broadcast over ``arg``)."""
    flat = _tree.broadcast_prefix(dim, arg)
    if flat is None:
        raise ValueError(
            f"{where}: in_dims entry {index} ({dim!r}) does not match the structure of "
            f"argument {index} ({type(arg).__name__}{_difference(dim, arg)}). Give an int "
            "or None for the whole argument, or a pytree with the argument's keys and "
            "lengths."
        )
    return _tree.leaves(arg), flat


def _after(where: str) -> str:
    """Where the positional arguments ``in_dims`` describes start, in ``where``'s call."""
    return "" if where in ("Ensemble", "HeteroEnsemble") else " after params and buffers"


def _difference(dim: Any, arg: Any) -> str:
    """How a dict or sequence ``in_dims`` entry differs from its argument, at the top."""
    if isinstance(dim, Mapping) and isinstance(arg, Mapping):
        missing = [k for k in arg if k not in dim]
        extra = [k for k in dim if k not in arg]
        parts = [f"in_dims lacks {missing}"] * bool(missing) + [
            f"in_dims has {extra}, which the argument does not"
        ] * bool(extra)
        return ": " + "; ".join(parts) if parts else ""
    if isinstance(dim, (tuple, list)) and isinstance(arg, (tuple, list)) and len(dim) != len(arg):
        return f": {len(arg)} entries, in_dims {len(dim)}"
    return ""


def check_member_sizes(
    args: tuple[Any, ...], dims: tuple[Any, ...], n: int, where: str = "vmap"
) -> tuple[Any, ...]:
    """Check every mapped leaf has ``n`` members along its dim.

    Returns ``dims`` with each dict in an entry rebuilt in its argument's own container
    type and key order (``_tree.in_key_order``): ``torch.func.vmap`` pairs a dict entry of
    ``in_dims`` with the argument's keys by position, so a dict given in another key
    order would map the wrong leaf.
    """
    out = []
    for index, (arg, dim) in enumerate(zip(args, dims, strict=True)):
        if dim is None:
            out.append(None)
            continue
        if type(arg) in _LEAF_TENSORS and type(dim) is int:
            leaves, flat = [arg], [dim]  # what flattening a tensor gives, without the walk
        else:
            leaves, flat = leaf_dims(index, arg, dim, where)
        for position, (leaf, d) in enumerate(zip(leaves, flat, strict=True)):
            if d is None:
                continue
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(_not_a_tensor(where, index, arg, position, leaf, d))
            if not -leaf.dim() <= d < leaf.dim():
                raise ValueError(
                    f"{where}: {_named(index, arg, position, leaf)} has {leaf.dim()} "
                    f"dimension(s); it cannot be split over members along dim {d}."
                )
            if leaf.shape[d] != n:
                raise ValueError(
                    f"{where}: {_named(index, arg, position, leaf)} has size "
                    f"{leaf.shape[d]} along its member dim {d}, but the ensemble has {n} "
                    "members. A per-member input needs one slice per member; pass "
                    "in_dims=None for an input shared by all."
                )
        out.append(dim if isinstance(dim, int) else _tree.in_key_order(dim, arg))
    return tuple(out)


def _named(index: int, arg: Any, position: int, leaf: Any) -> str:
    """A mapped leaf as a message names it: its argument, and where it lies within it."""
    if leaf is arg:
        return f"argument {index}"
    return f"leaf `{_tree.flatten_with_paths(arg)[0][position]}` of argument {index}"


def _not_a_tensor(where: str, index: int, arg: Any, position: int, leaf: Any, dim: int) -> str:
    """The refusal of a mapped leaf that is not a tensor, naming it within its argument."""
    if leaf is arg:
        return (
            f"{where}: argument {index} is mapped (in_dims {dim}) but holds a "
            f"{type(leaf).__name__}; only tensors can be split over members. Pass "
            "in_dims None for that argument."
        )
    path = _tree.flatten_with_paths(arg)[0][position]
    return (
        f"{where}: leaf `{path}` of argument {index} is mapped (in_dims {dim}) but holds a "
        f"{type(leaf).__name__}; only tensors can be split over members. Give that leaf "
        "None in an in_dims entry shaped like the argument (e.g. {'x': 0, 'mask': None} "
        "for a dict of a per-member tensor and a None)."
    )


def per_argument(
    in_dims: InDims, args: tuple[Any, ...], n: int, where: str = "vmap"
) -> tuple[Any, ...]:
    """The one check of a call's ``in_dims`` against its arguments: one entry per
    argument, each ``None``, an int, or a pytree of those shaped like its argument."""
    dims = arg_dims(in_dims, len(args), where)
    if all(d is None for d in dims):  # nothing to check for shared inputs
        return dims
    return check_member_sizes(args, dims, n, where)


def narrow(args: tuple[Any, ...], dims: tuple[Any, ...], start: int, stop: int) -> tuple[Any, ...]:
    """The arguments of members ``start:stop``: mapped leaves narrowed, others shared.

    ``dims`` as [`per_argument`][] returns them (trusted, not checked again).
    """
    out = []
    for index, (arg, dim) in enumerate(zip(args, dims, strict=True)):
        if dim is None:
            out.append(arg)
            continue
        leaves, flat = leaf_dims(index, arg, dim)
        spec = _tree.flatten(arg)[1]
        out.append(
            _tree.unflatten(
                spec,
                [
                    x if d is None else x.narrow(d, start, stop - start)
                    for x, d in zip(leaves, flat, strict=True)
                ],
            )
        )
    return tuple(out)
