"""Checksums for sharded (DCP) checkpoints: written with the data, verified before reading.

Each rank hashes the byte ranges DCP wrote for its entries (one range per tensor chunk,
in its ``__<rank>_<i>.distcp`` files) and hands the digests to the coordinator with its
write results. The coordinator, after DCP has written ``.metadata``, writes
``.funcensemble-checksums``: a first line ``funcensemble-checksums sha256 <digest of
the rest>``, then JSON with the SHA-256 and size of ``.metadata``, the size of every
data file, and per entry its key, chunk offsets, file, byte range and SHA-256.

On load the checksum file is checked first, then ``.metadata`` against it (before it is
unpickled, and then only by ``_dcp_metadata``'s restricted unpickler), then, before DCP
reads anything, every byte range this rank will read. The data files' entries tile each
file from its first byte to its last, so a changed byte anywhere in them is found by the
rank that reads it (in one process, by the load). A checkpoint without the checksum file
(plain DCP, or an older funcensemble) still loads, with a warning.
"""

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._checkpoint.atomic import atomic_write
from .._checkpoint.checksum import digest, file_range_digest, is_digest
from .._torch_compat import dcp_storage_meta
from ._dcp_metadata import BadMetadata, RefusedName, load_metadata

CHECKSUM_FILE = ".funcensemble-checksums"
_FORMAT = "funcensemble-checksums"
_FIRST_LINE = f"{_FORMAT} sha256 "


class Corrupt(ValueError):
    """A checksum or size does not match: a clause naming the file and the region."""


Key = tuple[str, tuple[int, ...]]  # (entry key, chunk offsets): DCP's MetadataIndex


def _index_key(index: MetadataIndex) -> Key:
    return (index.fqn, tuple(index.offset or ()))


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer, plus a SHA-256 per written entry and the checksum file."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        stamped = [
            WriteResult(
                index=r.index,
                size_in_bytes=r.size_in_bytes,
                storage_data=(r.storage_data, self._digest(r.storage_data)),
            )
            for r in results
        ]
        done: Future[list[WriteResult]] = Future()
        done.set_result(stamped)
        return done

    def _digest(self, info: Any) -> str:
        path = os.path.join(os.fspath(self.path), info.relative_path)
        return file_range_digest(path, info.offset, info.length)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain, items = [], []
        for rank_results in results:
            plain.append([])
            for r in rank_results:
                info, sha = r.storage_data
                plain[-1].append(WriteResult(r.index, r.size_in_bytes, info))
                offsets = list(r.index.offset or ())
                items.append(
                    [r.index.fqn, offsets, info.relative_path, info.offset, info.length, sha]
                )
        root = os.fspath(self.path)
        _check_shared(root, results)  # before .metadata: an unshared save stays incomplete
        super().finish(metadata, plain)
        with open(os.path.join(root, ".metadata"), "rb") as f:
            meta = f.read()
        files = sorted({item[2] for item in items})
        body = {
            "format": _FORMAT,
            "version": 1,
            "metadata": {"size": len(meta), "sha256": digest(meta)},
            "files": {name: os.path.getsize(os.path.join(root, name)) for name in files},
            "items": sorted(items),
        }
        text = json.dumps(body, separators=(",", ":")).encode()
        blob = f"{_FIRST_LINE}{digest(text)}\n".encode() + text
        atomic_write("distributed.save", os.path.join(root, CHECKSUM_FILE), lambda f: f.write(blob))


class UnsharedFilesystemError(OSError):
    """The coordinator does not see a data file another rank wrote: no shared filesystem."""


def _check_shared(root: str, results: list[list[WriteResult]]) -> None:
    """Every rank's data files, as the coordinator sees them, hold what that rank wrote.

    Ranks whose checkpoint directory lies on their own disks each write their file
    there and DCP reports success; the coordinator would then describe files that it
    cannot see. Checked here, before ``.metadata`` is written, so such a save fails.
    """
    needed: dict[str, tuple[int, int]] = {}  # file: (rank that wrote it, bytes written)
    for rank, rank_results in enumerate(results):
        for r in rank_results:
            info = r.storage_data[0]
            end = info.offset + info.length
            needed[info.relative_path] = (rank, max(end, needed.get(info.relative_path, (0, 0))[1]))
    for name, (rank, end) in sorted(needed.items()):
        path = os.path.join(root, name)
        seen = os.path.getsize(path) if os.path.isfile(path) else None
        if seen is None or seen < end:
            sees = "does not see it" if seen is None else f"sees {seen} bytes of it"
            raise UnsharedFilesystemError(
                f"rank {rank} wrote {name} ({end} bytes) to '{root}', but the rank that "
                f"writes .metadata {sees}: the ranks do not write to one shared filesystem, "
                "or were given different paths (pass every rank the same directory)"
            )


@dataclass(frozen=True)
class Checksums:
    """The contents of a checkpoint's checksum file, itself verified."""

    metadata: tuple[int, str]  # size and sha256 of .metadata
    files: dict[str, int]  # data file: size
    items: dict[Key, tuple[str, int, int, str]]  # entry: file, start, length, sha256


