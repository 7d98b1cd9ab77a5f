"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), loadable at any world size.

A checkpoint is a plain DCP directory written by DCP's default planners: one
``.distcp`` file per rank and a ``.metadata`` file, plus ``.funcensemble-checksums``
(``_dcp_checksums``: the SHA-256 of everything written, verified before reading);
``.metadata`` is read without running code (``_dcp_metadata``). Every leaf is one DCP
entry keyed by its fully qualified name: an [`Ensemble`][funcensemble.Ensemble]'s
``state_dict()`` names (``stacked.0.weight``), a pytree's path with dots
(``opt.0.mu.0.weight``), as ``dcp.save`` names nested state itself:

- a tensor with dimensions is *member-sharded*: on several ranks it is handed to DCP as
  a DTensor on the shard's mesh (``_mesh.member_dtensor``: ``Shard(0)`` over
  ``"member"``, ``Replicate()`` over ``"data"``), which DCP writes once per member, as
  its rows of the global ``[N, ...]`` tensor;
- a 0-dim tensor or a Python ``bool``/``int``/``float`` (a step count) is *replicated*,
  written once; Python values are stored as 0-dim tensors.

DCP records each chunk's offset and size, so any mesh can read any rows.
"""

import contextlib
import hashlib
import inspect
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._checkpoint import torch_optim as _torch_optim
from .._checkpoint.counts import count_paths, layout_as_saved
from .._checkpoint.extra_state import refuse_extra_state
from .._checkpoint.paths import dotted_key, flatten_by_key
from .._core.ensemble import Ensemble
from .._hetero.ensemble import HeteroEnsemble
from .._messages import key_difference, pytree_leaf, tensor_spec
from .._torch_compat import DCP_NO_PROCESS_GROUP_WARNING, dcp_save_planner_to_lowest_rank
from ..optim._ensemble_optimizer import EnsembleOptimizer
from ..optim._recipes import _PARTS, Recipe, describe, recipe_of
from ._agreement import agree_to_write
from ._dcp_checksums import (
    CHECKSUM_FILE,
    ChecksummingWriter,
    Corrupt,
    VerifiedReader,
    identity,
    read_metadata,
    reads_of,
    verify_reads,
)
from ._errors import CHECKPOINT_HINT, failures
from ._member_shard import MemberShard, rank_and_world
from ._mesh import member_dtensor
from ._refusal import agree_to_start, ranks
from ._slices import narrow_members

T = TypeVar("T")
# An EnsembleOptimizer's transform record (its hyperparameters, as state_dict() holds
# it), stored as the SHA-256 of its text in four int64 values written once: DCP's
# shards hold tensors, and a string would be a pickle to read back.
_RECORD = "transform_sha256"
# Its per-member hyperparameters (``[n]`` tensors of its n members, such as
# adam(lr=LR[shard.members])), stored as member-sharded rows like its state: each rank
# holds other values, so the record written once describes each by its dtype alone
# (see ``_transform_apart``); the values are compared member by member on load.
_PER_MEMBER = "transform_per_member"
_VALUE_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}
_NO_DIST_WARNING = DCP_NO_PROCESS_GROUP_WARNING


@dataclass(frozen=True)
class _Flat:
    """One object's leaves by key, and how to name them in messages."""

    leaves: dict[str, Any]
    treedef: optree.PyTreeSpec | None  # None: an Ensemble, loaded in place
    labels: dict[str, str]

    @property
    def ensemble(self) -> bool:
        return self.treedef is None

    def label(self, key: str) -> str:
        return self.labels.get(key, pytree_leaf(key))

    def sharded(self) -> list[str]:
        """Keys of the member-sharded leaves: tensors with at least one dimension."""
        return [k for k, v in self.leaves.items() if isinstance(v, Tensor) and v.dim() > 0]


def _refuse_hetero(where: str, obj: Any) -> None:
    """A HeteroEnsemble's tensors are its groups', each ``[members of the group, ...]``:
    not rows of one ``[N, ...]`` tensor a MemberShard splits, and as a pytree template
    it would be left as it was, its loaded values returned instead."""
    over = getattr(obj, "_over", None) if isinstance(obj, EnsembleOptimizer) else obj
    if isinstance(over, HeteroEnsemble):
        what = "an EnsembleOptimizer of a HeteroEnsemble" if over is not obj else "a HeteroEnsemble"
        raise TypeError(
            f"{where}: got {what}, whose groups of members of several architectures are "
            "not rows of one [N, ...] tensor that ranks split by member (expected an "
            "fe.Ensemble, an EnsembleOptimizer of one, or a pytree of tensors). Save it "
            "in one process with fe.save and load it in place with fe.load, or give each "
            "group (hens.groups[g], an Ensemble) its own checkpoint."
        )


