"""Checking a state_dict against an ensemble's own, before anything is copied.

``nn.Module.load_state_dict`` copies entry by entry and reports the bad entries at the
end, so one bad entry leaves every good entry before it loaded. ``Ensemble`` runs these
checks first: every reason torch's loader would fail for (a key, a non-tensor value, a
shape, a tensor with no data) and the ones it would not (a member count, a kind of
dtype, one member's state_dict given to the stacked ensemble) is found before the first
value is copied.
"""

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .._messages import key_difference, names

STACK_HINT = (
    "To load N single-module state_dicts, pass them all to "
    "fe.import_state_dicts(ensemble, state_dicts), which stacks them member by member."
)
# A container of the members (an nn.ModuleList's state_dict): `<i>.<member key>`.
LIST_KEY = re.compile(r"(\d+)\.(.+)")


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating-point" if dtype.is_floating_point else "integer"


def _list_hint(own: Mapping[str, Any], state_dict: Mapping[Any, Any], n: int) -> str:
    """Advice for the state_dict of a container of the members (``0.weight`` for
    member 0's ``weight``, as an ``nn.ModuleList`` of them saves it); empty otherwise."""
    listed = sorted(
        k
        for k in state_dict
        if isinstance(k, str)
        and k not in own
        and (found := LIST_KEY.fullmatch(k)) is not None
        and f"stacked.{found[2]}" in own
    )
    if not listed:
        return ""
    return (
        f" Keys like `{listed[0]}` are `<i>.<key>`, member i's `<key>`: the state_dict of a "
        "container of the members (an nn.ModuleList of them), where this ensemble holds "
        f"`stacked.<key>` with a leading member axis of {n}. Load it with "
        "fe.import_state_dicts(ensemble, [m.state_dict() for m in modules]), `modules` being "
        "that container (load this state_dict into it first)."
    )


def check_loadable(
    where: str, own: Mapping[str, Any], state_dict: Any, n: int, *, strict: bool
) -> None:
    """Raise if loading ``state_dict`` into tensors ``own`` (N = ``n``) would fail or mislead.

    ``own`` is the ensemble's ``state_dict(keep_vars=True)``: names to stacked tensors
    (and modules' extra states, whatever ``get_extra_state`` returns).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{where}: state_dict must be a mapping from names to tensors (expected e.g. "
            f"Ensemble.state_dict(), got {type(state_dict).__name__}). Pass the mapping "
            "that state_dict() returned."
        )
    # One member module's keys ("0.weight" for this ensemble's "stacked.0.weight"):
    # with strict=False torch would skip them all and load nothing, without a word.
    one_member = sorted(
        k for k in state_dict if isinstance(k, str) and k not in own and f"stacked.{k}" in own
    )
    member_hint = (
        f" {names(one_member, limit=6)} are keys of one member module's state_dict; this "
        f"ensemble holds them as `stacked.<key>` with a leading member axis of {n}. " + STACK_HINT
    )
    if strict:
        difference = key_difference(own.keys() - state_dict.keys(), state_dict.keys() - own.keys())
        if difference:
            raise ValueError(
                f"{where}: the state_dict does not match this ensemble's architecture: it "
                f"{difference}." + (member_hint if one_member else _list_hint(own, state_dict, n))
            )
    elif one_member:
        raise ValueError(
            f"{where}: the state_dict is not this ensemble's (strict=False would skip "
            f"these keys and load nothing for them).{member_hint}"
        )
    for key, value in state_dict.items():
        if key not in own:
            continue
        mine = own[key]
        if not isinstance(mine, Tensor):
            continue  # a module's extra state (get_extra_state): torch's own to load
        expected = f"shape {tuple(mine.shape)}, {mine.dtype}"
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{where}: `{key}` is a {type(value).__name__} in the state_dict, not a "
                f"tensor (expected a tensor ({expected}), got {type(value).__name__}). Every "
                "value must be a tensor."
            )
        if value.layout != torch.strided:
            raise ValueError(
                f"{where}: `{key}` is a {value.layout} tensor in the state_dict (expected a "
                f"dense (strided) tensor, got {value.layout}). Convert it first "
                "(value.to_dense())."
            )
        if value.is_meta:
            raise ValueError(
                f"{where}: `{key}` is on the meta device in the state_dict, so it holds no "
                "values to load. Load the checkpoint onto a real device (e.g. "
                "torch.load(..., map_location='cpu'))."
            )
        if value.shape != mine.shape:
            if value.shape == mine.shape[1:]:
                raise ValueError(
                    f"{where}: `{key}` has shape {tuple(value.shape)} in the state_dict, one "
                    f"member's shape with no member axis; this ensemble has "
                    f"{tuple(mine.shape)} ({n} members) (expected {tuple(mine.shape)}, got "
                    f"{tuple(value.shape)}). " + STACK_HINT
                )
            if value.dim() > 0 and value.shape[0] != n:
                raise ValueError(
                    f"{where}: `{key}` has {value.shape[0]} members in the state_dict; this "
                    f"ensemble has {n} (expected {n} members, got {value.shape[0]}). Build an "
                    "Ensemble with the same num_members."
                )
            raise ValueError(
                f"{where}: `{key}` has shape {tuple(value.shape)} in the state_dict; "
                f"this ensemble has {tuple(mine.shape)} (expected {tuple(mine.shape)}, got "
                f"{tuple(value.shape)}). It comes from a different architecture."
            )
        if _kind(value.dtype) != _kind(mine.dtype):
            raise ValueError(
                f"{where}: `{key}` has dtype {value.dtype} in the state_dict; this "
                f"ensemble has {mine.dtype} (expected a dtype of kind {_kind(mine.dtype)}, "
                f"got {_kind(value.dtype)}). Convert the value first if it is meant for "
                f"this tensor (e.g. value.to({mine.dtype}))."
            )


def check_groups_loadable(where: str, groups: Any, state_dict: Any, strict: bool) -> None:
    """[`check_loadable`][] for each ``Ensemble`` in ``groups`` (a HeteroEnsemble's), on
    its keys under ``groups.<g>.``; with ``strict``, no key may lie outside the groups."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{where}: state_dict must be a mapping from names to tensors (expected e.g. "
            f"HeteroEnsemble.state_dict(), got {type(state_dict).__name__}). Pass the mapping "
            "that state_dict() returned."
        )
    prefixes = [f"groups.{g}." for g in range(len(groups))]
    if strict:
        stray = sorted(
            str(k)
            for k in state_dict
            if not (isinstance(k, str) and any(k.startswith(p) for p in prefixes))
        )
        if stray:
            raise ValueError(
                f"{where}: the state_dict does not match this ensemble: unexpected keys "
                f"{stray} (every key starts with `groups.<g>.`, g < {len(groups)})."
            )
    for g, (ens, prefix) in enumerate(zip(groups, prefixes, strict=True)):
        part = {
            k[len(prefix) :]: v
            for k, v in state_dict.items()
            if isinstance(k, str) and k.startswith(prefix)
        }
        check_loadable(
            f"{where} (group {g}, keys under `{prefix}`)",
            ens.state_dict(keep_vars=True),
            part,
            len(ens),
            strict=strict,
        )
