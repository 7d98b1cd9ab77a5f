"""Failures of sharded save and load name the rank, the operation and the cause
(funcensemble/_dist_errors.py), in one process; the multi-process ones are in
test_distributed.py and test_elastic.py."""

import re
import shutil
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import funcensemble as fe
from funcensemble.distributed import _sharded_checkpoint
from funcensemble.distributed._dcp_checksums import CHECKSUM_FILE, ChecksummingWriter
from funcensemble.distributed._errors import cause_text


def _ensemble() -> fe.Ensemble:
    return fe.Ensemble.from_factory(lambda: torch.nn.Linear(3, 2).double(), num_members=4)


def _message(where: str, doing: str, path: Path, cause: str) -> str:
    """The whole message, as a regular expression: rank, operation, hint, cause."""
    return (
        rf"{where}: rank 0 of 1 failed while {doing} '{re.escape(str(path))}', after "
        r"\d+\.\d s\. A sharded checkpoint is one directory that every rank reads and "
        r"writes: give a path on a filesystem all ranks share \(not a node-local disk\), "
        r"that exists or can be created, and is readable and writable by every rank\. If "
        r"the cause is on another rank, or none is given, that rank's own output says "
        rf"more\. Cause: CheckpointException: {cause}"
    )


def test_a_checkpoint_exception_is_told_by_each_failed_ranks_own_error():
    error = CheckpointException(
        "save",
        {1: (OSError(28, "No space left on device"), None), 0: (ValueError("bad\nline"), None)},
    )
    assert cause_text(error) == (
        "CheckpointException: on rank 0, ValueError: bad line; on rank 1, OSError: "
        "[Errno 28] No space left on device"
    )


def test_saving_where_no_directory_can_be_made(tmp_path):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "ckpt"
    with pytest.raises(fe.distributed.DistributedError) as info:
        fe.distributed.save(path, _ensemble())
    cause = (
        rf"on rank 0, NotADirectoryError: \[Errno 20\] Not a directory: '{re.escape(str(path))}'"
    )
    assert re.fullmatch(
        _message(r"distributed\.save", "writing its members to", path, cause), str(info.value)
    ), str(info.value)
    assert (info.value.rank, info.value.world_size, info.value.operation) == (
        0,
        1,
        "distributed.save",
    )
    assert isinstance(info.value.__cause__, CheckpointException)


def test_loading_a_checkpoint_whose_data_file_is_gone(tmp_path):
    """Without a checksum file (plain DCP) the missing file is found by DCP's read."""
    ens = _ensemble()
    fe.distributed.save(tmp_path / "ckpt", ens)
    (tmp_path / "ckpt" / CHECKSUM_FILE).unlink()
    (tmp_path / "ckpt" / "__0_0.distcp").unlink()
    data = re.escape(str(tmp_path / "ckpt" / "__0_0.distcp"))
    with (
        pytest.warns(UserWarning, match="could not be detected"),
        pytest.raises(fe.distributed.DistributedError) as info,
    ):
        fe.distributed.load(tmp_path / "ckpt", ens)
    cause = rf"on rank 0, FileNotFoundError: \[Errno 2\] No such file or directory: '{data}'"
    assert re.fullmatch(
        _message(r"distributed\.load", "reading its members from", tmp_path / "ckpt", cause),
        str(info.value),
    ), str(info.value)


def test_loading_a_missing_or_incomplete_directory_is_refused_before_any_collective(tmp_path):
    ens = _ensemble()
    with pytest.raises(FileNotFoundError, match=r"distributed\.load: no checkpoint directory at"):
        fe.distributed.load(tmp_path / "nowhere", ens)
    fe.distributed.save(tmp_path / "ckpt", ens)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
    (tmp_path / "copy" / "__0_0.distcp").unlink()  # checked against the checksum file
    with pytest.raises(ValueError, match=r"is corrupt: its data file __0_0\.distcp is missing"):
        fe.distributed.load(tmp_path / "copy", ens)


def test_a_save_whose_data_file_the_coordinator_cannot_see_fails_and_stays_incomplete(
    tmp_path, monkeypatch
):
    """As when the directory is on each machine's own disk: the file a rank wrote is not
    where rank 0 looks. The save raises, and writes no ``.metadata``."""
    write_data = ChecksummingWriter.write_data

    def lost(self, plan, planner):
        done = write_data(self, plan, planner)
        for name in {r.storage_data[0].relative_path for r in done.wait()}:
            (Path(self.path) / name).unlink()
        return done

    monkeypatch.setattr(ChecksummingWriter, "write_data", lost)
    path = tmp_path / "ckpt"
    with pytest.raises(fe.distributed.DistributedError) as info:
        fe.distributed.save(path, _ensemble())
    cause = (
        rf"on rank 0, UnsharedFilesystemError: rank 0 wrote __0_0\.distcp \(\d+ bytes\) to "
        rf"'{re.escape(str(path))}', but the rank that writes \.metadata does not see it: "
        r"the ranks do not write to one shared filesystem, or were given different paths "
        r"\(pass every rank the same directory\)"
    )
    assert re.fullmatch(
        _message(r"distributed\.save", "writing its members to", path, cause), str(info.value)
    ), str(info.value)
    assert not (path / ".metadata").exists() and not (path / CHECKSUM_FILE).exists()


def test_a_rank_that_does_not_see_the_checkpoint_says_which_rank_it_is(tmp_path, monkeypatch):
    """Checked before any collective, as a FileNotFoundError or ValueError; with several
    ranks the message says which rank looked (as rank 1 of 2 in a fake group here)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)

    def refused_here(where, call, refused, *ranks):
        # The exchange that carries a refusal to the other ranks needs a real group
        # (tests/test_distributed.py runs it on two): this rank raises its own error.
        if refused is not None:
            raise refused

    monkeypatch.setattr(_sharded_checkpoint, "agree_to_start", refused_here)
    monkeypatch.setattr(_sharded_checkpoint, "ranks", lambda shard: (1, 2, None, "cpu"))
    seen = (
        r" \(as rank 1 of 2 sees it: on several machines, a checkpoint must be on a "
        r"filesystem all ranks share\)"
    )
    with pytest.raises(FileNotFoundError) as info:
        fe.distributed.load(tmp_path / "nowhere", _ensemble())
    assert re.fullmatch(
        rf"distributed\.load: no checkpoint directory at '{re.escape(str(tmp_path))}/nowhere'"
        rf"{seen}\.",
        str(info.value),
    ), str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ValueError,
        match=rf"'{re.escape(str(tmp_path))}/empty' has no "
        rf"\.metadata file{seen}, so it is not a complete DCP checkpoint",
    ):
        fe.distributed.load(tmp_path / "empty", _ensemble())


def test_a_store_server_that_cannot_start_is_named_with_its_address(monkeypatch):
    """Rank 0 cannot serve the rendezvous: its port is taken by another program."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": "0",
            "WORLD_SIZE": "1",
        }.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        with pytest.raises(fe.distributed.DistributedError) as info:
            fe.distributed.init_process_group("gloo", join_timeout=timedelta(seconds=2))
    assert not dist.is_initialized()
    assert re.fullmatch(
        rf"init_process_group: rank 0 of 1 failed while starting the rendezvous server at "
        rf"127\.0\.0\.1:{port}, after \d+\.\d s \(join_timeout 2 s\)\. Check that "
        r"MASTER_PORT is free on rank 0's machine and reachable from every rank\. Cause: "
        r"(Dist\w*Error|RuntimeError): .*(address already in use|EADDRINUSE).*",
        str(info.value),
        flags=re.IGNORECASE,
    ), str(info.value)
