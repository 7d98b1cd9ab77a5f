"""Reading a DCP checkpoint's ``.metadata`` without letting it run code.

``torch.distributed.checkpoint`` pickles its metadata, and ``pickle.load`` calls whatever
the file names: a crafted ``.metadata`` runs code when loaded. Here the unpickler
resolves only the classes DCP metadata is made of (its dataclasses, ``torch.Size``,
dtypes, layouts, memory formats, ``pathlib`` paths for the checkpoint id) and refuses
any other name before calling anything. What comes out is then checked to have DCP's
shape, and every data file it names to lie in the checkpoint directory.
"""

import io
import os
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .._torch_compat import dcp_private_pickle_names, dcp_storage_info

_METADATA_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "StorageMeta",
    "MetadataIndex",
    "_MEM_FORMAT_ENCODING",
)
_PATH_CLASSES = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")

_STORAGE_INFO = dcp_storage_info()


def _allowed() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {("torch", "Size"): torch.Size}
    for name in _METADATA_CLASSES:
        if hasattr(dcp_metadata, name):
            allowed[(dcp_metadata.__name__, name)] = getattr(dcp_metadata, name)
    allowed.update(dcp_private_pickle_names())
    for name in _PATH_CLASSES:
        cls = getattr(pathlib, name)
        allowed[("pathlib", name)] = allowed[(cls.__module__, name)] = cls
    return allowed


class RefusedName(ValueError):
    """The pickle names something that is not part of DCP metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    allowed = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch":  # torch.float32, torch.strided, torch.contiguous_format, ...
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise RefusedName(f"{module}.{name}")


class BadMetadata(ValueError):
    """The metadata is not what DCP writes: a clause saying what is wrong."""


def _check_file_name(relative_path: object) -> None:
    if (
        not isinstance(relative_path, str)
        or relative_path in ("", ".", "..")
        or os.path.basename(relative_path) != relative_path
        or os.path.isabs(relative_path)
    ):
        raise BadMetadata(
            f"it names the data file {relative_path!r}, which is not a file name inside the "
            "checkpoint directory"
        )


def _check_tensor(key: str, md: TensorStorageMetadata) -> None:
    props = md.properties
    if not (
        isinstance(props, TensorProperties)
        and isinstance(props.dtype, torch.dtype)
        and isinstance(md.size, torch.Size)
        and isinstance(md.chunks, list)
        and all(
            isinstance(c, ChunkStorageMetadata)
            and isinstance(c.offsets, torch.Size)
            and isinstance(c.sizes, torch.Size)
            and len(c.offsets) == len(c.sizes) == len(md.size)
            for c in md.chunks
        )
    ):
        raise BadMetadata(f"its entry for `{key}` is not a DCP tensor description")


def _check(metadata: object) -> Metadata:
    if not isinstance(metadata, Metadata):
        raise BadMetadata(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise BadMetadata("its state_dict_metadata is not a dict")
    for key, md in entries.items():
        if not isinstance(key, str):
            raise BadMetadata(f"it has the key {key!r}, not a string")
        if isinstance(md, TensorStorageMetadata):
            _check_tensor(key, md)
        elif not isinstance(md, BytesStorageMetadata):
            raise BadMetadata(f"its entry for `{key}` is a {type(md).__name__}")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise BadMetadata("its storage_data is not a dict")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _STORAGE_INFO):
            raise BadMetadata("its storage_data does not map entries to places in files")
        _check_file_name(info.relative_path)
        for field in (info.offset, info.length):
            if isinstance(field, bool) or not isinstance(field, int) or field < 0:
                raise BadMetadata(f"it places `{index.fqn}` at offset/length {field!r}")
    return metadata


def load_metadata(data: bytes) -> Metadata:
    """DCP ``Metadata`` from the bytes of a ``.metadata`` file, or an error; runs no code.

    Raises ``RefusedName`` (the name of the callable it would have run) or
    ``BadMetadata`` (not DCP metadata, or a file name outside the directory).
    """
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except RefusedName:
        raise
    except Exception as error:  # any malformed pickle
        raise BadMetadata(
            f"it is not a readable pickle ({type(error).__name__}: {error})"
        ) from None
    return _check(metadata)