def _flatten(where: str, obj: Any) -> _Flat:
    _refuse_hetero(where, obj)
    if isinstance(obj, EnsembleOptimizer):
        # Its state_dict()'s state, as fe.save stores it, its transform's record, and
        # its per-member hyperparameters, by member.
        record, hypers = _transform_apart(obj)
        tree: dict[str, Any] = {"state": obj.state_dict()["state"], _RECORD: _digest(record)}
        if hypers:
            device = _device(obj)
            tree[_PER_MEMBER] = [value.detach().to(device) for _, value in hypers]
        flat = _flatten(where, tree)
        labels = {f"{_PER_MEMBER}.{i}": _hyper_label(label) for i, (label, _) in enumerate(hypers)}
        return replace(flat, labels={**flat.labels, **labels})
    if isinstance(obj, Ensemble):
        refuse_extra_state(where, obj.stacked, "stacked.")
        kinds = {id(t): "parameter" for t in obj.stacked_params().values()}
        leaves = dict(obj.state_dict(keep_vars=True))
        labels = {k: f"{kinds.get(id(v), 'buffer')} `{k}`" for k, v in leaves.items()}
        return _Flat(leaves, None, labels)
    leaves, treedef = flatten_by_key(
        where,
        obj,
        _VALUE_DTYPES,
        "a tensor or a Python bool, int or float value (None is kept as structure); "
        "save other things separately",
        key=dotted_key,
    )
    return _Flat(leaves, treedef, {})


def _torch_optim_saved(
    where: str, path: str | os.PathLike, opt: torch.optim.Optimizer
) -> dict[str, Any]:
    """The checkpoint's entries, checked to hold a torch.optim optimizer's state_dict."""
    saved = dict(_metadata(where, path)[0].state_dict_metadata)
    if not any(k.startswith("param_groups.") for k in saved):
        raise ValueError(
            f"{where}: '{os.fspath(path)}' holds no torch.optim optimizer's state_dict "
            f"(expected param_groups, as fe.distributed.save(path, opt) writes them, to "
            f"load into this {type(opt).__name__}; got an ensemble's or an "
            "EnsembleOptimizer's). Load it into what saved it."
        )
    return saved


def _saved_rows(saved: dict[str, Any]) -> int:
    """The member count of a torch.optim optimizer's saved state (1 without state)."""
    sizes = {
        md.size[0]
        for k, md in saved.items()
        if k.startswith("state.") and isinstance(md, TensorStorageMetadata) and len(md.size)
    }
    return max(sizes) if sizes else 1


def _torch_optim_template(
    where: str, name: str, saved: dict[str, Any], opt: torch.optim.Optimizer, shard: MemberShard
) -> dict[str, Any]:
    """``opt.state_dict()`` with each parameter's state as the checkpoint holds it (this
    rank's rows), checked as ``fe.load`` checks a torch.optim file: a fresh optimizer has
    no state until its first step, so its own state_dict cannot be the template."""
    rows = shard.size
    own = opt.state_dict()
    tensors: dict[str, Tensor] = {}
    values: dict[str, Any] = {}
    for key, md in saved.items():
        if not isinstance(md, TensorStorageMetadata):
            continue  # (refused by the load that follows, naming it)
        parts = key.split(".")
        at = "".join(f"[{int(p)}]" if p.isdigit() else f"[{p!r}]" for p in parts)
        size, dtype = tuple(md.size), md.properties.dtype
        mine = _own_value(own, parts)
        if parts[0] == "param_groups" and not isinstance(mine, Tensor) and dtype in _PYTHON:
            values[at] = _PYTHON[dtype]  # a Python number saved as a 0-dim tensor
        else:
            shape = (rows, *size[1:]) if parts[0] == "state" and size else size
            tensors[at] = torch.zeros(shape, dtype=dtype)
    return _torch_optim.template(where, name, opt, tensors, values)


# What a group's Python value was saved as (a 0-dim tensor of this dtype), and a stand-in
# of its type for the template; the loaded value replaces it.
_PYTHON: dict[torch.dtype, Any] = {torch.bool: False, torch.int64: 0, torch.float64: 0.0}


def _own_value(tree: Any, parts: list[str]) -> Any:
    """The value at a dotted path of an optimizer's own state_dict, or None."""
    for part in parts:
        if isinstance(tree, dict):
            tree = tree.get(int(part) if part.isdigit() and int(part) in tree else part)
        elif isinstance(tree, (list, tuple)) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return None
    return tree


