"""Replacing a file all at once: readers and crashes see the old file or the new, never a mix."""

import contextlib
import os
import secrets
import stat
from collections.abc import Callable


def atomic_write(where: str, path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Create or replace ``path`` with what ``write(tmp_path)`` writes into ``tmp_path``.

    ``write`` fills a temporary file in the same directory (same filesystem, so the
    final ``os.replace`` is an atomic rename); the data and then the directory entry
    are flushed to disk. If anything fails or is interrupted (even ``KeyboardInterrupt``)
    the temporary file is removed and ``path`` is left as it was.
    """
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    if os.path.isdir(target):
        raise IsADirectoryError(
            f"{where}: '{os.fspath(path)}' is a directory; give a file path such as "
            f"'{os.path.join(os.fspath(path), 'ensemble.safetensors')}'."
        )
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"{where}: the directory '{directory}' does not exist; create it first "
            "(e.g. os.makedirs(..., exist_ok=True))."
        )
    tmp = os.path.join(directory, f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
    # Created with mode 0o666 so the umask applies, as for a plain open(path, "wb").
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        mode = stat.S_IMODE(os.stat(target if os.path.exists(target) else tmp).st_mode)
        write(tmp)
        # ``write`` may itself replace tmp (safetensors writes via its own temporary
        # file, mode 0o600): give the result the mode the target has or would get.
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable. Windows cannot open a directory for fsync; NTFS
    # journals the rename instead.
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
