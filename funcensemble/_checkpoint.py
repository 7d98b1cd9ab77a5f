"""``save`` and ``load``: ensembles and pytrees of tensors as safetensors checkpoints.

A checkpoint is a plain safetensors file (no code runs on load; any safetensors tool
can list it) holding:

- one tensor per tensor leaf, keyed by its pytree path, e.g. ``['opt'].mu['net.0.weight']``.
  An [`Ensemble`][funcensemble.Ensemble] is stored as the pytree
  ``{"params": ..., "buffers": ...}`` of its stacked ``[N, ...]`` tensors;
- one metadata entry, ``"funcensemble"``: a JSON header with the format name and
  version, the kind (``"ensemble"`` or ``"pytree"``), for ensembles the member count,
  member class and architecture fingerprint (``Architecture.fingerprint`` of one
  member: class, names, per-member shapes and dtypes; not values, not the member
  count), a fingerprint of the structure (paths, shapes, dtypes, leaf types), the
  non-tensor leaves (Python ``bool``, ``int``, ``float``, ``str``) by path, and the
  treedef as text.

``load`` checks the parts rather than the hashes, to name what differs. The treedef
text is for people only (its wording depends on the optree version), and a member class
is compared by name, not module (see ``_check_ensemble``).
"""

import ast
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import optree
import safetensors
import safetensors.torch
import torch
from torch import Tensor, nn

from ._architecture import Architecture
from ._atomic import atomic_write
from ._ensemble import Ensemble

FORMAT = "funcensemble.checkpoint"
VERSION = 1
_HEADER_KEY = "funcensemble"
_VALUE_TYPES = (bool, int, float, str)
# What every supported safetensors version (>= 0.4) can store.
_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)

T = TypeVar("T")
Spec = tuple[Any, ...]


@dataclass(frozen=True)
class _Contents:
    """What is saved from, or loaded into, one object: its leaves by path."""

    kind: str
    leaves: dict[str, Any]
    treedef: optree.PyTreeSpec
    this: str  # how messages name the object: "this ensemble" or "the template"

    def label(self, path: str) -> str:
        if self.kind == "ensemble":
            for group, word in (("params", "parameter"), ("buffers", "buffer")):
                prefix = f"[{group!r}]["
                if path.startswith(prefix):
                    return f"{word} `{ast.literal_eval(path[len(prefix) : -1])}`"
        return f"leaf `{path}`"


def _path_string(accessor: optree.PyTreeAccessor) -> str:
    # Written out by hand rather than with accessor.codify() so that keys in files do
    # not change with optree's formatting.
    parts = []
    for entry in accessor:
        if isinstance(entry, optree.NamedTupleEntry | optree.StructSequenceEntry):
            parts.append(f".{entry.field}")
        elif isinstance(entry, optree.GetAttrEntry):
            parts.append(f".{entry.name}")
        else:
            parts.append(f"[{entry.entry!r}]")
    return "".join(parts)


def _contents(where: str, obj: Any) -> _Contents:
    if isinstance(obj, Ensemble):
        kind, this = "ensemble", "this ensemble"
        tree: Any = {"params": obj.stacked_params(), "buffers": obj.stacked_buffers()}
    elif isinstance(obj, nn.Module):
        raise TypeError(
            f"{where}: got a {type(obj).__name__}; expected an fe.Ensemble or a pytree of "
            "tensors. For an ordinary module, pass module.state_dict()."
        )
    else:
        kind, this, tree = "pytree", "the template", obj
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree)
    paths = [_path_string(a) for a in accessors]
    if len(set(paths)) != len(paths):
        raise ValueError(
            f"{where}: two leaves of the pytree have the same path string; use dict keys "
            f"whose repr() differ. Paths: {paths}."
        )
    for path, leaf in zip(paths, leaves, strict=True):
        # Exact types: subclasses (numpy.float64, IntEnum) would not come back as such.
        if not isinstance(leaf, Tensor) and type(leaf) not in _VALUE_TYPES:
            raise TypeError(
                f"{where}: leaf `{path}` is {_a(type(leaf).__name__)}; expected a Tensor or a "
                "Python bool, int, float or str (None is kept as structure)."
            )
    return _Contents(kind, dict(zip(paths, leaves, strict=True)), treedef, this)


def _spec(leaf: Any) -> Spec:
    if isinstance(leaf, Tensor):
        return ("tensor", tuple(leaf.shape), str(leaf.dtype).removeprefix("torch."))
    return (type(leaf).__name__,)


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeio' else 'a'} {noun}"


def _describe(spec: Spec) -> str:
    if spec[0] == "tensor":
        return f"{_a(spec[2])} tensor of shape {spec[1]}"
    return f"a Python {spec[0]}"


def _structure_fingerprint(specs: dict[str, Spec]) -> str:
    desc = json.dumps(sorted(specs.items()))  # paths are unique: specs are never compared
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def _member_architecture(ens: Ensemble) -> Architecture:
    """The architecture of one member: the stacked module's, without the member axis."""
    arch = Architecture.of(ens.stacked)

    def strip(specs: dict) -> dict:
        return {k: replace(s, shape=s.shape[1:]) for k, s in specs.items()}

    return replace(arch, params=strip(arch.params), buffers=strip(arch.buffers))


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _savable(where: str, label: str, t: Tensor, storages: set[int]) -> Tensor:
    if t.layout != torch.strided:
        raise TypeError(
            f"{where}: {label} is a {t.layout} tensor; only dense tensors can be saved. "
            "Call .to_dense() first."
        )
    if t.dtype not in _DTYPES:
        raise TypeError(
            f"{where}: {label} has dtype {t.dtype}, which safetensors cannot store. Convert "
            "it first (e.g. torch.view_as_real for a complex tensor)."
        )
    if t.device.type == "meta":
        raise ValueError(f"{where}: {label} is on the meta device and holds no values.")
    out = t.detach().to("cpu").contiguous()
    # safetensors refuses tensors that share memory (tied or viewed leaves): copy those.
    ptr = out.untyped_storage().data_ptr()
    if out.numel() and ptr in storages:
        out = out.clone()
    storages.add(out.untyped_storage().data_ptr())
    return out


def save(path: str | os.PathLike, obj: Any) -> None:
    """Write an ensemble, or a pytree of tensors, to a checkpoint file, atomically.

    The file is a safetensors file (no code runs when it is loaded; see
    [`load`][funcensemble.load] for the checks). It is written to a temporary file in
    the same directory, flushed to disk and renamed over ``path``: a crash or an
    exception mid-save leaves any previous checkpoint at ``path`` intact and no
    temporary file behind. Tensors are stored exactly (any device; read back on the
    CPU); tensors shared between leaves are stored once per leaf.

    Args:
        path: The file to create or replace.
        obj: An [`Ensemble`][funcensemble.Ensemble], or any optree pytree (dicts,
            lists, tuples, NamedTuples, ``None``) whose leaves are tensors or Python
            ``bool``, ``int``, ``float`` or ``str``, e.g.
            ``{"params": params, "buffers": buffers, "opt_state": state}``.

    Raises:
        TypeError: ``obj`` is another ``nn.Module`` (pass its ``state_dict()``), or
            has a leaf of another type, a sparse tensor or a dtype safetensors cannot
            store (complex).
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
    storages: set[int] = set()
    for key, leaf in contents.leaves.items():
        if isinstance(leaf, Tensor):
            tensors[key] = _savable(where, contents.label(key), leaf, storages)
        else:
            values[key] = leaf
    header: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "kind": contents.kind,
        "num_members": None,
        "architecture": None,
        "structure": _structure_fingerprint({k: _spec(v) for k, v in contents.leaves.items()}),
        "values": values,
        "treedef": str(contents.treedef),
    }
    if isinstance(obj, Ensemble):
        arch = _member_architecture(obj)
        header["num_members"] = obj.num_members
        header["architecture"] = {"class": _class_name(arch.cls), "fingerprint": arch.fingerprint()}
    metadata = {_HEADER_KEY: json.dumps(header)}

    def write(tmp: str) -> None:
        safetensors.torch.save_file(tensors, tmp, metadata=metadata)

    atomic_write(where, path, write)


class _Corrupt(ValueError):
    pass


def _parse_header(raw: str) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _Corrupt(f"its funcensemble header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _Corrupt(f"its funcensemble header does not name the format {FORMAT!r}")
    version = header.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _Corrupt(f"its format version is {version!r}, expected a positive int")
    if version > VERSION:
        raise _Corrupt(
            f"it was written by a newer funcensemble (checkpoint format version {version}; "
            f"this one reads up to {VERSION}). Upgrade funcensemble"
        )
    fields: dict[str, tuple[type, ...]] = {
        "kind": (str,),
        "num_members": (int, type(None)),
        "architecture": (dict, type(None)),
        "structure": (str,),
        "values": (dict,),
        "treedef": (str,),
    }
    for field, types in fields.items():
        if not isinstance(header.get(field), types) or isinstance(header.get(field), bool):
            raise _Corrupt(f"its header field {field!r} is {header.get(field)!r}")
    if header["kind"] not in ("ensemble", "pytree"):
        raise _Corrupt(f"its kind is {header['kind']!r}, expected 'ensemble' or 'pytree'")
    if header["kind"] == "ensemble":
        arch = header["architecture"]
        if (
            not isinstance(header["num_members"], int)
            or header["num_members"] < 1
            or not isinstance(arch, dict)
            or not all(isinstance(arch.get(k), str) for k in ("class", "fingerprint"))
        ):
            raise _Corrupt("its ensemble header lacks the member count or architecture")
    for key, value in header["values"].items():
        if not isinstance(value, _VALUE_TYPES):
            raise _Corrupt(f"its value for `{key}` is {value!r}, not a bool, int, float or str")
    return header


def _read(
    where: str, path: str | os.PathLike, check: Callable[[dict[str, Any]], None]
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The header and tensors of a checkpoint; ``check(header)`` runs before tensors load."""
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"{where}: no checkpoint file at '{name}'.")
    try:
        with safetensors.safe_open(name, framework="pt", device="cpu") as f:
            raw = (f.metadata() or {}).get(_HEADER_KEY)
            if raw is None:
                raise _Corrupt(
                    "it has no funcensemble header (a safetensors file written by another "
                    "tool? read those with safetensors.torch.load_file)"
                )
            header = _parse_header(raw)
            check(header)
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    except safetensors.SafetensorError as e:
        raise ValueError(
            f"{where}: '{name}' is not a readable safetensors file ({e}). It may be empty, "
            "truncated or corrupted, e.g. by an interrupted copy."
        ) from None
    except _Corrupt as e:
        raise ValueError(
            f"{where}: '{name}' is not a valid funcensemble checkpoint: {e}."
        ) from None
    overlap = tensors.keys() & header["values"].keys()
    specs = {k: _spec(t) for k, t in tensors.items()} | {
        k: _spec(v) for k, v in header["values"].items()
    }
    if overlap or _structure_fingerprint(specs) != header["structure"]:
        raise ValueError(
            f"{where}: '{name}' is not a valid funcensemble checkpoint: its header does not "
            "describe the tensors it holds (the file was modified or corrupted)."
        )
    return header, tensors


