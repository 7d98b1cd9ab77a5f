"""The checkpoint file: tensors and a JSON header, written atomically, read back checked.

The header is one safetensors metadata entry, ``"funcensemble"``, holding the format
name and version, the kind (``"ensemble"``, ``"hetero_ensemble"`` or ``"pytree"``), for
ensembles the member count, member class and architecture fingerprint
(``Architecture.fingerprint`` of one member: class, names, per-member shapes and
dtypes; not values, not the member count; for a heterogeneous ensemble, those of each
group with its members' indices),
a fingerprint of the structure (paths, shapes, dtypes, leaf types), the non-tensor
leaves (Python ``bool``, ``int``, ``float``, ``str``) by path, the treedef as text
(for people only: its wording depends on the optree version) and, from version 2, the
SHA-256 of every tensor's bytes. The safetensors header as a whole is checksummed too
(``_safetensors_file``), so a changed byte anywhere in the file is found on load.
Version 1 files (no checksums) still load, with a warning.
"""

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import safetensors
import torch
from torch import Tensor

from .atomic import atomic_write
from .checksum import is_digest, tensor_digest
from .safetensors_file import DTYPE_NAMES, CorruptFile, verify_header, write_safetensors

FORMAT = "funcensemble.checkpoint"
VERSION = 2  # 2: checksums of the header and of every tensor's bytes
HEADER_KEY = "funcensemble"
VALUE_TYPES = (bool, int, float, str)
Spec = tuple[Any, ...]
# What the safetensors format stores (every supported safetensors version reads it).
DTYPES = frozenset(DTYPE_NAMES)


def leaf_spec(leaf: Any) -> Spec:
    if isinstance(leaf, Tensor):
        return ("tensor", tuple(leaf.shape), str(leaf.dtype).removeprefix("torch."))
    return (type(leaf).__name__,)


def leaf_specs(tensors: dict[str, Tensor], values: dict[str, Any]) -> dict[str, Spec]:
    """The specs of a file's leaves: its tensors and its Python values."""
    return {k: leaf_spec(v) for k, v in (tensors | values).items()}


def structure_fingerprint(specs: dict[str, Spec]) -> str:
    desc = json.dumps(sorted(specs.items()))  # paths are unique: specs are never compared
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def savable(where: str, label: str, t: Tensor) -> Tensor:
    if t.layout != torch.strided:
        raise TypeError(
            f"{where}: {label} is a {t.layout} tensor; only dense tensors can be saved. "
            "Call .to_dense() first."
        )
    if t.dtype not in DTYPES:
        raise TypeError(
            f"{where}: {label} has dtype {t.dtype}, which funcensemble's checkpoint files "
            "do not store (expected a float, int or bool dtype of torch's classic set: "
            "float64/32/16, bfloat16, int64/32/16/8, uint8, bool). Convert it first (e.g. "
            "torch.view_as_real for a complex tensor, .to(torch.int64) for a uint32 one)."
        )
    if t.device.type == "meta":
        raise ValueError(
            f"{where}: {label} is on the meta device and holds no values. (The tensors of "
            "the module fe.stack returns are meta placeholders: save the params and "
            "buffers fe.stack returns beside it, e.g. {'params': params, 'buffers': "
            "buffers}.)"
        )
    # Tensors that share memory (tied or viewed leaves) are written once per leaf.
    return t.detach().to("cpu").contiguous()


def write_checkpoint(
    where: str, path: str | os.PathLike, tensors: dict[str, Tensor], header: dict[str, Any]
) -> None:
    """Atomically write ``tensors`` (CPU, contiguous, unshared) with ``header`` completed."""
    specs = leaf_specs(tensors, header["values"])
    full = {"format": FORMAT, "version": VERSION, **header}
    full["structure"] = structure_fingerprint(specs)
    full["checksums"] = {key: tensor_digest(t) for key, t in tensors.items()}
    metadata = {HEADER_KEY: json.dumps(full)}
    atomic_write(where, path, lambda f: write_safetensors(f, tensors, metadata))


class _Corrupt(ValueError):
    pass


