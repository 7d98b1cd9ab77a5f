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
import sharded_checkpoint_worker as worker
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


def run_two_ranks(*args: str) -> list[str]:
    """Each rank's output of ``sharded_checkpoint_worker.py *args`` on 2 gloo ranks."""
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
            [sys.executable, worker.__file__, *args],
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
    return outputs


@pytest.mark.slow
@pytest.mark.multiprocess
def test_damage_found_by_one_rank_fails_every_rank(tmp_path: Path) -> None:
    """Rank 1 alone reads the damaged file; rank 0 must fail too, not wait inside DCP.
    Then ranks loading two different intact checkpoints (steps 6 and 3, same structure)
    are refused on every rank: each loaded its own without a word. And ranks saving to
    different paths fail on every rank, leaving no .metadata, with a message that says
    so (it blamed an unshared filesystem alone)."""
    outputs = run_two_ranks(str(tmp_path / "ckpt"))
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


# --- an EnsembleOptimizer with per-member hyperparameters ----------------------------------


def fake_shard(num_members: int, rank: int, world_size: int) -> fe.distributed.MemberShard:
    """The MemberShard that rank ``rank`` of ``world_size`` would hold, in this process:
    without a process group, load reads all members and keeps this rank's rows."""
    shard = fe.distributed.MemberShard(num_members)
    shard.rank, shard.world_size = rank, world_size
    shard.slices = tuple(fe.distributed.member_slices(num_members, world_size))
    shard.members = shard.slices[rank]
    return shard


def clone(value: Any) -> Any:
    return None if value is None else value.clone()


def rows_of(state: dict[str, Any], rows: slice) -> dict[str, Any]:
    """An optimizer state_dict's state at members ``rows`` (shared step counts as they are)."""
    return {k: v if v is None or v.dim() == 0 else v[rows] for k, v in state["state"].items()}


