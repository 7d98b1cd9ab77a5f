"""SHA-256 checksums of bytes and of tensors' stored bytes, for the checkpoint formats."""

import hashlib
import re
import sys

import torch
from torch import Tensor

ALGORITHM = "sha256"
HEX_DIGITS = 64
DIGEST = re.compile(r"[0-9a-f]{64}")


def digest(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def little_endian_bytes(t: Tensor) -> memoryview:
    """The bytes of a CPU tensor as a file stores them: contiguous, little-endian."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8)
    if sys.byteorder == "big" and t.element_size() > 1:
        raw = raw.reshape(-1, t.element_size()).flip(1).reshape(-1)
    return memoryview(raw.numpy())


def tensor_digest(t: Tensor) -> str:
    return digest(little_endian_bytes(t))


def is_digest(value: object) -> bool:
    return isinstance(value, str) and DIGEST.fullmatch(value) is not None


def file_range_digest(path: str, start: int, length: int, *, block: int = 1 << 24) -> str:
    """The SHA-256 of ``length`` bytes of a file from ``start`` (fewer if the file ends)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while left > 0:
            data = f.read(min(left, block))
            if not data:
                break
            h.update(data)
            left -= len(data)
    return h.hexdigest()
