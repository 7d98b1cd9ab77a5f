"""A ``torch.optim`` optimizer's state_dict as a template to load a checkpoint into.

A fresh ``torch.optim`` optimizer has no state yet (``state_dict()["state"]`` is empty
until its first step), so its ``state_dict()`` cannot be the template ``fe.load``
checks a file against. Here each parameter's missing state takes the saved entries'
shapes and dtypes, once every saved state tensor with dimensions has the shape of the
parameter it belongs to, for the optimizers whose state is elementwise (torch's own
``load_state_dict`` checks only the groups' sizes: state from another model with as
many parameters would load, and fail, or broadcast, at the next step). The groups'
hyperparameters are the file's, as torch's ``load_state_dict`` takes them: only the
entries each group has are checked.
"""

import re
from typing import Any

import optree
import torch
from torch import Tensor

_STATE_ENTRY = re.compile(r"^\['state'\]\[(\d+)\]\['([^'\]]+)'\]$")
_GROUP_ENTRY = re.compile(r"^\['param_groups'\]\[(\d+)\]\['([^'\]]+)'\]$")
_GROUP_PREFIX = re.compile(r"^\['param_groups'\]\[(\d+)\]\['([^'\]]+)'\]")  # betas' too
_INDEXES = re.compile(r"(\[\d+\])+")  # a list's positions: [3][0]
_STATE_PREFIX = re.compile(r"^\['state'\]\[(\d+)\]\['([^'\]]+)'\]")  # nested ones too

# The entries torch's learning-rate schedulers add to an optimizer's groups (LRScheduler:
# initial_lr; OneCycleLR: max_lr, min_lr and, cycling momentum, max_momentum and
# base_momentum; SWALR: swa_lr). torch's load_state_dict takes the file's groups as they
# are: a file saved with a scheduler attached loads into an optimizer without one yet,
# and one saved without into an optimizer with one (whose groups then lack them, as
# torch leaves them). Any other entry that one side lacks is another optimizer's, and
# is refused.
_SCHEDULER_ENTRIES = frozenset(
    {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"}
)

# Optimizers whose every state tensor with dimensions is shaped like its parameter
# (others, such as Adafactor's row and column statistics or LBFGS's flat history, keep
# other shapes: their state is checked as torch's load_state_dict checks it).
_ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in (
        "Adadelta",
        "Adagrad",
        "Adam",
        "Adamax",
        "AdamW",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "SGD",
    )
    if hasattr(torch.optim, name)
)