def one_process_run(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The reference: all members in one process, saved after 2 steps to ``path/one-ens``
    and ``path/one-opt``; the optimizer state then, and the ensemble and optimizer
    states after 3 steps more."""
    every = slice(None)
    ens, opt = worker.opt_run(every)
    worker.opt_steps(ens, opt, every, 0, 2)
    fe.distributed.save(path / "one-ens", ens)
    fe.distributed.save(path / "one-opt", opt)
    fe.save(path / "one-opt.fe", opt)
    after_two = {"state": {k: clone(v) for k, v in opt.state_dict()["state"].items()}}
    worker.opt_steps(ens, opt, every, 2, 3)
    return after_two, ens.state_dict(), opt.state_dict()


def resume_on(path: Path, rank: int, world: int) -> tuple[slice, Any, Any, dict[str, Any]]:
    """Rank ``rank`` of ``world`` loads ``path/*-ens`` and ``path/*-opt`` (``path`` names
    the pair) into fresh members of its own and steps 3 times."""
    shard = fake_shard(worker.OPT_MEMBERS, rank, world)
    rows = shard.members
    ens, opt = worker.opt_run(rows, seed=1)
    fe.distributed.load(f"{path}-ens", ens, shard)
    assert fe.distributed.load(f"{path}-opt", opt, shard) is opt
    loaded = {"state": {k: clone(v) for k, v in opt.state_dict()["state"].items()}}
    worker.opt_steps(ens, opt, rows, 2, 3)
    return rows, ens, opt, loaded


@pytest.mark.parametrize("world", [1, 2, 3])
def test_per_member_hyperparameters_load_on_any_rank_and_step_as_one_process(
    tmp_path: Path, world: int
) -> None:
    """adam(lr=LR[rows], weight_decay=WD[rows]) saved in one process was refused on 2
    ranks (its record held every member's values, each rank's its own); now the record
    leaves them out and each rank compares its members' values, then steps as the one
    process does, bit for bit."""
    after_two, ens_ref, opt_ref = one_process_run(tmp_path)
    for rank in range(world):
        rows, ens, opt, loaded = resume_on(tmp_path / "one", rank, world)
        assert_trees_equal(rows_of(loaded, slice(None)), rows_of(after_two, rows))
        assert_trees_equal(opt.state_dict()["state"], rows_of(opt_ref, rows))
        assert_trees_equal(ens.state_dict(), {k: v[rows] for k, v in ens_ref.items()})
        assert opt.state_dict()["transform"] == worker.opt_run(rows)[1].state_dict()["transform"]


def test_a_per_member_hyperparameter_that_differs_is_refused_as_fe_load_refuses(
    tmp_path: Path,
) -> None:
    """fe.load refuses an optimizer whose per-member lr differs from the saved one's;
    so does fe.distributed.load, naming the hyperparameter and the member, on the rank
    that holds it, before anything changes. A rank without that member loads (it
    steps as saved); another transform is refused by its record."""
    one_process_run(tmp_path)
    lr = worker.LR.clone()
    lr[4] = 7e-3
    _, other = worker.opt_run(slice(None), lr)
    with pytest.raises(ValueError, match=r"^load: the state was saved by an optimizer whose"):
        fe.load(tmp_path / "one-opt.fe", other)
    member = (
        r"whose per-member hyperparameter `adam\(lr=\.\.\.\)` differs from this one's at "
        r"member 4 \(expected the saved 0\.005 for member 4, got 0\.007\): torch\.optim's "
    )
    for shard in (None, fake_shard(5, 1, 2)):
        rows = slice(None) if shard is None else shard.members
        _, other = worker.opt_run(rows, lr)
        before = {k: clone(v) for k, v in other.state_dict()["state"].items()}
        with pytest.raises(
            ValueError, match=rf"^distributed.load: '.*one-opt' was saved by an optimizer {member}"
        ):
            fe.distributed.load(tmp_path / "one-opt", other, shard)
        assert_trees_equal(other.state_dict()["state"], before)
    _, other = worker.opt_run(slice(0, 3), lr)
    fe.distributed.load(tmp_path / "one-opt", other, fake_shard(5, 0, 2))
    ens = fe.Ensemble.from_factory(worker.opt_member, num_members=5)
    for transform in (
        fe.optim.adam(1e-3),
        fe.optim.adam(worker.LR.float(), weight_decay=worker.WD),
    ):
        with pytest.raises(
            ValueError, match=r"whose transform or hyperparameters differ from this one's,\n"
        ):
            fe.distributed.load(tmp_path / "one-opt", fe.optim.EnsembleOptimizer(ens, transform))


def test_optimizer_checkpoints_without_per_member_values_load_as_before(tmp_path: Path) -> None:
    """A transform without per-member values is recorded as before (the SHA-256 of its
    whole record, no other leaf); a checkpoint saved before per-member values were kept
    apart (the whole record, every member's values in it) loads in one process as
    before, and is refused for other values. A template of the state alone reads the
    state of either."""
    import hashlib

    import torch.distributed.checkpoint as dcp_module

    def sha(text: str) -> list[int]:
        digest = hashlib.sha256(text.encode()).digest()
        return [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8, 16, 24)]

    ens = fe.Ensemble.from_factory(worker.opt_member, num_members=5, seed=0)
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
    worker.opt_steps(ens, opt, slice(None), 0, 1)
    fe.distributed.save(tmp_path / "scalar", opt)
    keys = dcp_module.FileSystemReader(tmp_path / "scalar").read_metadata().state_dict_metadata
    assert not any(k.startswith("transform_per_member") for k in keys)
    template = {"state": opt.state_dict()["state"], "transform_sha256": [0] * 4}
    back = fe.distributed.load(tmp_path / "scalar", template)
    assert back["transform_sha256"] == sha(opt.state_dict()["transform"])

    every = slice(None)
    ens, opt = worker.opt_run(every)
    worker.opt_steps(ens, opt, every, 0, 1)
    old = {"state": opt.state_dict()["state"], "transform_sha256": sha(opt._described)}
    fe.distributed.save(tmp_path / "old", old)
    _, same = worker.opt_run(every)
    fe.distributed.load(tmp_path / "old", same)
    assert_trees_equal(same.state_dict(), opt.state_dict())
    _, other = worker.opt_run(every, worker.LR * 2)
    with pytest.raises(ValueError, match=r"whose transform or hyperparameters differ"):
        fe.distributed.load(tmp_path / "old", other)

    fe.distributed.save(tmp_path / "new", opt)
    keys = dcp_module.FileSystemReader(tmp_path / "new").read_metadata().state_dict_metadata
    assert {"transform_per_member.0", "transform_per_member.1"} <= set(keys)
    for path in ("old", "new"):
        template = {"state": worker.opt_run(every)[1].state_dict()["state"]}
        back = fe.distributed.load(tmp_path / path, template)
        assert_trees_equal(back["state"], opt.state_dict()["state"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_per_member_hyperparameters_on_two_ranks_resume_as_one_process(tmp_path: Path) -> None:
    """Saved on 2 ranks, every rank refused (the ranks' records differed, each holding
    its own members' values). Now a 2-rank checkpoint loads in one process and on 3
    ranks, a one-process checkpoint loads on 2 ranks, and each steps on as the one
    process does; a member's lr that differs on rank 1 is refused on both ranks."""
    after_two, ens_ref, opt_ref = one_process_run(tmp_path)
    outputs = run_two_ranks(str(tmp_path), "optimizer")
    member = (
        "MISMATCH distributed.load: '{}' was saved by an optimizer whose per-member "
        "hyperparameter `adam(lr=...)` differs from this one's at member 4 (expected the "
        "saved 0.005 for member 4, got 0.007) (found by rank 1 of 2): torch.optim's "
    ).format(tmp_path / "one-opt")
    for output in outputs:
        assert "resumed" in output and member in output, output
        assert "untouched=True" in output, output
    for world in (1, 3):
        for rank in range(world):
            rows, ens, opt, loaded = resume_on(tmp_path / "two", rank, world)
            assert_trees_equal(rows_of(loaded, slice(None)), rows_of(after_two, rows))
            assert_trees_equal(opt.state_dict()["state"], rows_of(opt_ref, rows))
            assert_trees_equal(ens.state_dict(), {k: v[rows] for k, v in ens_ref.items()})
    ens, opt = worker.opt_run(slice(None), seed=1)
    fe.distributed.load(tmp_path / "resumed-ens", ens)
    fe.distributed.load(tmp_path / "resumed-opt", opt)
    assert_trees_equal(opt.state_dict(), opt_ref)
    assert_trees_equal(ens.state_dict(), ens_ref)