def _parse_checksums(blob: bytes) -> Checksums:
    head, newline, text = blob.partition(b"\n")
    line = head.decode("ascii", errors="replace")
    if not newline or not line.startswith(_FIRST_LINE) or not is_digest(line[len(_FIRST_LINE) :]):
        raise Corrupt(f"its {CHECKSUM_FILE} file does not start with its own checksum")
    if digest(text) != line[len(_FIRST_LINE) :]:
        raise Corrupt(f"its {CHECKSUM_FILE} file does not match its own SHA-256 checksum")
    try:
        body = json.loads(text)
        if body["format"] != _FORMAT or body["version"] != 1:
            raise ValueError("another format or version")
        checksums = Checksums(
            metadata=(int(body["metadata"]["size"]), str(body["metadata"]["sha256"])),
            files={str(k): int(v) for k, v in body["files"].items()},
            items={
                (str(fqn), tuple(int(o) for o in offsets)): (str(f), int(s), int(n), str(sha))
                for fqn, offsets, f, s, n, sha in body["items"]
            },
        )
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise Corrupt(
            f"its {CHECKSUM_FILE} file checks out but does not hold what fe.distributed.save "
            f"writes ({type(e).__name__}: {e}): it was edited"
        ) from None
    _check_tiling(checksums)
    return checksums


def _check_tiling(checksums: Checksums) -> None:
    """The recorded byte ranges cover every data file exactly, so no byte goes unchecked."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for file, start, length, _ in checksums.items.values():
        ranges.setdefault(file, []).append((start, length))
    if ranges.keys() != checksums.files.keys():
        raise Corrupt(f"its {CHECKSUM_FILE} file lists other data files than its entries use")
    for file, size in checksums.files.items():
        end = 0
        for start, length in sorted(ranges[file]):
            if start != end:
                break
            end = start + length
        if end != size:
            raise Corrupt(f"its {CHECKSUM_FILE} file does not cover all of {file}")


def read_metadata(where: str, name: str) -> tuple[Metadata, Checksums | None]:
    """The checkpoint's DCP metadata, verified by its checksum file when it has one.

    Raises ``Corrupt`` (checksums), or ``ValueError`` for metadata that would run code
    or is not DCP's. ``None`` for the checksums: the checkpoint has no checksum file.
    """
    checksums = None
    sidecar = os.path.join(name, CHECKSUM_FILE)
    if os.path.isfile(sidecar):
        with open(sidecar, "rb") as f:
            checksums = _parse_checksums(f.read())
    with open(os.path.join(name, ".metadata"), "rb") as f:
        data = f.read()
    if checksums is not None:
        size, sha = checksums.metadata
        if len(data) != size:
            raise Corrupt(f"its .metadata file is {len(data)} bytes; {size} were written")
        if digest(data) != sha:
            raise Corrupt("its .metadata file does not match its SHA-256 checksum")
    try:
        metadata = load_metadata(data)
    except RefusedName as e:
        raise ValueError(
            f"{where}: '{name}/.metadata' names `{e}`, which DCP metadata never holds: "
            "it was refused without being run (unpickling it would have called it). "
            "fe.distributed.load reads only DCP's metadata classes; do not load this "
            "checkpoint, it may have been crafted to run code."
        ) from None
    except BadMetadata as e:
        raise ValueError(f"{where}: '{name}/.metadata' is not DCP metadata: {e}.") from None
    if checksums is not None:
        placed = {
            _index_key(i): (s.relative_path, s.offset, s.length)
            for i, s in metadata.storage_data.items()
        }
        if placed != {k: v[:3] for k, v in checksums.items.items()}:
            raise Corrupt(f"its {CHECKSUM_FILE} file and its .metadata describe different entries")
    return metadata, checksums


def identity(name: str) -> str:
    """What tells one checkpoint from another: the SHA-256 of its ``.metadata`` and of its
    checksum file (the digests of everything saved), read as they are on this rank."""
    parts = []
    for file in (".metadata", CHECKSUM_FILE):
        full = os.path.join(name, file)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                parts.append(f.read())
    return "SHA-256 " + digest(b"\0".join(parts))[:16]


def reads_of(metadata: Metadata, keys: dict[str, slice | None]) -> list[Key]:
    """The stored chunks a load of ``keys`` reads: all of a key's, or those meeting its rows."""
    found = []
    for index in metadata.storage_data:
        rows = keys.get(index.fqn, False)
        if rows is False:
            continue
        md = metadata.state_dict_metadata.get(index.fqn)
        chunk = next(
            (c for c in getattr(md, "chunks", ()) if tuple(c.offsets) == tuple(index.offset or ())),
            None,
        )
        if rows is not None and chunk is not None and len(chunk.offsets) > 0:
            start, stop = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
            if stop <= rows.start or start >= rows.stop:
                continue
        found.append(_index_key(index))
    return sorted(found)


def verify_reads(name: str, checksums: Checksums, reads: Iterable[Key]) -> None:
    """Check the size of every file and the SHA-256 of every byte range to be read."""
    sizes: dict[str, int] = {}
    for key in reads:
        file, start, length, sha = checksums.items[key]
        path = os.path.join(name, file)
        if file not in sizes:
            sizes[file] = os.path.getsize(path) if os.path.isfile(path) else -1
            if sizes[file] != checksums.files.get(file):
                got = "missing" if sizes[file] < 0 else f"{sizes[file]} bytes"
                raise Corrupt(
                    f"its data file {file} is {got}; {checksums.files.get(file)} bytes were written"
                )
        if file_range_digest(path, start, length) != sha:
            what = f"`{key[0]}`" + (f" (chunk at {list(key[1])})" if key[1] else "")
            raise Corrupt(
                f"the bytes of {what} in {file} (bytes {start} to {start + length}) do not "
                "match their SHA-256 checksum"
            )


class VerifiedReader(FileSystemReader):
    """DCP's file reader, handed the metadata already read and verified (never unpickled)."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # What FileSystemReader.read_metadata adds after unpickling, where this torch
        # version has it.
        storage_meta = dcp_storage_meta()
        if storage_meta is not None and hasattr(self, "load_id"):
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = storage_meta()
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata
