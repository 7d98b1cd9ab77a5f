"""fe.distributed.save / load, in one process: checksums, byte flips, safe metadata reading.

The multi-rank round trips (saved on 2 ranks, read on 4 or in one process) are in
test_distributed.py; they pass only if every rank verifies the entries it reads.
"""

import builtins
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_trees_equal, dcp_load_alone, dcp_save_alone
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import funcensemble as fe
from funcensemble._checkpoint.checksum import digest
from funcensemble.distributed._dcp_checksums import CHECKSUM_FILE

FILES = [CHECKSUM_FILE, ".metadata", "__0_0.distcp"]


def make_member() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def run_state(seed: int) -> dict[str, Any]:
    ens = fe.Ensemble.from_factory(make_member, num_members=5, seed=seed)
    params = {k: v.detach() for k, v in ens.stacked_params().items()}
    opt = fe.optim.adam(1e-3).init(params)
    return {"params": params, "buffers": ens.stacked_buffers(), "opt": opt, "step": 7, "lr": 1e-3}


def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = run_state(0)
    fe.distributed.save(tmp_path / "ckpt", state)
    return tmp_path / "ckpt", state


def test_save_writes_checksums_and_load_verifies_them(tmp_path: Path) -> None:
    path, state = saved(tmp_path)
    assert sorted(os.listdir(path)) == FILES
    head = (path / CHECKSUM_FILE).read_bytes().split(b"\n", 1)
    assert head[0] == f"funcensemble-checksums sha256 {digest(head[1])}".encode()
    assert_trees_equal(fe.distributed.load(path, run_state(1)), state)


def write_at(f: Any, pos: int, byte: int) -> None:
    f.seek(pos)
    f.write(bytes([byte]))


def flips(size: int, every: int) -> list[int]:
    return sorted({*range(0, size, every), *range(max(0, size - 8), size)})


@pytest.mark.slow
def test_every_flipped_byte_of_every_file_is_refused(tmp_path: Path) -> None:
    """One bit flipped at a time in each file of the checkpoint: never a silent load."""
    path, state = saved(tmp_path)
    template = run_state(1)
    refused: dict[str, int] = {}
    silent = []
    for name, every in ((CHECKSUM_FILE, 17), (".metadata", 23), ("__0_0.distcp", 163)):
        file = path / name
        data = file.read_bytes()
        refused[name] = 0
        with open(file, "r+b", buffering=0) as f:
            for i, pos in enumerate(flips(len(data), every)):
                write_at(f, pos, data[pos] ^ (1 << (i % 8)))
                try:
                    fe.distributed.load(path, template)
                except ValueError as e:
                    assert "is corrupt" in str(e), str(e)
                    refused[name] += 1
                else:
                    silent.append((name, pos))
                write_at(f, pos, data[pos])
    print(f"sharded byte flips refused: {refused}; silent loads: {len(silent)}")
    assert silent == []
    assert min(refused.values()) > 200
    assert_trees_equal(fe.distributed.load(path, template), state)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda p: (p / "__0_0.distcp").write_bytes(b""), r"data file __0_0.distcp is 0 bytes"),
        (lambda p: (p / "__0_0.distcp").unlink(), r"data file __0_0.distcp is missing"),
        (lambda p: (p / ".metadata").write_bytes(b"x"), r"\.metadata file is 1 bytes"),
        (
            lambda p: (p / CHECKSUM_FILE).write_bytes(b"x\n{}"),
            "does not start with its own checksum",
        ),
    ],
)
def test_damaged_files_are_refused(tmp_path: Path, change: Any, match: str) -> None:
    path, _ = saved(tmp_path)
    change(path)
    with pytest.raises(
        ValueError, match=rf"distributed.load: checkpoint '.*ckpt' is corrupt: .*{match}"
    ):
        fe.distributed.load(path, run_state(1))


def test_checkpoint_without_checksums_loads_with_a_warning(tmp_path: Path) -> None:
    path, state = saved(tmp_path)
    (path / CHECKSUM_FILE).unlink()  # as plain DCP or an older funcensemble wrote it
    with pytest.warns(UserWarning, match=rf"has no {CHECKSUM_FILE} file .*could not be detected"):
        loaded = fe.distributed.load(path, run_state(1))
    assert_trees_equal(loaded, state)
    # A checkpoint written by DCP itself from nested state: DCP names it as
    # fe.distributed.save does (dotted paths).
    plain = {"net": {"w": torch.arange(6.0).reshape(3, 2)}, "step": torch.tensor(4)}
    dcp_save_alone(plain, tmp_path / "plain")
    with pytest.warns(UserWarning, match="has no"):
        loaded = fe.distributed.load(
            tmp_path / "plain", {"net": {"w": torch.zeros(3, 2)}, "step": 0}
        )
    assert torch.equal(loaded["net"]["w"], plain["net"]["w"]) and loaded["step"] == 4