def template(
    where: str, name: str, opt: torch.optim.Optimizer, tensors: dict[str, Tensor], values: dict
) -> dict[str, Any]:
    """``opt.state_dict()`` with each parameter's state as the file holds it, checked."""
    own = opt.state_dict()
    params: dict[int, Tensor] = {}
    for group, saved in zip(opt.param_groups, own["param_groups"], strict=True):
        params.update(zip(saved["params"], group["params"], strict=True))
    found: dict[int, dict[str, Any]] = {}
    # torch's load_state_dict puts the file's state in place of the optimizer's, whole:
    # a parameter the file has no state for has none after it (its own is dropped), and
    # each parameter's entries are the file's. The optimizer's own tensors stand in
    # where it has them, so that their dtypes are checked; the others are made below.
    entries_saved = {(int(m[1]), m[2]) for m in map(_STATE_PREFIX.match, (*tensors, *values)) if m}
    state: dict[int, dict[str, Any]] = {}
    for i, entry in sorted(entries_saved):
        if entry in own["state"].get(i, {}):
            state.setdefault(i, {})[entry] = own["state"][i][entry]
    kept = {(i, entry) for i, entries in state.items() for entry in entries}
    listed: dict[tuple[int, str], dict[tuple[int, ...], Any]] = {}
    groups = [dict(g) for g in own["param_groups"]]
    for key, value in (*tensors.items(), *values.items()):
        match = _STATE_ENTRY.match(key)
        entry = _GROUP_ENTRY.match(key)
        if entry and int(entry[1]) < len(groups) and entry[2] in _SCHEDULER_ENTRIES:
            groups[int(entry[1])].setdefault(entry[2], value)
        elif entry and int(entry[1]) < len(groups) and entry[2] in groups[int(entry[1])]:
            # torch's load_state_dict puts the file's hyperparameters in place of the
            # optimizer's (lr=1 for lr=0.1, momentum=0 for 0.9, foreach=None for False):
            # only which entries each group has is this optimizer's to match.
            groups[int(entry[1])][entry[2]] = value
        nested = _STATE_PREFIX.match(key)
        if match:
            found.setdefault(int(match[1]), {})[match[2]] = value
        elif nested and _INDEXES.fullmatch(key[nested.end() :]):
            # A list of the file's (LBFGS's history), rebuilt at the file's length.
            index = tuple(int(k) for k in re.findall(r"\d+", key[nested.end() :]))
            listed.setdefault((int(nested[1]), nested[2]), {})[index] = value
        elif nested and (int(nested[1]), nested[2]) not in kept:
            raise ValueError(
                f"{where}: '{name}' holds nested optimizer state (`{key}`: LBFGS keeps "
                "its history in lists), which cannot be rebuilt for an optimizer without "
                "that state yet (expected tensors and numbers per parameter). Load it into "
                "the optimizer after one step, or keep such an optimizer's state_dict with "
                "torch.save and torch.load."
            )
    for (i, entry), leaves in listed.items():
        mine = own["state"].get(i, {}).get(entry)
        state.setdefault(i, {})[entry] = _as_lists(leaves, mine)
    for i, entries in state.items():
        # Entries with nothing in them (None, an empty list: LBFGS's history before it
        # has any) leave no leaf in the file: the optimizer's own stand in, and the
        # comparison of structures (load) refuses a file that lacks them.
        for entry, v in own["state"].get(i, {}).items():
            if entry not in entries and not optree.tree_leaves(v, none_is_leaf=False):
                entries[entry] = v
    saved = {(int(m[1]), m[2]) for m in map(_GROUP_PREFIX.match, (*tensors, *values)) if m}
    for g, group in enumerate(groups):
        for entry in _SCHEDULER_ENTRIES & group.keys():
            if (g, entry) not in saved:
                del group[entry]
        for entry in group.keys() - _SCHEDULER_ENTRIES - {"params"}:
            if (g, entry) not in saved:
                # A None in the file (foreach=None) is structure, not a leaf; a group
                # without the entry at all fails the comparison of structures.
                group[entry] = None
    for i, entries in sorted(found.items()):
        p = params.get(i)
        if p is None:
            continue  # the comparison of structures names the extra parameter
        for entry, value in entries.items():
            if not isinstance(opt, _ELEMENTWISE):
                break
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise ValueError(
                    f"{where}: '{name}' holds `{entry}` of parameter {i} with shape "
                    f"{tuple(value.shape)}, but this optimizer's parameter {i} has shape "
                    f"{tuple(p.shape)} (expected the state of the same parameters, in the "
                    "same order). Load it into an optimizer built over the parameters it "
                    "was saved from."
                )
        for entry, v in entries.items():
            if entry in state.get(i, {}):
                continue
            # What the first step makes: a tensor shaped like its parameter (an
            # elementwise optimizer's) has the parameter's dtype, so that a file of
            # another dtype is refused, as by an optimizer that has stepped.
            state.setdefault(i, {})[entry] = (
                (
                    torch.zeros_like(v, dtype=p.dtype)
                    if isinstance(opt, _ELEMENTWISE) and v.dim() > 0 and v.is_floating_point()
                    else torch.zeros_like(v)
                )
                if isinstance(v, Tensor)
                else v
            )
    return {"state": state, "param_groups": groups}


def _as_lists(leaves: dict[tuple[int, ...], Any], like: Any = None) -> list[Any]:
    """Nested lists holding a fresh copy of each leaf at its index path; a position
    without one (LBFGS's ``al``, None until used) is None, or what ``like`` (the
    optimizer's own list) holds there when that holds no tensor."""
    heads: dict[int, dict[tuple[int, ...], Any]] = {}
    for index, value in leaves.items():
        heads.setdefault(index[0], {})[index[1:]] = value
    like = like if isinstance(like, list) else []
    out = []
    for k in range(max(max(heads) + 1, len(like))):
        mine = like[k] if k < len(like) else None
        rest = heads.get(k)
        if rest is None:
            out.append(mine if not optree.tree_leaves(mine, none_is_leaf=False) else None)
        elif () in rest:
            value = rest[()]
            out.append(torch.zeros_like(value) if isinstance(value, Tensor) else value)
        else:
            out.append(_as_lists(rest, mine))
    return out
