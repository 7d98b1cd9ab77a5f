"""``save`` and ``load``: ensembles and pytrees of tensors as safetensors checkpoints.

A checkpoint is a plain safetensors file (no code runs on load; any safetensors tool
can list it; the header is described in ``_checkpoint_file``) holding one tensor per
tensor leaf, keyed by its pytree path, e.g. ``['opt'].mu['net.0.weight']``. An
[`Ensemble`][funcensemble.Ensemble] is stored as the pytree
``{"params": ..., "buffers": ...}`` of its stacked ``[N, ...]`` tensors.

``load`` verifies the checksums first (``_checkpoint_file``), then compares the parts
(member count, class, each leaf) rather than the header's fingerprints, to name what
differs; a member class is compared by name, not module (see ``_check_ensemble``).
"""

import os
import re
import warnings
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import optree
import torch
from torch import Tensor

from .._core.ensemble import Ensemble
from .._hetero.ensemble import HeteroEnsemble
from .._messages import a, ensemble_leaf, key_difference, pytree_leaf, tensor_spec
from .._structure.architecture import Architecture
from ..optim._ensemble_optimizer import EnsembleOptimizer
from . import torch_optim as _torch_optim
from .counts import count_paths, layout_as_saved
from .extra_state import refuse_extra_state
from .file import (
    VALUE_TYPES,
    Spec,
    leaf_spec,
    leaf_specs,
    read_checkpoint,
    savable,
    write_checkpoint,
)
from .paths import flatten_by_key

T = TypeVar("T")


@dataclass(frozen=True)
class _Contents:
    """What is saved from, or loaded into, one object: its leaves by path."""

    kind: str
    leaves: dict[str, Any]
    treedef: optree.PyTreeSpec
    this: str  # how messages name the object: "this ensemble" or "the template"

    def label(self, path: str) -> str:
        return (
            ensemble_leaf(path)
            if self.kind in ("ensemble", "hetero_ensemble")
            else pytree_leaf(path)
        )


def _contents(where: str, obj: Any) -> _Contents:
    if isinstance(obj, torch.optim.Optimizer):
        contents = _contents(where, obj.state_dict())
        return replace(contents, this="this optimizer")
    if isinstance(obj, EnsembleOptimizer):
        # Stored as its state_dict(): the same file as fe.save(path, opt.state_dict()).
        contents = _contents(where, obj.state_dict())
        return replace(contents, this="this optimizer")
    leaves, treedef = flatten_by_key(
        where,
        obj,
        VALUE_TYPES,
        "a Tensor or a Python bool, int, float or str (None is kept as structure)",
    )
    if isinstance(obj, Ensemble):
        refuse_extra_state(where, obj.stacked, "stacked.")
        return _Contents("ensemble", leaves, treedef, "this ensemble")
    if isinstance(obj, HeteroEnsemble):
        refuse_extra_state(where, obj.groups, "groups.")
        return _Contents("hetero_ensemble", leaves, treedef, "this ensemble")
    return _Contents("pytree", leaves, treedef, "the template")


def _counts_as_saved(contents: _Contents, obj: Any, tensors: dict[str, Tensor]) -> _Contents:
    """``contents`` with each step count in the layout the file has (see ``counts``)."""
    counts = count_paths("load", obj)
    leaves = dict(contents.leaves)
    for path, n in counts.items():
        saved = tensors.get(path)
        if isinstance(saved, Tensor) and n is not None:
            zeros = layout_as_saved(leaves.get(path), n, tuple(saved.shape), saved.dtype, n)
            if zeros is not None:
                leaves[path] = zeros
    return replace(contents, leaves=leaves)


def _describe(spec: Spec) -> str:
    if spec[0] == "tensor":
        return tensor_spec(spec[2], spec[1])
    return f"a Python {spec[0]}"


