"""A safetensors file whose header carries a checksum of itself, written and verified here.

The layout is safetensors' own (an 8-byte little-endian header length, a JSON header
padded with spaces to a multiple of 8 bytes, then the tensors' bytes back to back), so
any safetensors reader opens the file. It is written by hand rather than by
``safetensors.torch.save_file``, which writes into a temporary file of its own that a
killed save leaves behind under a name nobody can recognise.

The header's ``__metadata__`` holds ``"funcensemble.sha256"``: the SHA-256 of the length
bytes and the header bytes, computed with that value's 64 hex digits set to ``0``. So
every byte before the tensors' data is covered, the key names, dtypes, shapes and
offsets included; the caller covers the data (see ``_checkpoint_file``).
"""

import json
import os
import re
from typing import BinaryIO

import torch
from torch import Tensor

from .checksum import HEX_DIGITS, digest, little_endian_bytes

HEADER_HASH_KEY = "funcensemble.sha256"
_HEADER_HASH = re.compile(rb'"funcensemble\.sha256"\s*:\s*"([0-9a-f]{64})"')
_PLACEHOLDER = "0" * HEX_DIGITS
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CorruptFile(ValueError):
    """What is wrong with the file, as a clause: "its header ... ". Caught by the reader."""


def _signed(prefix_and_header: bytes, span: tuple[int, int]) -> str:
    start, end = span
    zeroed = prefix_and_header[:start] + _PLACEHOLDER.encode() + prefix_and_header[end:]
    return digest(zeroed)


def _hash_span(prefix_and_header: bytes) -> tuple[int, int] | None:
    found = list(_HEADER_HASH.finditer(prefix_and_header, 8))
    if len(found) != 1:
        return None
    return found[0].span(1)


def write_safetensors(f: BinaryIO, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` (CPU, contiguous) and string ``metadata`` as a signed safetensors file."""
    # Widest elements first, as safetensors orders them: every tensor is then aligned
    # to its element size (the header is padded to a multiple of 8).
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    entries: dict[str, object] = {"__metadata__": {**metadata, HEADER_HASH_KEY: _PLACEHOLDER}}
    offset = 0
    for key in order:
        t = tensors[key]
        size = t.numel() * t.element_size()
        entries[key] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    blob = len(header).to_bytes(8, "little") + header
    span = _hash_span(blob)
    assert span is not None, "the placeholder is the header's only checksum entry"
    blob = blob[: span[0]] + _signed(blob, span).encode() + blob[span[1] :]
    f.write(blob)
    for key in order:
        f.write(little_endian_bytes(tensors[key]))


def verify_header(path: str) -> bool:
    """Check the header's checksum; False when the header has none (an older file).

    Raises ``CorruptFile`` for a file too short for its header, a header length past
    the end of the file, several checksum entries, or a checksum that does not match.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CorruptFile(f"it is {size} bytes long, too short for a safetensors header")
        length = int.from_bytes(prefix, "little")
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise CorruptFile(
                f"its first 8 bytes give a header of {length} bytes; the file has {size - 8} "
                "after them"
            )
        blob = prefix + f.read(length)
    span = _hash_span(blob)
    if span is None:
        if _HEADER_HASH.search(blob, 8) is not None or b"funcensemble.sha256" in blob:
            raise CorruptFile("its header checksum entry is damaged")
        return False
    if blob[span[0] : span[1]].decode() != _signed(blob, span):
        raise CorruptFile(
            f"its header (bytes 0 to {8 + length}: tensor names, dtypes, shapes, offsets "
            "and the funcensemble header) does not match its SHA-256 checksum"
        )
    return True