def _parse_header(raw: str) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _Corrupt(f"its funcensemble header is not valid JSON ({e})") from None
    except RecursionError:
        raise _Corrupt(
            "its funcensemble header nests lists or objects too deeply to be parsed "
            "(fe.save writes a flat header: the file was edited)"
        ) from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _Corrupt(f"its funcensemble header does not name the format {FORMAT!r}")
    version = header.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _Corrupt(f"its format version is {version!r} (expected a positive int)")
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
    if header["kind"] not in ("ensemble", "hetero_ensemble", "pytree"):
        raise _Corrupt(
            f"its kind is {header['kind']!r} (expected 'ensemble', 'hetero_ensemble' or 'pytree')"
        )
    if header["kind"] == "hetero_ensemble" and not _hetero_header_ok(header):
        raise _Corrupt("its heterogeneous ensemble header lacks the member count or groups")
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
        if not isinstance(value, VALUE_TYPES):
            raise _Corrupt(f"its value for `{key}` is {value!r}, not a bool, int, float or str")
    return header


def _hetero_header_ok(header: dict[str, Any]) -> bool:
    """A member count, and groups each with a class, a fingerprint and member indices."""
    arch, n = header["architecture"], header["num_members"]
    groups = arch.get("groups") if isinstance(arch, dict) else None
    if not isinstance(n, int) or n < 1 or not isinstance(groups, list) or not groups:
        return False
    return all(
        isinstance(g, dict)
        and all(isinstance(g.get(k), str) for k in ("class", "fingerprint"))
        and isinstance(g.get("members"), list)
        and all(type(i) is int for i in g["members"])
        for g in groups
    )


def _checksums(header: dict[str, Any], keys: set[str]) -> dict[str, str]:
    sums = header.get("checksums")
    if not isinstance(sums, dict) or sums.keys() != keys:
        raise CorruptFile(
            "its header does not hold one checksum per tensor (field 'checksums'), though "
            "the header itself checks out: it was edited and signed again"
        )
    for key, value in sums.items():
        if not is_digest(value):
            raise CorruptFile(f"its checksum of tensor `{key}` is {value!r}, not a SHA-256")
    return sums


def read_checkpoint(
    where: str, path: str | os.PathLike, check: Callable[[dict[str, Any]], None]
) -> tuple[dict[str, Any], dict[str, Tensor], bool]:
    """The header and tensors of a checkpoint, and whether checksums verified them.

    ``check(header)`` runs before tensors load. Checksums are verified before anything
    is returned; False means a version 1 file, which has none.
    """
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"{where}: no checkpoint file at '{name}'.")
    try:
        signed = verify_header(name)
        with safetensors.safe_open(name, framework="pt", device="cpu") as f:
            keys = set(f.keys())
            raw = (f.metadata() or {}).get(HEADER_KEY)
            if raw is None:
                raise _Corrupt(
                    "it has no funcensemble header (a safetensors file written by another "
                    "tool? read those with safetensors.torch.load_file)"
                )
            header = _parse_header(raw)
            if not signed and header["version"] >= 2:
                raise CorruptFile(
                    f"its header has no checksum entry, though its format version "
                    f"{header['version']} writes one"
                )
            sums = _checksums(header, keys) if signed else {}
            check(header)
            tensors = {}
            for key in sorted(keys):
                # A copy: safetensors maps the file into memory, and a tensor backed by
                # the map would change (or fault) if the file were rewritten in place.
                # The copy is what the checksum verifies.
                tensors[key] = f.get_tensor(key).clone()
                if signed and tensor_digest(tensors[key]) != sums[key]:
                    raise CorruptFile(
                        f"the bytes of tensor `{key}` do not match their SHA-256 checksum"
                    )
    except CorruptFile as e:
        raise ValueError(
            f"{where}: checkpoint '{name}' is corrupt: {e}. It changed after it was saved "
            "(a disk, memory or transfer error, an interrupted copy, or an edit). Nothing "
            "was loaded; use another copy of the checkpoint."
        ) from None
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
    specs = leaf_specs(tensors, header["values"])
    if overlap or structure_fingerprint(specs) != header["structure"]:
        raise ValueError(
            f"{where}: '{name}' is not a valid funcensemble checkpoint: its header does not "
            "describe the tensors it holds (the file was modified or corrupted)."
        )
    return header, tensors, signed