def _member_architecture(ens: Ensemble) -> Architecture:
    """The architecture of one member: the stacked module's, without the member axis."""
    arch = Architecture.of(ens.stacked)

    def strip(specs: dict) -> dict:
        return {k: replace(s, shape=s.shape[1:]) for k, s in specs.items()}

    return replace(arch, params=strip(arch.params), buffers=strip(arch.buffers))


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def save(path: str | os.PathLike, obj: Any) -> None:
    """Write an ensemble, or a pytree of tensors, to a checkpoint file, atomically.

    The file is a safetensors file (no code runs when it is loaded; see
    [`load`][funcensemble.load] for the checks). It is written to a temporary file in
    the same directory, ``.<name>.funcensemble-tmp-<host>-<pid>-<random>``, flushed to
    disk and renamed over ``path``: a crash or an exception mid-save leaves any
    previous checkpoint at ``path`` intact. An exception or ``KeyboardInterrupt``
    removes the temporary file; a process killed outright (SIGKILL, power loss)
    leaves it, and the next save to ``path`` on the same host removes it once its
    process has exited. Each tensor is stored under its pytree path (an ensemble's
    as ``['params']['<name>']`` and ``['buffers']['<name>']``), so any safetensors
    tool reads it; tensors shared between leaves are stored once per leaf. Python
    leaves, the structure, the SHA-256 of every tensor's bytes and, for an ensemble,
    the member count and an architecture fingerprint go into a JSON header in the
    file's metadata, beside a SHA-256 of the header itself.

    Args:
        path: The file to create or replace.
        obj: An [`Ensemble`][funcensemble.Ensemble], a
            [`HeteroEnsemble`][funcensemble.HeteroEnsemble] (stored as
            ``{"params": ..., "buffers": ...}`` of ``stacked_params()`` and
            ``stacked_buffers()``, with each group's class, fingerprint and members in
            the header), or any optree pytree (dicts,
            lists, tuples, NamedTuples, ``None``) whose leaves are tensors or Python
            ``bool``, ``int``, ``float`` or ``str``, e.g.
            ``{"params": params, "buffers": buffers, "opt_state": state}``; or an
            [`EnsembleOptimizer`][funcensemble.optim.EnsembleOptimizer] or a
            ``torch.optim`` optimizer, stored as its ``state_dict()``.

    Raises:
        TypeError: ``obj`` is another ``nn.Module`` (pass its ``state_dict()``), an
            ensemble whose modules keep extra state (``get_extra_state``, which the
            file does not hold), or has a leaf of another type, a sparse tensor or a
            dtype funcensemble's files do not store (complex, uint16/32/64, float8).
        FileNotFoundError: The directory of ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory.

    Example:
        >>> import os, tempfile, torch, funcensemble as fe
        >>> ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(4)])
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     fe.save(os.path.join(tmp, "ens.safetensors"), ens)
        ...     sorted(os.listdir(tmp))
        ['ens.safetensors']
    """
    where = "save"
    contents = _contents(where, obj)
    tensors: dict[str, Tensor] = {}
    values: dict[str, Any] = {}
    for key, leaf in contents.leaves.items():
        if isinstance(leaf, Tensor):
            tensors[key] = savable(where, contents.label(key), leaf)
        else:
            values[key] = leaf
    header: dict[str, Any] = {
        "kind": contents.kind,
        "num_members": None,
        "architecture": None,
        "values": values,
        "treedef": str(contents.treedef),
    }
    if isinstance(obj, Ensemble):
        arch = _member_architecture(obj)
        header["num_members"] = obj.num_members
        header["architecture"] = {"class": _class_name(arch.cls), "fingerprint": arch.fingerprint()}
    if isinstance(obj, HeteroEnsemble):
        header["num_members"] = obj.num_members
        header["architecture"] = {"groups": _groups(obj)}
    write_checkpoint(where, path, tensors, header)


def _groups(hens: HeteroEnsemble) -> list[dict[str, Any]]:
    """Each group's member class, architecture fingerprint and members' indices."""
    out = []
    for ens, members in zip(hens.groups, hens.group_members, strict=True):
        arch = _member_architecture(ens)
        out.append(
            {
                "class": _class_name(arch.cls),
                "fingerprint": arch.fingerprint(),
                "members": list(members),
            }
        )
    return out


