"""Replacing a file all at once: readers and crashes see the old file or the new, never a mix.

The new file is written to a temporary file beside the target, named
``.<target name>.funcensemble-tmp-<host>-<pid>-<random>``, flushed to disk and renamed
over the target. Every failure that Python sees (an exception, ``KeyboardInterrupt``)
removes it. A process killed outright (SIGKILL, a power cut) cannot remove it; the next
save of the same target on the same host removes the temporary files of that target
whose writing process has exited (no process has its pid, or, on Linux, the one that has
it started after the file was last written: the pid was reused), and leaves those of
live processes (a concurrent save) and of other hosts alone.
"""

import contextlib
import os
import re
import secrets
import socket
import stat
from collections.abc import Callable
from typing import BinaryIO

TEMP_TAG = ".funcensemble-tmp-"


def _host() -> str:
    # No "-" in it: the temporary name is split on "-" to read the host and the pid.
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "localhost"


def temp_path(target: str) -> str:
    """A fresh temporary name for ``target``, in its directory."""
    directory, name = os.path.split(target)
    tag = f"{TEMP_TAG}{_host()}-{os.getpid()}-{secrets.token_hex(6)}"
    return os.path.join(directory, f".{name}{tag}")


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, never later than the truth)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        # btime is rounded down to the second: the sum is at most the true start time.
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None  # not Linux, or the process is gone


def _writer_gone(pid: int, modified: float) -> bool:
    """Whether the process that last wrote a temporary file at ``modified`` has exited.

    Either no process has that pid, or (on Linux) the one that has it started after the
    file was last written, more than a minute after: the pid was reused.
    """
    if not _process_exists(pid):
        return True
    started = _process_start_time(pid)
    return started is not None and started > modified + 60


def stale_temp_files(target: str) -> list[str]:
    """The temporary files of ``target`` whose writer, a process of this host, has exited."""
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there
        return []
    directory, name = os.path.split(target)
    prefix = f".{name}{TEMP_TAG}"
    host, found = _host(), []
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            if not entry.startswith(prefix):
                continue
            parts = entry[len(prefix) :].split("-")
            if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
                continue
            pid, path = int(parts[1]), os.path.join(directory, entry)
            if pid != os.getpid() and _writer_gone(pid, os.path.getmtime(path)):
                found.append(path)
    return sorted(found)


def remove_stale_temp_files(target: str) -> None:
    for path in stale_temp_files(target):
        with contextlib.suppress(FileNotFoundError):  # another save removed it first
            os.unlink(path)


def atomic_write(where: str, path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Create or replace ``path`` with what ``write(file)`` writes into ``file``.

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
    remove_stale_temp_files(target)
    tmp = temp_path(target)
    # Created with mode 0o666 so the umask applies, as for a plain open(path, "wb").
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(target):  # a replaced checkpoint keeps its permissions
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
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