def _digest(record: str) -> list[int]:
    """The SHA-256 of a transform record, as four int64 values."""
    digest = hashlib.sha256(record.encode()).digest()
    return [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _device(opt: EnsembleOptimizer) -> torch.device:
    """Where the optimizer's parameters (and state) are."""
    return next((p.device for p in opt.params.values()), torch.device("cpu"))


def _hyper_label(label: str) -> str:
    return f"per-member hyperparameter `{label}`"


def _transform_apart(opt: EnsembleOptimizer) -> tuple[str, list[tuple[str, Tensor]]]:
    """The optimizer's transform record without its per-member values, and those.

    The record is ``describe``'s text of the transform (what ``state_dict()`` records
    and ``fe.load`` compares), with each per-member hyperparameter (a 1-dim tensor of
    one value per member of this optimizer, as ``fe.optim.select`` counts them) shown
    by its dtype alone: the same on every rank and on every mesh, where the full text
    holds each rank's own values. The per-member tensors come with a label naming
    them (``adam(lr=...)``), in the record's order. Without any, the record is the
    full text, as saved before per-member values were kept apart.
    """
    n = opt._num_members() if opt.params else None
    found: list[tuple[str, Tensor]] = []
    record = _apart(opt.transform, n, found, "transform")
    return (record, found) if found else (opt._described, [])


def _apart(value: Any, n: int | None, found: list[tuple[str, Tensor]], label: str) -> str:
    """``describe(value)``, each per-member tensor of ``n`` values put in ``found``."""
    if hasattr(value, "update") and hasattr(value, "init"):
        recipe = recipe_of(value.update)
        if recipe is None or _PARTS.get(value.update) is not None:
            return describe(value)
        return _call_apart(recipe, n, found)
    if isinstance(value, Tensor):
        if value.dim() == 1 and n is not None and value.shape[0] == n:
            found.append((label, value))
            return f"tensor(<one per member>, {str(value.dtype).removeprefix('torch.')})"
        return describe(value)
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_apart(v, n, found, f"{label}[{k}]") for k, v in enumerate(value))
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):  # in key order, as describe
        items = sorted(value.items(), key=lambda kv: repr(kv[0]))
        shown = (f"{k!r}: {_apart(v, n, found, f'{label}[{k!r}]')}" for k, v in items)
        return "{" + ", ".join(shown) + "}"
    if callable(value):  # a schedule, whose values may be per member too
        recipe = recipe_of(value)
        return describe(value) if recipe is None else _call_apart(recipe, n, found)
    return describe(value)


def _call_apart(recipe: Recipe, n: int | None, found: list[tuple[str, Tensor]]) -> str:
    """``describe``'s text of a recorded call, each per-member tensor put in ``found``."""
    build, args, kwargs = recipe
    try:  # one description however the arguments were passed, as describe
        bound = inspect.signature(build).bind(*args, **kwargs)
        bound.apply_defaults()
        named: dict[Any, Any] = dict(bound.arguments)
    except (TypeError, ValueError):
        named = {**dict(enumerate(args)), **kwargs}
    name = getattr(build, "__name__", "transform")
    shown = ", ".join(f"{k}={_apart(v, n, found, f'{name}({k}=...)')}" for k, v in named.items())
    return f"{name}({shown})"


def _spread(shard: MemberShard) -> bool:
    """Whether the members lie on several ranks of a running process group, so that DCP
    needs this rank's rows as a DTensor on the shard's mesh."""
    return shard.mesh is not None and shard.world_size > 1 and not _alone()


def _alone() -> bool:
    """Whether this process runs without a process group (one process, or a test)."""
    return not (dist.is_available() and dist.is_initialized())


def _no_dist() -> dict[str, bool]:
    """``no_dist=`` for ``dcp.save``/``dcp.load``: run in this process alone without a
    process group. torch 2.6 and older take no such argument and decide the same way."""
    return {"no_dist": _alone()} if _TAKES_NO_DIST else {}


_TAKES_NO_DIST = "no_dist" in inspect.signature(dcp.save).parameters