def _check_kind(where: str, name: str, contents: _Contents, obj: Any, header: dict) -> None:
    if header["kind"] == contents.kind:
        return
    if header["kind"] == "hetero_ensemble":
        raise ValueError(
            f"{where}: '{name}' holds an fe.HeteroEnsemble of {header['num_members']} "
            f"members; got {a(type(obj).__name__)} to load it into. Load it into an "
            "fe.HeteroEnsemble of the same members."
        )
    if contents.kind == "hetero_ensemble":
        raise ValueError(
            f"{where}: '{name}' holds "
            + ("an fe.Ensemble" if header["kind"] == "ensemble" else "a pytree checkpoint")
            + "; got an fe.HeteroEnsemble to load it into. Load it into an object of the "
            "kind that was saved."
        )
    if header["kind"] == "ensemble":
        raise ValueError(
            f"{where}: '{name}' holds an fe.Ensemble of {header['num_members']} members of "
            f"{header['architecture']['class']}; got {a(type(obj).__name__)} to load it into. "
            "Load it into an fe.Ensemble of that architecture."
        )
    raise ValueError(
        f"{where}: '{name}' holds a pytree checkpoint; got an fe.Ensemble to load it into. "
        "Load it with a template pytree of the saved structure."
    )


def _check_ensemble(where: str, name: str, ens: Ensemble, header: dict) -> None:
    n, arch = ens.num_members, _member_architecture(ens)
    if header["num_members"] != n:
        raise ValueError(
            f"{where}: '{name}' holds an ensemble of {header['num_members']} members; this "
            f"ensemble has {n}. Build the ensemble with num_members={header['num_members']}."
        )
    saved_class = header["architecture"]["class"]
    # The class's own name is compared, not its module: a model saved from a script
    # (`__main__.Net`) must load where the class is imported (`train.Net`). So the stored
    # fingerprint is not compared either; the tensors' names, shapes and dtypes, checked
    # next, are the rest of it.
    if saved_class.rpartition(".")[2] != arch.cls.__qualname__.rpartition(".")[2]:
        raise ValueError(
            f"{where}: '{name}' holds an ensemble of {saved_class}; this ensemble's members "
            f"are {_class_name(arch.cls)}. Load it into an ensemble of that architecture."
        )


def _check_hetero(where: str, name: str, hens: HeteroEnsemble, header: dict) -> None:
    """The member count, the grouping and each group's class match (then the leaves)."""
    n = hens.num_members
    if header["num_members"] != n:
        raise ValueError(
            f"{where}: '{name}' holds a heterogeneous ensemble of {header['num_members']} "
            f"members; this one has {n}. Build it from the same members."
        )
    saved = header["architecture"]["groups"]
    mine = _groups(hens)
    saved_members = [g["members"] for g in saved]
    my_members = [g["members"] for g in mine]
    if saved_members != my_members:
        raise ValueError(
            f"{where}: '{name}' holds groups of members {saved_members}; this ensemble "
            f"groups its members as {my_members}. Build it from members of the same "
            "architectures, in the same order."
        )
    for g, (s, m) in enumerate(zip(saved, mine, strict=True)):
        # By the class's own name, as for an Ensemble (see _check_ensemble).
        if s["class"].rpartition(".")[2] != m["class"].rpartition(".")[2]:
            raise ValueError(
                f"{where}: '{name}' holds group {g} (members {s['members']}) of "
                f"{s['class']}; this ensemble's group {g} is of {m['class']}. Build it from "
                "members of the same architectures, in the same order."
            )


def _check_leaves(
    where: str, name: str, contents: _Contents, tensors: dict[str, Tensor], values: dict
) -> None:
    expected = {k: leaf_spec(v) for k, v in contents.leaves.items()}
    got = leaf_specs(tensors, values)
    hint = (
        "It was saved from a different architecture."
        if contents.kind in ("ensemble", "hetero_ensemble")
        else "Build the template with the structure that was saved (e.g. the same model "
        "and optimizer; for an fe.optim.EnsembleOptimizer, load into the optimizer itself: "
        "fe.load(path, opt))."
    )
    difference = key_difference(
        expected.keys() - got.keys(), got.keys() - expected.keys(), label=contents.label
    )
    if difference:
        raise ValueError(
            f"{where}: '{name}' does not match {contents.this}: the file {difference}. {hint}"
        )
    for key, spec in expected.items():
        if got[key] != spec:
            if got[key][:2] == spec[:2] and spec[0] == "tensor":
                hint = (
                    f"Convert {contents.this} to {got[key][2]} before loading (e.g. "
                    f".to(torch.{got[key][2]})), and back afterwards if needed."
                )
            raise ValueError(
                f"{where}: '{name}' does not match {contents.this}: "
                f"{contents.label(key)} is {_describe(got[key])} in the file; "
                f"{contents.this} has {_describe(spec)}. {hint}"
            )