def _check_kind(where: str, name: str, contents: _Contents, obj: Any, header: dict) -> None:
    if header["kind"] == contents.kind:
        return
    if header["kind"] == "ensemble":
        raise ValueError(
            f"{where}: '{name}' holds an fe.Ensemble of {header['num_members']} members of "
            f"{header['architecture']['class']}; got a {type(obj).__name__} to load it into. "
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


def _check_leaves(
    where: str, name: str, contents: _Contents, tensors: dict[str, Tensor], values: dict
) -> None:
    expected = {k: _spec(v) for k, v in contents.leaves.items()}
    got = {k: _spec(t) for k, t in tensors.items()} | {k: _spec(v) for k, v in values.items()}
    hint = (
        "It was saved from a different architecture."
        if contents.kind == "ensemble"
        else "Build the template with the structure that was saved (e.g. the same model "
        "and optimizer)."
    )
    missing, extra = expected.keys() - got.keys(), got.keys() - expected.keys()
    if missing or extra:
        parts = []
        if missing:
            parts.append("lacks " + ", ".join(contents.label(k) for k in sorted(missing)))
        if extra:
            parts.append("has extra " + ", ".join(contents.label(k) for k in sorted(extra)))
        raise ValueError(
            f"{where}: '{name}' does not match {contents.this}: the file "
            f"{' and '.join(parts)}. {hint}"
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
    garbage files), its header (format, version, kind), for an ensemble the member
    count and member class (by name: a class saved as ``__main__.Net`` loads into
    ``train.Net``), and every leaf's path, type, shape and dtype. Any mismatch
    raises a ``ValueError`` that names the file, what was expected and what was found,
    and leaves ``obj`` untouched. Dtypes must match exactly: convert ``obj`` to the
    saved dtype first.

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
            are the saved values.

    Returns:
        ``obj`` itself for an ensemble; a new pytree for a template.

    Raises:
        ValueError: An unreadable or invalid file, or one that does not match ``obj``.
        FileNotFoundError: No file at ``path``.
        TypeError: ``obj`` is another ``nn.Module`` or has a leaf of an unsupported type.

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
    contents = _contents(where, obj)

    def check(header: dict[str, Any]) -> None:
        _check_kind(where, name, contents, obj, header)
        if isinstance(obj, Ensemble):
            _check_ensemble(where, name, obj, header)

    header, tensors = _read(where, path, check)
    _check_leaves(where, name, contents, tensors, header["values"])
    if isinstance(obj, Ensemble):
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
    return optree.tree_unflatten(contents.treedef, leaves)