@contextlib.contextmanager
def _dcp_call() -> Iterator[None]:
    """Silence DCP's note that it runs without a process group, which is intended here,
    and torch 2.6 and older's own deprecation note on ``Tensor.storage()``, which their
    DCP writer calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="TypedStorage is deprecated", category=UserWarning
        )
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        yield


def _failures(where: str, what: str, shard: MemberShard) -> contextlib.AbstractContextManager:
    rank, world, group = shard._all_ranks()
    return failures(where, what, rank, world, group=group, hint=CHECKPOINT_HINT)


def _check_shard(where: str, shard: object) -> MemberShard:
    if not isinstance(shard, MemberShard):
        raise TypeError(
            f"{where}: shard must be a fe.distributed.MemberShard (expected this rank's "
            f"MemberShard, got {type(shard).__name__}). Build one with "
            "fe.distributed.MemberShard."
        )
    return shard


def save(path: str | os.PathLike, obj: Any, shard: MemberShard | None = None) -> None:
    """Write this rank's members to a sharded checkpoint directory, with DCP.

    Every rank calls it with the same path and a pytree of the same structure. Each
    tensor with dimensions holds this rank's ``shard.size`` members first and is
    written as its rows of the global ``[N, ...]`` tensor; 0-dim tensors and Python
    ``bool``/``int``/``float`` values are replicated (written once: they must be equal
    on every rank, like a step count). Data replicas (a ``"data"`` axis on the shard's
    mesh) write each member once: replica 0's copy. The checkpoint can be loaded on
    any mesh, and into a single-process [`Ensemble`][funcensemble.Ensemble], by
    [`load`][funcensemble.distributed.load]; it is a standard DCP checkpoint written
    by DCP's default planner and keyed by fully qualified names (an ensemble's
    ``state_dict()`` names, a pytree's path joined by dots: ``opt.0.mu.0.weight``),
    plus a ``.funcensemble-checksums`` file written last by rank 0: the
    SHA-256 of ``.metadata`` and of every byte range each rank wrote (each rank hashes
    its own). DCP writes ``.metadata`` after the data, so an interrupted save is
    refused on load rather than read half-written (a save killed after ``.metadata``
    but before the checksum file loads with a warning that it cannot be verified);
    for the same reason a directory that already holds a checkpoint is refused rather
    than overwritten.

    Args:
        path: The checkpoint directory (created if needed; it must not hold a checkpoint
            yet).
        obj: This rank's [`Ensemble`][funcensemble.Ensemble] (e.g. from
            [`MemberShard.from_factory`][funcensemble.distributed.MemberShard.from_factory]),
            a pytree such as ``{"params": params, "buffers": buffers,
            "opt": opt_state, "step": 10}``, or this rank's
            [`EnsembleOptimizer`][funcensemble.optim.EnsembleOptimizer] (stored as its
            ``state_dict()``, as [`fe.save`][funcensemble.save] stores it, its
            transform's record as its SHA-256, which ``load`` compares; per-member
            hyperparameters, such as ``adam(lr=LR[shard.members])``, are written as
            rows by member like the state, each rank its members' values, and the
            record describes them by their dtype), or a ``torch.optim`` optimizer over
            this rank's ensemble (its ``state_dict()``).
        shard: This rank's [`MemberShard`][funcensemble.distributed.MemberShard].
            Optional in a single process, where ``obj`` holds all members.

    Raises:
        ValueError: A member-sharded tensor whose leading size is not this rank's
            member count, several ranks without ``shard``, or a shard for one rank of
            several without ``torch.distributed`` running.
        TypeError: ``obj`` is another ``nn.Module``, or has a leaf of another type.
        NotADirectoryError: ``path`` is a file.
        FileExistsError: ``path`` already holds a checkpoint.
        DistributedError: Writing failed, or another rank did not take part in time
            (the message names this rank, what it waited for and how long). Ranks that
            pass different structures or different values written once raise
            ``ValueError`` on every rank before anything is written.

    Example:
        >>> import os, tempfile, torch, funcensemble as fe
        >>> ens = fe.Ensemble.from_factory(lambda: torch.nn.Linear(3, 2), num_members=4)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     fe.distributed.save(os.path.join(tmp, "ckpt"), ens)
        ...     sorted(os.listdir(os.path.join(tmp, "ckpt")))
        ['.funcensemble-checksums', '.metadata', '__0_0.distcp']
    """
    where = "distributed.save"
    name = os.fspath(path)
    if isinstance(obj, torch.optim.Optimizer):
        obj = obj.state_dict()  # (what load puts back with its load_state_dict)
    if shard is not None:
        shard = _check_shard(where, shard)
    try:
        # The other ranks would wait for this one in the exchange below: the flag in
        # the first one makes every rank raise this rank's refusal.
        flat = _flatten(where, obj)
        keys = flat.sharded()
        if shard is None:
            _, world = rank_and_world(where)
            if world > 1:
                raise ValueError(
                    f"{where}: with {world} ranks, pass shard=fe.distributed.MemberShard(N) "
                    "so that each rank's rows are placed among all N members."
                )
            shard = MemberShard(flat.leaves[keys[0]].shape[0] if keys else 1)
        _check_save(where, path, flat, keys, shard)
        refused = None
    except (TypeError, ValueError, OSError) as error:
        refused = error
    if refused is None and shard is not None and shard.world_size > 1 and not _spread(shard):
        raise ValueError(
            f"{where}: the shard describes rank {shard.rank} of {shard.world_size}, but "
            "torch.distributed is not running, so the other ranks' members cannot be "
            "written with these. Save from every rank, after init_process_group."
        )
    agree_to_start(where, {}, refused, *ranks(shard))
    assert shard is not None
    spread = _spread(shard)
    sharded = set(keys)
    state = {}
    for key, leaf in flat.leaves.items():
        if not isinstance(leaf, Tensor):
            state[key] = torch.tensor(leaf, dtype=_VALUE_DTYPES[type(leaf)])
        elif key in sharded and spread:
            state[key] = member_dtensor(
                where, leaf, shard.members.start, shard.num_members, shard.mesh
            )
        else:
            state[key] = leaf.detach()
    agree_to_write(where, name, flat.leaves, shard, values=True)
    with _dcp_call(), _failures(where, f"writing its members to '{name}'", shard):
        dcp.save(
            state,
            checkpoint_id=path,
            storage_writer=ChecksummingWriter(path),
            # DCP's default planner; data replicas hold equal parameters, and their
            # buffers (BatchNorm statistics) are written from replica 0.
            planner=dcp_save_planner_to_lowest_rank(),
            process_group=shard._all_ranks()[2],
            **_no_dist(),
        )


def _corrupt(where: str, name: str, error: Corrupt) -> ValueError:
    return ValueError(
        f"{where}: checkpoint '{name}' is corrupt: {error}. It changed after it was saved "
        "(a disk, memory or transfer error, an interrupted copy, or an edit). Nothing was "
        "loaded; use another copy of the checkpoint."
    )


def _verify(where: str, name: str, checksums: Any, reads: list, shard: MemberShard) -> None:
    """Check this rank's reads; with several ranks, every rank learns what any rank found.

    Each rank checks only what it reads, so a damaged chunk may be found by one rank
    alone: the others must fail too rather than wait for it inside DCP's load.
    """
    try:
        verify_reads(name, checksums, reads)
        found = None
    except Corrupt as error:
        found = str(error)
    findings = [found]
    rank, world, group = shard._all_ranks()
    if world > 1 and not _alone():
        findings = [None] * world
        what = f"exchanging what it found checking '{name}'"
        with failures(where, what, rank, world, group=group):
            dist.all_gather_object(findings, found, group=group)
    for rank, finding in enumerate(findings):
        if finding is not None:
            by = f" (found by rank {rank} of {world})" if len(findings) > 1 else ""
            raise _corrupt(where, name, Corrupt(finding + by))


def _metadata(where: str, path: str | os.PathLike) -> tuple[Any, Any]:
    """The verified DCP metadata (read without unpickling code) and the checksums, if any."""
    name = os.fspath(path)
    seen = ""
    if not _alone() and dist.get_world_size() > 1:
        seen = (
            f" (as rank {dist.get_rank()} of {dist.get_world_size()} sees it: on several "
            "machines, a checkpoint must be on a filesystem all ranks share)"
        )
    if not os.path.isdir(name):
        raise FileNotFoundError(f"{where}: no checkpoint directory at '{name}'{seen}.")
    if not os.path.isfile(os.path.join(name, ".metadata")):
        raise ValueError(
            f"{where}: '{name}' has no .metadata file{seen}, so it is not a complete DCP "
            "checkpoint (DCP writes it last: the save may have been interrupted)."
        )
    try:
        return read_metadata(where, name)
    except Corrupt as error:
        raise _corrupt(where, name, error) from None


def _saved_members(where: str, name: str, flat: _Flat, saved: dict[str, Any]) -> int | None:
    sizes = {}
    for key in flat.sharded():
        md = saved.get(key)  # a missing key is reported by _check
        if isinstance(md, TensorStorageMetadata) and len(md.size) > 0:
            sizes[key] = md.size[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"{where}: '{name}' holds tensors with different member counts "
            f"({', '.join(f'{flat.label(k)}: {n}' for k, n in sizes.items())}); it was "
            "not written by fe.distributed.save from one ensemble."
        )
    return next(iter(sizes.values()), None)


def _counts_as_saved(
    where: str, obj: Any, flat: _Flat, saved: dict[str, Any], shard: MemberShard
) -> _Flat:
    """``flat`` with each optimizer step count in the checkpoint's layout: one shared by
    the members (0-dim) or one per member (``[N]``, after ``concat``), whichever the
    object to load into holds (the loaded state takes the checkpoint's, as in fe.load)."""
    if flat.ensemble:
        return flat
    counts = count_paths(where, obj, key=dotted_key)
    leaves = dict(flat.leaves)
    for path, n in counts.items():
        md = saved.get(path)
        if isinstance(md, TensorStorageMetadata):
            zeros = layout_as_saved(
                leaves.get(path), n, tuple(md.size), md.properties.dtype, shard.num_members
            )
            if zeros is not None and (zeros.dim() == 0 or n == shard.size):
                leaves[path] = zeros
    return replace(flat, leaves=leaves)


def _hypers_as_saved(where: str, obj: EnsembleOptimizer, saved: dict[str, Any]) -> _Flat:
    """``obj``'s leaves to read, its per-member hyperparameters as the checkpoint holds
    them (this optimizer's rows, in the saved dtypes), whatever its own: they are
    compared with its own once read, after the record, as fe.load compares the
    transform first (another transform has other per-member values)."""
    prefix = f"{_PER_MEMBER}."
    count = sum(1 for k in saved if k.startswith(prefix) and k[len(prefix) :].isdigit())
    tree: dict[str, Any] = {"state": obj.state_dict()["state"], _RECORD: _digest("")}
    if count == 0:  # saved without per-member values (none, or before they were kept)
        return _flatten(where, tree)
    rows = obj._num_members() if obj.params else 0
    values = []
    for i in range(count):
        md = saved.get(f"{prefix}{i}")
        if isinstance(md, TensorStorageMetadata) and len(md.size) > 0:
            shape, dtype = (rows, *md.size[1:]), md.properties.dtype
        else:  # (refused by _check, naming it)
            shape, dtype = (rows,), torch.float32
        values.append(torch.zeros(shape, dtype=dtype, device=_device(obj)))
    tree[_PER_MEMBER] = values
    flat = _flatten(where, tree)
    _, hypers = _transform_apart(obj)
    labels = {f"{prefix}{i}": _hyper_label(label) for i, (label, _) in enumerate(hypers)}
    return replace(flat, labels={**flat.labels, **labels})


def _transform_difference(obj: EnsembleOptimizer, loaded: Any, shard: MemberShard) -> str | None:
    """How the checkpoint's transform differs from ``obj``'s, or None, as ``fe.load``
    compares them: the record (without per-member values where the checkpoint keeps
    them apart, else the whole text as saved before), then this rank's members' values."""
    record, hypers = _transform_apart(obj)
    saved = loaded.get(_PER_MEMBER)
    if saved is None:
        record = obj._described  # every value in the record, as fe.load compares it
    if loaded.get(_RECORD) is not None and loaded[_RECORD] != _digest(record):
        return (
            f"whose transform or hyperparameters differ from this one's,\n  {record}\n"
            "(expected the same transform and hyperparameters; the checkpoint records "
            "them by their SHA-256)"
        )
    if saved is None:
        return None  # (its record held every value)
    for (label, mine), theirs in zip(hypers, saved, strict=True):
        rows = _differing_rows(mine, theirs)
        if rows:
            first, start = rows[0], shard.members.start
            members = ", ".join(str(start + j) for j in rows[:8])
            more = f" and {len(rows) - 8} more" if len(rows) > 8 else ""
            return (
                f"whose {_hyper_label(label)} differs from this one's at member"
                f"{'s' if len(rows) > 1 else ''} {members}{more} (expected the saved "
                f"{theirs[first].item()!r} for member {start + first}, got "
                f"{mine[first].item()!r})"
            )
    return None


def _differing_rows(mine: Tensor, theirs: Tensor) -> list[int]:
    """The rows where two [n] tensors of one dtype differ, bit by bit, as fe.load
    compares their text (-0.0 is not 0.0)."""
    mine = mine.detach().cpu().contiguous().view(torch.uint8).reshape(len(mine), -1)
    theirs = theirs.detach().cpu().contiguous().view(torch.uint8).reshape(len(theirs), -1)
    return (mine != theirs).any(dim=1).nonzero().flatten().tolist()


def _shared(where: str, name: str, found: str | None, shard: MemberShard) -> str | None:
    """What any rank found (the lowest rank's, naming it), on every rank; ``found``
    itself in one process."""
    rank, world, group = shard._all_ranks()
    if world == 1 or _alone():
        return found
    findings: list[str | None] = [None] * world
    what = f"exchanging what it found comparing the optimizer with '{name}'"
    with failures(where, what, rank, world, group=group):
        dist.all_gather_object(findings, found, group=group)
    for by, finding in enumerate(findings):
        if finding is not None:
            return f"{finding} (found by rank {by} of {world})"
    return None


def _check(where: str, name: str, flat: _Flat, saved: dict[str, Any], shard: MemberShard) -> None:
    difference = key_difference(
        flat.leaves.keys() - saved.keys(), saved.keys() - flat.leaves.keys(), label=flat.label
    )
    if difference:
        raise ValueError(
            f"{where}: '{name}' does not match the object to load into: the checkpoint "
            f"{difference}. Load it into the structure that was saved (same "
            "architecture, optimizer and keys)."
        )
    sharded = set(flat.sharded())
    for key, leaf in flat.leaves.items():
        md = saved[key]
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(
                f"{where}: '{name}' stores {flat.label(key)} as pickled bytes; "
                "fe.distributed.load reads tensors only."
            )
        got = (tuple(md.size), md.properties.dtype)
        if isinstance(leaf, Tensor):
            rows = (shard.num_members, *leaf.shape[1:]) if key in sharded else tuple(leaf.shape)
            want = (rows, leaf.dtype)
        else:
            want = ((), _VALUE_DTYPES[type(leaf)])
        if got != want:
            raise ValueError(
                f"{where}: '{name}' does not match the object to load into: "
                f"{flat.label(key)} is {tensor_spec(got[1], got[0])} in the checkpoint; "
                f"loading needs {tensor_spec(want[1], want[0])}"
                + (f" (all {shard.num_members} members)." if key in sharded else ".")
            )
        if key in sharded and leaf.shape[0] != shard.size and shard.world_size == 1:
            raise ValueError(
                f"{where}: '{name}' holds {shard.num_members} members; the object to load "
                f"into has {leaf.shape[0]} ({flat.label(key)}). Build it with "
                f"num_members={shard.num_members}."
            )
        if key in sharded and leaf.shape[0] != shard.size:
            raise ValueError(
                f"{where}: '{name}' holds {shard.num_members} members, of which rank "
                f"{shard.rank} of {shard.world_size} loads members "
                f"{shard.members.start}:{shard.members.stop} ({shard.size}), but this rank's "
                f"object has {leaf.shape[0]} ({flat.label(key)}: leading size "
                f"{leaf.shape[0]}). Build this rank's object for its members of "
                f"{shard.num_members}, e.g. with MemberShard({shard.num_members})"
                ".from_factory."
            )


def _check_save(
    where: str, path: str | os.PathLike, flat: _Flat, keys: list[str], shard: MemberShard
) -> None:
    """``save``'s checks of this rank's own arguments, made before any exchange."""
    for key in keys:
        size = flat.leaves[key].shape[0]
        if size != shard.size:
            raise ValueError(
                f"{where}: {flat.label(key)} has leading size {size}, but rank {shard.rank} "
                f"holds {shard.size} of the {shard.num_members} members. Every tensor with "
                "dimensions is saved as this rank's members (first axis); save other "
                "tensors separately, or as 0-dim tensors."
            )
    if os.path.isfile(path):
        raise NotADirectoryError(
            f"{where}: '{os.fspath(path)}' is a file; a sharded checkpoint is a directory."
        )
    if os.path.isfile(os.path.join(path, ".metadata")):
        raise FileExistsError(
            f"{where}: '{os.fspath(path)}' already holds a checkpoint. Write each "
            "checkpoint to a new directory (e.g. one per step) and delete old ones once "
            "the new one is complete: overwriting in place, a save that dies half-way "
            "would leave the old .metadata describing half-written files."
        )


def load(path: str | os.PathLike, obj: T, shard: MemberShard | None = None) -> T:
    """Read a checkpoint written by [`save`][funcensemble.distributed.save], at any world size.

    Each rank reads the rows of its own members, wherever they were saved: a
    checkpoint written by 2 ranks loads on 4, one written on a 2 × 2 mesh of members
    × data loads on 4 × 1 or 1 × 4 (every replica reads its members), or in one
    process into an ordinary [`Ensemble`][funcensemble.Ensemble] of all N members.
    Everything is checked before anything is read: the checksum file, ``.metadata``
    against it, and every byte range this rank reads against its SHA-256 (a changed
    byte raises "checkpoint ... is corrupt", naming the file and the entry, on every
    rank); then the keys, member count, shapes and dtypes. A mismatch raises and
    leaves ``obj`` untouched.
    ``.metadata`` (a pickle, in DCP) is read by an unpickler that resolves only DCP's
    metadata classes, so a crafted checkpoint cannot run code here; one naming
    anything else is refused. A checkpoint without a checksum file (written by DCP
    itself, or by funcensemble before checksums) loads with a ``UserWarning`` that it
    could not be verified.

    Args:
        path: The checkpoint directory.
        obj: This rank's [`Ensemble`][funcensemble.Ensemble], loaded **in place** and
            returned; or a template pytree of the saved structure (e.g. fresh
            ``params`` and ``opt.init(params)``), left untouched: a new pytree with the
            saved values is returned, each tensor on its template's device with its
            ``requires_grad``; or this rank's
            [`EnsembleOptimizer`][funcensemble.optim.EnsembleOptimizer], loaded in place
            (through its ``load_state_dict``) and returned; as
            [`fe.load`][funcensemble.load], one built with another transform or other
            hyperparameters is refused, per-member ones compared at this rank's
            members (the message names the hyperparameter and the member, on every
            rank). Optimizer step counts load
            whether the checkpoint holds one shared by the members (0-dim) or one per
            member (``[N]``, after members joined by ``concat``), as in
            [`fe.load`][funcensemble.load]: each rank reads its members' counts, and
            the loaded state takes the checkpoint's layout. Or a ``torch.optim``
            optimizer over this rank's ensemble, fresh or stepped, loaded in place
            through its ``load_state_dict`` (its state built from the checkpoint's
            entries and checked first, as [`fe.load`][funcensemble.load] does).
        shard: This rank's [`MemberShard`][funcensemble.distributed.MemberShard];
            by default one for the saved member count over the default group.

    Returns:
        ``obj`` itself for an ensemble or an optimizer; a new pytree for a template.

    Raises:
        FileNotFoundError: No directory at ``path``.
        ValueError: An incomplete, corrupt or unsafe checkpoint (metadata naming
            anything but DCP's classes, or data files outside the directory), one
            that does not match ``obj`` or ``shard``, or ranks that pass different
            structures.
        DistributedError: Reading failed, or another rank did not take part in time.

    Example:
        >>> import os, tempfile, torch, funcensemble as fe
        >>> make = lambda: torch.nn.Linear(3, 2)
        >>> trained = fe.Ensemble.from_factory(make, num_members=4, seed=0)
        >>> fresh = fe.Ensemble.from_factory(make, num_members=4, seed=1)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     fe.distributed.save(os.path.join(tmp, "ckpt"), trained)
        ...     _ = fe.distributed.load(os.path.join(tmp, "ckpt"), fresh)
        >>> torch.equal(fresh.stacked.weight, trained.stacked.weight)
        True
    """
    where = "distributed.load"
    name = os.fspath(path)
    if shard is not None:
        shard = _check_shard(where, shard)
    try:
        # The other ranks would wait for this one in the exchanges below: the flag in
        # the first one makes every rank raise this rank's refusal.
        if isinstance(obj, torch.optim.Optimizer):
            saved = _torch_optim_saved(where, path, obj)
        else:
            flat = _flatten(where, obj)
            metadata, checksums = _metadata(where, path)
        refused = None
    except (TypeError, ValueError, OSError) as error:
        refused = error
    agree_to_start(where, {}, refused, *ranks(shard))
    if isinstance(obj, torch.optim.Optimizer):
        if shard is None:  # (an exchange of N among the ranks, all of them here)
            shard = MemberShard(_saved_rows(saved))
        try:
            template = _torch_optim_template(where, name, saved, obj, shard)
            refused = None
        except (TypeError, ValueError) as error:
            refused = error
        agree_to_start(where, {}, refused, *ranks(shard))
        obj.load_state_dict(load(path, template, shard))
        return obj
    saved = dict(metadata.state_dict_metadata)
    recorded = [k for k in saved if k.startswith((f"{_RECORD}.", f"{_PER_MEMBER}."))]
    if isinstance(obj, EnsembleOptimizer) and not recorded:
        # Saved before the record was kept (or as a pytree of the state): not compared.
        flat = _flatten(where, {"state": obj.state_dict()["state"]})
    elif isinstance(obj, EnsembleOptimizer):
        flat = _hypers_as_saved(where, obj, saved)
    elif f"{_RECORD}.0" not in flat.leaves:
        for key in recorded:  # an optimizer's checkpoint into a template of its state
            del saved[key]
    num_members = _saved_members(where, name, flat, saved)
    if shard is None:
        shard = MemberShard(1 if num_members is None else num_members)
    flat = _counts_as_saved(where, obj, flat, saved, shard)
    try:
        if num_members is not None and shard.num_members != num_members:
            raise ValueError(
                f"{where}: '{name}' holds {num_members} members; the shard describes "
                f"{shard.num_members}. Pass MemberShard({num_members})."
            )
        _check(where, name, flat, saved, shard)
        refused = None
    except ValueError as error:
        # Raised after the ranks' agreement just below, which carries it: a rank whose
        # object alone does not match must not leave the others waiting.
        refused = error
    # Before the read plan is built: its member DTensors would be made from objects the
    # ranks may not agree on.
    found = identity(name)
    agree_to_write(
        where,
        name,
        flat.leaves,
        shard,
        values=False,
        checkpoint=found,
        refused=None if refused is None else str(refused),
    )
    if refused is not None:  # on every rank: their objects were refused alike
        raise refused

    sharded = set(flat.sharded())
    spread = _spread(shard)
    # Without a process group, a shard standing for one rank of several reads all N
    # members and keeps its own rows.
    cut = shard.world_size > 1 and not spread
    dest, plan = {}, {}
    for key, leaf in flat.leaves.items():
        if not isinstance(leaf, Tensor):
            dest[key] = plan[key] = torch.empty((), dtype=_VALUE_DTYPES[type(leaf)])
            continue
        rows = torch.empty_like(leaf, memory_format=torch.contiguous_format).detach()
        dest[key] = plan[key] = rows
        if key in sharded and spread:
            plan[key] = member_dtensor(
                where, rows, shard.members.start, shard.num_members, shard.mesh
            )
        elif key in sharded and cut:
            plan[key] = rows.new_empty((shard.num_members, *rows.shape[1:]))
    if checksums is None:
        warnings.warn(
            f"{where}: '{name}' has no {CHECKSUM_FILE} file (written by plain "
            "torch.distributed.checkpoint, by funcensemble before checkpoints had "
            "checksums, or by a save killed just before writing it), so a byte changed "
            "since it was saved could not be detected.",
            UserWarning,
            stacklevel=2,
        )
    else:
        rows = {key: shard.members if key in sharded and not cut else None for key in flat.leaves}
        _verify(where, name, checksums, reads_of(metadata, rows), shard)
    with _dcp_call(), _failures(where, f"reading its members from '{name}'", shard):
        dcp.load(
            plan,
            checkpoint_id=path,
            storage_reader=VerifiedReader(path, metadata),
            process_group=shard._all_ranks()[2],
            **_no_dist(),
        )
    if cut:
        for key in sharded:
            dest[key].copy_(narrow_members(plan[key], shard.members))

    if flat.ensemble:
        with torch.no_grad():
            for key, leaf in flat.leaves.items():
                leaf.copy_(dest[key])
        return obj
    out = []
    for key, leaf in flat.leaves.items():
        value = dest[key]
        if isinstance(leaf, Tensor):
            out.append(value.requires_grad_(True) if leaf.requires_grad else value)
        else:
            out.append(type(leaf)(value.item()))
    loaded = flat.treedef.unflatten(out)
    if isinstance(obj, EnsembleOptimizer):
        # Before anything changes, on every rank: a rank alone may find a member's
        # hyperparameter that differs.
        differs = _shared(where, name, _transform_difference(obj, loaded, shard), shard)
        if differs is not None:
            raise ValueError(
                f"{where}: '{name}' was saved by an optimizer {differs}: torch.optim's "
                "load_state_dict would put the saved hyperparameters back, while this "
                "state holds none and would continue with these. Build the optimizer "
                "with the saved transform and load; to change hyperparameters on purpose, "
                "assign the new one afterwards (opt.transform = ..., as torch.optim users "
                "set param_groups after loading)."
            )
        obj.load_state_dict({"state": loaded["state"]})
        return obj  # type: ignore[return-value]
    return loaded