def test_checkpoints_are_plain_dcp_keyed_by_state_dict_names(tmp_path: Path) -> None:
    """Written by DCP's default planner: plain ``dcp.load`` reads them into a state_dict."""
    ens = fe.Ensemble.from_factory(make_member, num_members=3, seed=0)
    fe.distributed.save(tmp_path / "ens", ens)
    metadata = FileSystemReader(tmp_path / "ens").read_metadata()
    assert set(metadata.state_dict_metadata) == set(ens.state_dict())
    other = fe.Ensemble.from_factory(make_member, num_members=3, seed=1)
    state = other.state_dict()
    dcp_load_alone(state, tmp_path / "ens")
    assert_trees_equal(other.state_dict(), ens.state_dict())
    # A pytree: dotted paths, as DCP names nested state; plain dcp.load reads them.
    path, run = saved(tmp_path)
    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    assert {"params.0.weight", "buffers.1.running_mean", "opt.0.mu.2.bias", "step"} <= keys
    target = {"params": {k: torch.zeros_like(v) for k, v in run["params"].items()}}
    dcp_load_alone(target, path)
    assert_trees_equal(target["params"], run["params"])


class _Calibrated(nn.Module):
    """A module keeping a scale as extra state, as a tensor, a float or a dict."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.kind, self.scale = kind, 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale

    def get_extra_state(self) -> Any:
        kinds = {"tensor": torch.tensor(self.scale), "float": self.scale}
        return kinds.get(self.kind, {"scale": self.scale})

    def set_extra_state(self, state: Any) -> None:
        self.scale = float(state["scale"] if isinstance(state, dict) else state)


@pytest.mark.parametrize("kind", ["tensor", "float", "dict"])
def test_an_ensemble_with_extra_state_is_refused_before_anything_changes(
    tmp_path: Path, kind: str
) -> None:
    """A checkpoint holds parameters and buffers. Extra state kept as a tensor was
    written, but loading copied into the tensor get_extra_state had just made, so a
    saved scale of 3.0 came back 1.0 with no error (outputs 3.0 off); as a float, the
    load failed after the weights were overwritten; as a dict, save died of a KeyError.
    Plain dcp.save of ens.state_dict() writes it too, and loads the same way."""
    members = [_Calibrated(kind) for _ in range(2)]
    for m in members:
        m.scale = 3.0
    ens = fe.Ensemble(members)
    with pytest.raises(TypeError, match=r"^distributed.save: .* keeps extra state .*drop it"):
        fe.distributed.save(tmp_path / "ens", ens)
    assert not (tmp_path / "ens" / ".metadata").exists()
    fresh = fe.Ensemble([_Calibrated(kind) for _ in range(2)])
    before = {k: v.clone() for k, v in fresh.state_dict().items() if torch.is_tensor(v)}
    written = tmp_path / "plain"
    if kind == "tensor":
        dcp_save_alone(ens.state_dict(), written)
    else:
        fe.distributed.save(
            written, fe.Ensemble([nn.Sequential(nn.Linear(3, 2)) for _ in range(2)])
        )
    with pytest.raises(TypeError, match=r"^distributed.load: .* keep this ensemble's own"):
        fe.distributed.load(written, fresh)
    after = fresh.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert fresh.stacked.scale == 1.0


# --- .metadata is never unpickled with the standard unpickler ------------------------------


class RunsCode:
    """Unpickled, calls ``function(*args)``: what a crafted .metadata would do."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.call = (function, args)

    def __reduce__(self) -> Any:
        return self.call


def resign(path: Path) -> None:
    """Redo the checksum file for the current .metadata, as an attacker could."""
    text = (path / CHECKSUM_FILE).read_bytes().split(b"\n", 1)[1]
    meta = (path / ".metadata").read_bytes()
    body = json.loads(text)
    body["metadata"] = {"size": len(meta), "sha256": digest(meta)}
    text = json.dumps(body).encode()
    (path / CHECKSUM_FILE).write_bytes(
        f"funcensemble-checksums sha256 {digest(text)}\n".encode() + text
    )