def load(path: str | os.PathLike, obj: T) -> T:
    """Read a checkpoint written by [`save`][funcensemble.save].

    Everything is checked before anything is copied: the file (empty, truncated or
    garbage files), the checksums of its header and of every tensor's bytes (a
    changed byte anywhere raises "checkpoint ... is corrupt", naming the header or
    the tensor), its header (format, version, kind), for an ensemble the member
    count and member class (by name: a class saved as ``__main__.Net`` loads into
    ``train.Net``), and every leaf's path, type, shape and dtype. Any mismatch
    raises a ``ValueError`` that names the file, what was expected and what was found,
    and leaves ``obj`` untouched. Dtypes must match exactly: convert ``obj`` to the
    saved dtype first. A file written before checksums were added (format version
    1) loads with a ``UserWarning`` saying that it could not be verified; save it
    again to add them.

    Args:
        path: A checkpoint file.
        obj: Either an [`Ensemble`][funcensemble.Ensemble] of the saved architecture
            and member count, which is loaded **in place** (its stacked parameters and
            buffers are overwritten, on their own devices) and returned; or a template
            pytree of the saved structure (e.g. freshly built ``params`` and
            ``opt.init(params)``), which is left untouched: a new pytree of the
            template's structure is returned, with the saved values. Its tensors are
            new tensors on the template leaf's device, with its dtype and
            ``requires_grad``; its Python ``bool``/``int``/``float``/``str`` leaves
            are the saved values. A
            [`HeteroEnsemble`][funcensemble.HeteroEnsemble] loads in place like an
            ``Ensemble``, once its member count, its grouping (which members form each
            group) and each group's member class match the file. An
            [`EnsembleOptimizer`][funcensemble.optim.EnsembleOptimizer] also loads in
            place (through its ``load_state_dict``) and is returned, and so does a
            ``torch.optim`` optimizer, fresh (no state yet) or not: each saved state
            tensor is checked against the shape of the parameter it belongs to, and the
            groups and hyperparameters against the optimizer's. Optimizer step
            counts load whether the file holds one shared by the members (0-dim) or
            one per member (``[N]``, after members joined by ``concat``), into an
            ``EnsembleOptimizer`` or into the ``fe.optim`` states of a template: the
            loaded state takes the file's layout.

    Returns:
        ``obj`` itself for an ensemble or an optimizer; a new pytree for a template.

    Raises:
        ValueError: An unreadable, corrupt or invalid file, or one that does not match
            ``obj``; or ``obj`` holds tensors on the meta device.
        FileNotFoundError: No file at ``path``.
        TypeError: ``obj`` is another ``nn.Module``, an ensemble whose modules keep
            extra state (``get_extra_state``, which the file does not hold), or has a
            leaf of an unsupported type.

    Example:
        >>> import os, tempfile, torch, funcensemble as fe
        >>> fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 2) for _ in range(4)])
        >>> state = {"params": params, "step": 10}
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     fe.save(os.path.join(tmp, "run.safetensors"), state)
        ...     template = {"params": {k: torch.zeros_like(v) for k, v in params.items()},
        ...                 "step": 0}
        ...     loaded = fe.load(os.path.join(tmp, "run.safetensors"), template)
        >>> loaded["step"], torch.equal(loaded["params"]["weight"], params["weight"])
        (10, True)
        >>> template["step"]  # the template is untouched
        0
    """
    where = "load"
    name = os.fspath(path)
    if isinstance(obj, torch.optim.Optimizer):
        # Its state as the file holds it (a fresh optimizer has none yet), then torch's
        # own load_state_dict, after every leaf is checked.
        header, tensors, _ = read_checkpoint(where, path, lambda header: None)
        if "['transform']" in header["values"]:
            raise ValueError(
                f"{where}: '{name}' holds an fe.optim.EnsembleOptimizer's state (expected a "
                f"torch.optim optimizer's, to load into this {type(obj).__name__}, got one "
                "recorded with its fe.optim transform). Load it into an EnsembleOptimizer "
                "built with that transform: fe.load(path, fe.optim.EnsembleOptimizer(ens, "
                "transform))."
            )
        own = _torch_optim.template(where, name, obj, tensors, header["values"])
        try:
            loaded = load(path, own)
        except ValueError as error:
            this = f"this {type(obj).__name__} optimizer"
            message = re.sub(  # an optimizer has no .to(): its parameters' dtype decides
                r"Convert the template to (\w+) before loading .*",
                r"Build the optimizer over parameters of the saved dtype (\1), load, and "
                r"convert the model afterwards if needed.",
                str(error),
            )
            raise ValueError(message.replace("the template", this)) from None
        if str(_contents(where, own).treedef) != header["treedef"]:
            # Same leaves, other structure: entries without tensors (None, an empty
            # list) that this optimizer's state lacks, or holds where the file has none.
            raise ValueError(
                f"{where}: '{name}' holds optimizer state whose entries without tensors "
                f"(None, or an empty list such as LBFGS's history before it has any) "
                f"differ from this {type(obj).__name__} optimizer's (expected the same "
                "entries as the file's, None and empty lists included). Load it into an "
                "optimizer that has stepped as the saved one had, or keep such an "
                "optimizer's state_dict with torch.save and torch.load."
            )
        obj.load_state_dict(loaded)
        return obj
    contents = _contents(where, obj)
    for key, leaf in contents.leaves.items():
        if isinstance(leaf, Tensor) and leaf.device.type == "meta":
            raise ValueError(
                f"{where}: {contents.label(key)} of {contents.this} is on the meta device, "
                "which holds no values, so nothing could be loaded into it. Build "
                f"{contents.this} on a real device (for fe.stack, its returned params and "
                "buffers, not the tensors of the module it returns)."
            )

    def check(header: dict[str, Any]) -> None:
        _check_kind(where, name, contents, obj, header)
        if isinstance(obj, Ensemble):
            _check_ensemble(where, name, obj, header)
        if isinstance(obj, HeteroEnsemble):
            _check_hetero(where, name, obj, header)

    header, tensors, verified = read_checkpoint(where, path, check)
    if isinstance(obj, EnsembleOptimizer) and any(
        key.startswith("['param_groups']") for key in [*header["values"], *tensors]
    ):
        raise ValueError(
            f"{where}: '{name}' holds a torch.optim optimizer's state (expected an "
            "EnsembleOptimizer's, saved by fe.save(path, ensemble_optimizer), got one with "
            "param_groups), which does not map onto stacked parameters. Stack the "
            "members' optimizer states yourself, or start the ensemble's optimizer fresh."
        )
    if isinstance(obj, EnsembleOptimizer) and "['transform']" not in header["values"]:
        # A file from before the transform was recorded: its state alone, not compared.
        contents = replace(
            _contents(where, {"state": obj.state_dict()["state"]}), this=contents.this
        )
    if isinstance(obj, EnsembleOptimizer):
        # Before the leaves: another transform's state has other leaves, and its
        # record says which (the list of leaves did not).
        obj._refuse_another_transform(where, header["values"].get("['transform']"))
    if contents.kind == "pytree":
        contents = _counts_as_saved(contents, obj, tensors)
    try:
        _check_leaves(where, name, contents, tensors, header["values"])
    except ValueError as error:
        if not isinstance(obj, EnsembleOptimizer):
            raise
        # An EnsembleOptimizer has no .to(): its ensemble's dtype decides.
        raise ValueError(
            re.sub(
                r"Convert this optimizer to (\w+) before loading .*",
                r"Load it into an EnsembleOptimizer built over a \1 ensemble (convert "
                r"the ensemble with .to(torch.\1) before building the optimizer).",
                str(error),
            )
        ) from None
    if not verified:
        warnings.warn(
            f"{where}: '{name}' was written before checkpoints had checksums (format "
            f"version {header['version']}), so a byte changed since it was saved could "
            "not be detected. Save it again with fe.save to add them.",
            UserWarning,
            stacklevel=2,
        )
    if isinstance(obj, Ensemble | HeteroEnsemble):
        with torch.no_grad():
            for key, target in contents.leaves.items():
                target.copy_(tensors[key])
        return obj
    leaves = []
    for key, leaf in contents.leaves.items():
        if isinstance(leaf, Tensor):
            value = tensors[key].to(leaf.device)
            leaves.append(value.requires_grad_() if leaf.requires_grad else value)
        else:
            leaves.append(header["values"][key])
    loaded = optree.tree_unflatten(contents.treedef, leaves)
    if isinstance(obj, EnsembleOptimizer):
        obj.load_state_dict(loaded)
        return obj  # type: ignore[return-value]
    return loaded