@pytest.mark.parametrize("checksums", ["none", "redone"])
@pytest.mark.parametrize("gadget", ["os.system", "builtins.open"])
def test_metadata_that_would_run_code_is_refused(
    tmp_path: Path, checksums: str, gadget: str
) -> None:
    path, _ = saved(tmp_path)
    marker = tmp_path / "marker"
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file: safe to unpickle here
    payload = (
        RunsCode(os.system, f"touch {marker}")
        if gadget == "os.system"
        else RunsCode(builtins.open, str(marker), "w")
    )
    metadata.planner_data = payload  # hidden in a field DCP does not look at
    crafted = pickle.dumps(metadata)
    (path / ".metadata").write_bytes(crafted)
    if checksums == "none":
        (path / CHECKSUM_FILE).unlink()
    else:
        resign(path)  # checksums prove integrity, not who wrote the file
    template = run_state(1)
    before = {k: v.clone() for k, v in template["params"].items()}
    with pytest.raises(
        ValueError, match=r"\.metadata' names `(os|posix|nt|builtins|io)\.(system|open)`, which DCP"
    ):
        fe.distributed.load(path, template)
    assert not marker.exists()
    assert_trees_equal(template["params"], before)
    if gadget == "builtins.open":  # the file is live: the standard unpickler runs it
        pickle.loads(crafted).planner_data.close()
        assert marker.exists()


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    shutil.copy(path / "__0_0.distcp", tmp_path / "elsewhere.distcp")
    (path / CHECKSUM_FILE).unlink()
    with pytest.raises(
        ValueError, match=r"names the data file '\.\./elsewhere\.distcp', which is not"
    ):
        fe.distributed.load(path, run_state(1))


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    (path / CHECKSUM_FILE).unlink()
    (path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(ValueError, match=r"is not DCP metadata: it holds a dict, not DCP Metadata"):
        fe.distributed.load(path, run_state(1))
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ValueError, match=r"is not DCP metadata: it is not a readable pickle"):
        fe.distributed.load(path, run_state(1))


def test_load_never_uses_the_standard_unpickler(tmp_path: Path, monkeypatch: Any) -> None:
    path, state = saved(tmp_path)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pickle.load(s) called")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    assert_trees_equal(fe.distributed.load(path, run_state(1)), state)


def test_data_files_are_read_as_weights_only(tmp_path: Path, monkeypatch: Any) -> None:
    """DCP reads each tensor with torch.load(weights_only=True): no code in the data files."""
    path, state = saved(tmp_path)
    real_load, calls = torch.load, []

    def load(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    assert_trees_equal(fe.distributed.load(path, run_state(1)), state)
    assert calls and all(w is True for w in calls)


def test_entries_stored_as_pickled_objects_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    flat = {"w": torch.zeros(3), "step": RunsCode(builtins.open, str(marker), "w")}
    dcp_save_alone(flat, tmp_path / "plain")
    with pytest.raises(ValueError, match=r"stores leaf `step` as pickled bytes"):
        fe.distributed.load(tmp_path / "plain", {"w": torch.zeros(3), "step": 0})
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_damage_found_by_one_rank_fails_every_rank(tmp_path: Path) -> None:
    """Rank 1 alone reads the damaged file; rank 0 must fail too, not wait inside DCP.
    Then ranks loading two different intact checkpoints (steps 6 and 3, same structure)
    are refused on every rank: each loaded its own without a word. And ranks saving to
    different paths fail on every rank, leaving no .metadata, with a message that says
    so (it blamed an unshared filesystem alone)."""
    import sharded_checkpoint_worker as worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests = str(Path(__file__).parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([tests, os.getcwd()]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, worker.__file__, str(tmp_path / "ckpt")],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for rank in ranks:
            outputs.append(rank.communicate(timeout=120)[0])
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    for output in outputs:
        assert (
            "ERROR distributed.load: checkpoint '" in output
            and "is corrupt: the bytes of `params.weight` (chunk at [3, 0, 0]) in __1_0.distcp"
            in output
            and "(found by rank 1 of 2)" in output
        ), output
        assert (
            "APART distributed.load: the 2 ranks were not set up alike: they differ in the "
            "checkpoint found (rank 0: SHA-256 "
            in output
            and "read the same checkpoint: one directory all ranks share" in output
        ), output
        assert (
            "SPLIT distributed.save: rank " in output
            and "or were given different paths (pass every rank the same directory)" in output
            and "metadata=False" in output
        ), output
