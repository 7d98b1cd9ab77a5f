"""fe.save / fe.load: round trips, the file format, atomic writes, bad files, determinism."""

import copy
import hashlib
import io
import json
import os
import pickle
import random
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import optree
import pytest
import safetensors
import safetensors.torch
import torch
from helpers import ZOO, IntBuffers, assert_trees_equal
from torch import Tensor, nn

import funcensemble as fe
import funcensemble._checkpoint.file as checkpoint_file
from funcensemble._checkpoint.atomic import TEMP_TAG
from funcensemble._checkpoint.checksum import tensor_digest
from funcensemble._checkpoint.safetensors_file import write_safetensors
from funcensemble._structure.architecture import Architecture


def snapshot(ens: fe.Ensemble) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in ens.state_dict().items()}


def header_of(path: Path) -> dict[str, Any]:
    with safetensors.safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["funcensemble"])


def rewrite(path: Path, mutate_header: Any = None, mutate_tensors: Any = None) -> None:
    """Rewrite a checkpoint with its header or tensors changed and its checksums redone.

    As a hand edit (or a bug in fe.save) would make it: the checksums hold, so what is
    tested is the check of the header's contents.
    """
    with safetensors.safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["funcensemble"])
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
    if mutate_tensors is not None:
        mutate_tensors(tensors)
        header["checksums"] = {k: tensor_digest(t) for k, t in tensors.items()}
    if mutate_header is not None:
        header = mutate_header(header)
    raw = header if isinstance(header, str) else json.dumps(header)
    with open(path, "wb") as f:
        write_safetensors(f, tensors, {"funcensemble": raw})


def make_ensemble(name: str, n: int = 3, seed: int = 0) -> fe.Ensemble:
    torch.manual_seed(seed)
    return fe.Ensemble(ZOO[name].members(n, train=False))


class MomentumState(NamedTuple):
    """A hand-written optimizer state: tensors, Python numbers, a flag and a None."""

    count: int
    velocity: dict[str, Tensor]
    lr: float
    nesterov: bool
    unused: None


def momentum_init(params: dict[str, Tensor], lr: float = 0.05) -> MomentumState:
    return MomentumState(0, {k: torch.zeros_like(v) for k, v in params.items()}, lr, False, None)


def momentum_step(
    params: dict[str, Tensor], grads: dict[str, Tensor], state: MomentumState
) -> tuple[dict[str, Tensor], MomentumState]:
    velocity = {k: 0.9 * state.velocity[k] + grads[k] for k in params}
    new = {k: (params[k] - state.lr * velocity[k]).detach() for k in params}
    return new, state._replace(count=state.count + 1, velocity=velocity)


def make_net() -> nn.Module:
    """A small CNN with BatchNorm (buffers that train) and dropout (randomness)."""
    return ZOO["cnn"].make(0.2)


def functional_tree(seed: int) -> dict[str, Any]:
    """``{"params", "buffers", "opt_state"}`` of a freshly built functional-face run."""
    torch.manual_seed(seed)
    _, params, buffers = fe.stack([make_net().double() for _ in range(3)])
    return {"params": params, "buffers": buffers, "opt_state": momentum_init(params)}


# --- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ZOO))
def test_ensemble_round_trip_in_place(tmp_path: Path, name: str) -> None:
    saved, fresh = make_ensemble(name, seed=0), make_ensemble(name, seed=1)
    live = fresh.stacked_params()
    fe.save(tmp_path / "ens.safetensors", saved)
    assert fe.load(tmp_path / "ens.safetensors", fresh) is fresh
    assert_trees_equal(snapshot(fresh), snapshot(saved))
    for key, p in fresh.stacked_params().items():  # loaded in place: same Parameters
        assert p is live[key] and p.is_leaf and p.requires_grad


def test_pytree_round_trip_returns_new_tree(tmp_path: Path) -> None:
    saved, template = functional_tree(0), functional_tree(1)
    saved["opt_state"] = saved["opt_state"]._replace(count=7, lr=0.25, nesterov=True)
    saved["note"] = "run 3"
    template["note"] = ""
    before = {k: v.clone() for k, v in template["params"].items()}
    fe.save(tmp_path / "tree.safetensors", saved)
    loaded = fe.load(tmp_path / "tree.safetensors", template)
    assert_trees_equal(loaded, saved)
    assert isinstance(loaded["opt_state"], MomentumState) and loaded["opt_state"].unused is None
    # The template is untouched, and shares no tensor with the result.
    assert_trees_equal(template["params"], before)
    assert template["opt_state"].count == 0 and template["note"] == ""
    assert all(loaded["params"][k] is not template["params"][k] for k in before)
    # requires_grad follows the template: stacked params are leaves that need grads.
    assert all(t.requires_grad and t.is_leaf for t in loaded["params"].values())
    assert not any(t.requires_grad for t in loaded["buffers"].values())


def test_load_takes_device_and_requires_grad_from_the_template(tmp_path: Path) -> None:
    fe.save(tmp_path / "t.safetensors", {"w": torch.arange(6.0).reshape(2, 3)})
    template = {"w": torch.zeros(2, 3, requires_grad=True)}
    loaded = fe.load(tmp_path / "t.safetensors", template)
    assert loaded["w"].requires_grad and loaded["w"].device == template["w"].device
    assert torch.equal(loaded["w"].detach(), torch.arange(6.0).reshape(2, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip(tmp_path: Path) -> None:
    saved = make_ensemble("cnn").cuda()
    fe.save(tmp_path / "ens.safetensors", saved)
    fresh = make_ensemble("cnn", seed=1).cuda()
    fe.load(tmp_path / "ens.safetensors", fresh)
    assert fresh.stacked[0].weight.is_cuda
    assert_trees_equal(snapshot(fresh), snapshot(saved))
    template = {"w": torch.zeros(3, device="cuda")}
    fe.save(tmp_path / "t.safetensors", {"w": torch.ones(3, device="cuda")})
    assert fe.load(tmp_path / "t.safetensors", template)["w"].is_cuda


def test_every_storable_dtype_round_trips_and_reads_with_safetensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tree = {
        str(dtype): {
            "scalar": (torch.randn((), generator=g) * 50).to(dtype),
            "empty": torch.zeros(0, 3, dtype=dtype),
            "matrix": (torch.randn(3, 5, generator=g) * 50).to(dtype),
        }
        for dtype in sorted(checkpoint_file.DTYPES, key=str)
    }
    fe.save(tmp_path / "t.safetensors", tree)
    template = optree_zeros(tree)
    assert_trees_equal(fe.load(tmp_path / "t.safetensors", template), tree)
    plain = safetensors.torch.load_file(str(tmp_path / "t.safetensors"))
    assert plain.keys() == {f"[{d!r}][{k!r}]" for d in tree for k in tree[d]}
    for d in tree:
        for k, t in tree[d].items():
            assert torch.equal(plain[f"[{d!r}][{k!r}]"], t)


def optree_zeros(tree: dict[str, dict[str, Tensor]]) -> dict[str, dict[str, Tensor]]:
    return {d: {k: torch.zeros_like(t) for k, t in inner.items()} for d, inner in tree.items()}


def test_shared_and_viewed_tensors_are_saved_once_per_leaf(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    tree = {"a": base, "same": base, "row": base[1], "t": base.T}
    fe.save(tmp_path / "t.safetensors", tree)
    loaded = fe.load(tmp_path / "t.safetensors", {k: torch.zeros_like(v) for k, v in tree.items()})
    assert_trees_equal(loaded, {k: v.contiguous() for k, v in tree.items()})


def test_plain_state_dict_with_tied_weights_round_trips(tmp_path: Path) -> None:
    module = ZOO["tied"].make()
    fe.save(tmp_path / "sd.safetensors", module.state_dict())
    loaded = fe.load(tmp_path / "sd.safetensors", ZOO["tied"].make().state_dict())
    assert_trees_equal(dict(loaded), dict(module.state_dict()))


# --- the file format -------------------------------------------------------------------


def test_file_is_plain_safetensors_keyed_by_pytree_paths(tmp_path: Path) -> None:
    ens = make_ensemble("int_buffers", n=4)
    fe.save(tmp_path / "ens.safetensors", ens)
    tensors = safetensors.torch.load_file(str(tmp_path / "ens.safetensors"))
    assert torch.equal(tensors["['params']['linear.weight']"], ens.stacked.linear.weight)
    assert torch.equal(tensors["['buffers']['perm']"], ens.stacked.perm)
    header = header_of(tmp_path / "ens.safetensors")
    assert header["format"] == "funcensemble.checkpoint" and header["version"] == 2
    assert header["checksums"] == {  # the SHA-256 of each tensor's bytes, as stored
        k: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for k, t in tensors.items()
    }
    data = (tmp_path / "ens.safetensors").read_bytes()
    length = int.from_bytes(data[:8], "little")
    with safetensors.safe_open(str(tmp_path / "ens.safetensors"), framework="pt") as f:
        signature = f.metadata()["funcensemble.sha256"]  # the header's, with itself zeroed
    assert hashlib.sha256(
        data[: 8 + length].replace(signature.encode(), b"0" * 64)
    ).hexdigest() == (signature)
    assert header["kind"] == "ensemble" and header["num_members"] == 4
    member = ZOO["int_buffers"].members(1, train=False)[0]
    assert header["architecture"] == {
        "class": f"{IntBuffers.__module__}.IntBuffers",
        "fingerprint": Architecture.of(member).fingerprint(),
    }

    state = momentum_init({"w": torch.ones(2, 3)})._replace(count=5)
    fe.save(tmp_path / "tree.safetensors", {"opt": state})
    header = header_of(tmp_path / "tree.safetensors")
    assert header["kind"] == "pytree" and header["num_members"] is None
    assert header["values"] == {"['opt'].count": 5, "['opt'].lr": 0.05, "['opt'].nesterov": False}
    assert "MomentumState" in header["treedef"]
    assert list(safetensors.torch.load_file(str(tmp_path / "tree.safetensors"))) == [
        "['opt'].velocity['w']"
    ]


def test_fingerprints_depend_on_architecture_not_values(tmp_path: Path) -> None:
    def fingerprints(obj: Any) -> tuple[Any, str]:
        fe.save(tmp_path / "f.safetensors", obj)
        header = header_of(tmp_path / "f.safetensors")
        return header["architecture"], header["structure"]

    arch_a, struct_a = fingerprints(make_ensemble("mlp", seed=0))
    assert fingerprints(make_ensemble("mlp", seed=1)) == (arch_a, struct_a)
    assert fingerprints(make_ensemble("mlp", n=5))[0] == arch_a  # the count is stored apart
    assert fingerprints(make_ensemble("tied"))[0] != arch_a
    wider = fe.Ensemble(
        [nn.Sequential(nn.Linear(5, 17), nn.Tanh(), nn.Linear(17, 3)) for _ in range(3)]
    )
    assert fingerprints(wider)[0]["fingerprint"] != arch_a["fingerprint"]

    _, tree_a = fingerprints(functional_tree(0))
    assert fingerprints(functional_tree(1))[1] == tree_a
    changed = functional_tree(0)
    changed["opt_state"] = changed["opt_state"]._replace(count=3)  # a value, not structure
    assert fingerprints(changed)[1] == tree_a
    changed["params"]["0.weight"] = changed["params"]["0.weight"].float()
    assert fingerprints(changed)[1] != tree_a


# --- atomic writes ---------------------------------------------------------------------


def old_checkpoint(tmp_path: Path) -> tuple[Path, fe.Ensemble]:
    old = make_ensemble("mlp", seed=0)
    fe.save(tmp_path / "ens.safetensors", old)
    return tmp_path / "ens.safetensors", old


def assert_old_checkpoint_intact(path: Path, old: fe.Ensemble) -> None:
    assert os.listdir(path.parent) == [path.name], "a temporary file was left behind"
    fresh = make_ensemble("mlp", seed=5)
    fe.load(path, fresh)
    assert_trees_equal(snapshot(fresh), snapshot(old))


def test_crash_while_writing_keeps_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    path, old = old_checkpoint(tmp_path)

    def torn_write(f: Any, tensors: dict, metadata: dict) -> None:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{half a head")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_file, "write_safetensors", torn_write)
    with pytest.raises(OSError, match="No space left"):
        fe.save(path, make_ensemble("mlp", seed=1))
    assert_old_checkpoint_intact(path, old)


@pytest.mark.parametrize("fail_in", ["fsync", "replace"])
def test_failure_after_writing_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch, fail_in: str
) -> None:
    path, old = old_checkpoint(tmp_path)

    def fail(*args: Any) -> None:
        raise KeyboardInterrupt  # even an interrupt cleans up

    monkeypatch.setattr(os, fail_in, fail)
    with pytest.raises(KeyboardInterrupt):
        fe.save(path, make_ensemble("mlp", seed=1))
    monkeypatch.undo()
    assert_old_checkpoint_intact(path, old)


class Exploding(Tensor):
    """A tensor that fails as soon as the saver reads it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is Tensor.detach:
            raise RuntimeError("cannot read this tensor")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_leaf_that_raises_keeps_previous_checkpoint(tmp_path: Path) -> None:
    path, old = old_checkpoint(tmp_path)
    bad = {"ok": torch.ones(2), "bad": torch.ones(2).as_subclass(Exploding)}
    with pytest.raises(RuntimeError, match="cannot read"):
        fe.save(path, bad)
    assert_old_checkpoint_intact(path, old)


def test_save_flushes_file_and_directory(tmp_path: Path, monkeypatch) -> None:
    synced: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    fe.save(tmp_path / "ens.safetensors", make_ensemble("mlp"))
    assert synced == [False, True]  # the data, then the rename


@pytest.mark.skipif(os.name == "nt", reason="POSIX permission bits")
def test_replacing_keeps_the_file_mode(tmp_path: Path) -> None:
    path = tmp_path / "ens.safetensors"
    fe.save(path, make_ensemble("mlp"))
    os.chmod(path, 0o640)
    fe.save(path, make_ensemble("mlp", seed=1))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


def test_save_path_errors(tmp_path: Path) -> None:
    ens = make_ensemble("mlp")
    with pytest.raises(FileNotFoundError, match=r"save: the directory .*missing.* does not exist"):
        fe.save(tmp_path / "missing" / "ens.safetensors", ens)
    with pytest.raises(IsADirectoryError, match=r"save: .* is a directory"):
        fe.save(tmp_path, ens)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("obj", "error", "match"),
    [
        (
            nn.Linear(2, 2),
            TypeError,
            r"got a Linear, an ordinary module \(expected an fe.Ensemble .*got Linear\)\. "
            r".*state_dict",
        ),
        (
            object(),
            TypeError,
            r"save: got an object, which is neither an ensemble nor a pytree of tensors "
            r"\(expected an fe.Ensemble .*got object\)\. .*opt\.state_dict\(\)",
        ),
        ({"a": torch.ones(2), "b": object()}, TypeError, r"leaf `\['b'\]` is an object"),
        (
            {"n": np.float64(0.5)},
            TypeError,
            r"leaf `\['n'\]` is a float64 \(expected a Tensor .*, got float64\)",
        ),
        ({"z": torch.ones(2, dtype=torch.complex64)}, TypeError, "complex64, which funcensemble"),
        ({"z": torch.empty(2, dtype=torch.uint32)}, TypeError, r"uint32, .*\.to\(torch\.int64\)"),
        ({"s": torch.eye(2).to_sparse()}, TypeError, "sparse_coo tensor; only dense"),
        ({"m": torch.empty(2, device="meta")}, ValueError, "meta device"),
    ],
)
def test_save_rejects_what_it_cannot_store(
    tmp_path: Path, obj: Any, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        fe.save(tmp_path / "x.safetensors", obj)
    assert os.listdir(tmp_path) == []


def test_an_ensemble_optimizer_saves_and_loads_in_place(tmp_path: Path) -> None:
    """``fe.save(path, opt)`` writes ``opt.state_dict()``; ``fe.load(path, opt)`` loads
    it in place (either file loads either way); torch.optim optimizers: see
    test_a_torch_optim_optimizer_saves_and_resumes_into_a_fresh_one."""
    ens = make_ensemble("mlp")
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=1e-2))
    ens(torch.randn(7, 5, dtype=torch.float64)).pow(2).mean(dim=(1, 2)).sum().backward()
    opt.step()
    fe.save(tmp_path / "opt.safetensors", opt)
    fe.save(tmp_path / "sd.safetensors", opt.state_dict())
    for name in ("opt", "sd"):
        fresh = fe.optim.EnsembleOptimizer(make_ensemble("mlp", seed=1), fe.optim.adam(1e-2))
        assert fe.load(tmp_path / f"{name}.safetensors", fresh) is fresh
        assert_trees_equal(fresh.state, opt.state)
        template = fe.optim.EnsembleOptimizer(make_ensemble("mlp", seed=1), fe.optim.adam(1e-2))
        loaded = fe.load(tmp_path / f"{name}.safetensors", template.state_dict())
        assert_trees_equal(loaded, opt.state_dict())


def _train(ens: fe.Ensemble, opt: Any, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(6, 5, generator=g, dtype=torch.float64)
        opt.zero_grad()
        ens(x).pow(2).mean(dim=(1, 2)).sum().backward()
        opt.step()


def test_an_optimizer_grown_by_concat_resumes_exactly(tmp_path: Path) -> None:
    """After concat the step counts are one per member ([N]); a fresh optimizer's are
    shared (0-dim): fe.load(path, opt) takes either, and training goes on exactly as
    without the checkpoint (a state_dict() template cannot hold the other layout)."""

    def grown(seed: int) -> tuple[fe.Ensemble, Any]:
        ens = make_ensemble("mlp", n=2)
        opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
        _train(ens, opt, range(3))
        ens = ens.concat(ZOO["mlp"].members(1, train=False))
        return ens, opt.concat(ens)

    straight, opt_straight = grown(0)
    _train(straight, opt_straight, range(3, 8))
    ens, opt = grown(0)
    _train(ens, opt, range(3, 5))
    assert opt.state[0].count["0.weight"].shape == (3,)
    fe.save(tmp_path / "ens.safetensors", ens)
    fe.save(tmp_path / "opt.safetensors", opt)
    fresh = make_ensemble("mlp")
    with torch.no_grad():  # other values, that loading must replace
        for p in fresh.parameters():
            p.add_(1.0)
    fresh_opt = fe.optim.EnsembleOptimizer(fresh, fe.optim.adam(1e-2))
    with pytest.raises(ValueError, match=r"count.* is a float32 tensor of shape \(3,\) in the "):
        fe.load(tmp_path / "opt.safetensors", fresh_opt.state_dict())
    fe.load(tmp_path / "ens.safetensors", fresh)
    fe.load(tmp_path / "opt.safetensors", fresh_opt)
    assert_trees_equal(fresh_opt.state, opt.state)
    _train(fresh, fresh_opt, range(5, 8))
    assert_trees_equal(snapshot(fresh), snapshot(straight))
    assert_trees_equal(fresh_opt.state, opt_straight.state)

    # And the other way: shared counts load into an optimizer whose counts are per member.
    shared = fe.optim.EnsembleOptimizer(make_ensemble("mlp", seed=2), fe.optim.adam(1e-2))
    fe.save(tmp_path / "shared.safetensors", shared)
    fe.load(tmp_path / "shared.safetensors", opt)
    for key, value in opt.state_dict()["state"].items():  # a shared count, per member
        saved = shared.state_dict()["state"][key]
        assert value is saved is None or torch.equal(value, saved.expand_as(value)), key


def test_a_functional_state_grown_by_concat_loads_into_a_fresh_template(tmp_path: Path) -> None:
    _, params, _ = fe.stack(ZOO["mlp"].members(2, train=False))
    tx = fe.optim.adam(1e-2)
    state = tx.init(params)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    state = tx.update_(grads, state, params)
    _, more, _ = fe.stack(ZOO["mlp"].members(1, train=False))
    params = fe.concat([params, more])
    state = fe.optim.concat(tx, state, params)
    fe.save(tmp_path / "run.safetensors", {"params": params, "opt": state})
    template = {"params": params, "opt": tx.init(params)}
    loaded = fe.load(tmp_path / "run.safetensors", template)
    assert_trees_equal(loaded, {"params": params, "opt": state})
    assert loaded["opt"][0].count["0.weight"].tolist() == [1.0, 1.0, 0.0]
    # A count for another number of members is refused, naming it.
    four = fe.optim.concat(tx, state, fe.concat([params, more]))
    fe.save(tmp_path / "four.safetensors", {"opt": four})
    with pytest.raises(
        ValueError, match=r"count\['0\.bias'\]` is a float32 tensor of shape \(4,\)"
    ):
        fe.load(tmp_path / "four.safetensors", {"opt": tx.init(params)})


# --- loading bad files changes nothing ----------------------------------------------------


UNREADABLE = "is not a readable safetensors file .* empty, truncated or corrupted"
INVALID = "is not a valid funcensemble checkpoint"
CORRUPT = "is corrupt: "
SHORT = CORRUPT + "it is .* bytes long, too short"
PAST_END = CORRUPT + "its first 8 bytes give a header of .* bytes; the file has"
NESTED = "[" * 100_000 + "]" * 100_000
BAD_FILES: dict[str, tuple[Any, str]] = {
    # case: (the file's new bytes from its old ones, or a header mutation; the message)
    "empty": (lambda data: b"", SHORT),
    "garbage": (lambda data: b"PK\x03\x04 a zip file, not a checkpoint" * 4, PAST_END),
    "huge header length": (lambda data: (2**40).to_bytes(8, "little") + b"{}", PAST_END),
    "cut to 4 bytes": (lambda data: data[:4], SHORT),
    "cut to 8 bytes": (lambda data: data[:8], PAST_END),
    "cut in the header": (lambda data: data[:40], PAST_END),
    "cut in half": (lambda data: data[: len(data) // 2], UNREADABLE),
    "last byte missing": (lambda data: data[:-1], UNREADABLE),
    "header byte changed": (
        lambda data: data[:30] + bytes([data[30] ^ 1]) + data[31:],
        CORRUPT + r"its header \(bytes 0 to .*\) does not match its SHA-256 checksum",
    ),
    "data byte changed": (
        lambda data: data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:],
        CORRUPT + r"the bytes of tensor `\[.*\]` do not match their SHA-256 checksum",
    ),
    "header checksum removed": (
        lambda data: data.replace(b"funcensemble.sha256", b"funcensemble.sha257"),
        CORRUPT + "its header has no checksum entry, though its format version 2 writes one",
    ),
    "header checksum not hex": (
        lambda data: data.replace(b'sha256":"', b'sha256":"x'),
        CORRUPT + "its header checksum entry is damaged",
    ),
    "tensor checksums missing": (
        {"header": lambda h: {k: v for k, v in h.items() if k != "checksums"}},
        CORRUPT + "its header does not hold one checksum per tensor",
    ),
    "tensor checksum not hex": (
        {"header": lambda h: {**h, "checksums": dict.fromkeys(h["checksums"], "x")}},
        CORRUPT + "its checksum of tensor `.*` is 'x', not a SHA-256",
    ),
    "header not JSON": ({"header": lambda h: "{not json"}, INVALID + ".*not valid JSON"),
    "header nested": (
        {"header": lambda h: NESTED},
        INVALID + ".*nests lists or objects too deeply",
    ),
    "value nested": (
        {"header": lambda h: json.dumps({**h, "values": {"x": 1}})[:-1] + f', "v": {NESTED}}}'},
        INVALID + ".*nests lists or objects too deeply",
    ),
    "other format": ({"header": lambda h: {**h, "format": "x"}}, INVALID + ".*format"),
    "newer version": ({"header": lambda h: {**h, "version": 3}}, "newer funcensemble.*Upgrade"),
    "bad kind": ({"header": lambda h: {**h, "kind": "model"}}, INVALID + ".*kind is 'model'"),
    "missing field": ({"header": lambda h: {**h, "values": None}}, INVALID + ".*'values'"),
    "bad value": ({"header": lambda h: {**h, "values": {"x": [1]}}}, INVALID + ".*for `x`"),
    "header lies": ({"header": lambda h: {**h, "structure": "0" * 16}}, "does not describe"),
}


def corrupt(path: Path, case: str) -> str:
    """Damage the checkpoint at ``path`` as ``case`` says; return the expected message."""
    change, match = BAD_FILES[case]
    if isinstance(change, dict):
        rewrite(path, mutate_header=change["header"])
    else:
        path.write_bytes(change(path.read_bytes()))
    return match


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_raises_and_leaves_the_ensemble_unchanged(tmp_path: Path, case: str) -> None:
    path = tmp_path / "ens.safetensors"
    fe.save(path, make_ensemble("cnn", seed=0))
    match = corrupt(path, case)
    target = make_ensemble("cnn", seed=1)
    before = snapshot(target)
    with pytest.raises(ValueError, match=f"load: (checkpoint )?'.*ens.safetensors' .*{match}"):
        fe.load(path, target)
    assert_trees_equal(snapshot(target), before)


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_raises_for_a_template(tmp_path: Path, case: str) -> None:
    path = tmp_path / "tree.safetensors"
    fe.save(path, functional_tree(0))
    match = corrupt(path, case)
    with pytest.raises(ValueError, match=f"load: (checkpoint )?'.*tree.safetensors' .*{match}"):
        fe.load(path, functional_tree(1))


def test_plain_safetensors_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    safetensors.torch.save_file({"weight": torch.ones(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match=r"no funcensemble header .*load_file"):
        fe.load(tmp_path / "plain.safetensors", {"weight": torch.zeros(2)})


def test_header_that_does_not_match_its_tensors(tmp_path: Path) -> None:
    path = tmp_path / "ens.safetensors"
    fe.save(path, make_ensemble("mlp"))
    rewrite(path, mutate_tensors=lambda ts: ts.update({"['params']['0.bias']": torch.ones(3, 2)}))
    target = make_ensemble("mlp", seed=1)
    before = snapshot(target)
    with pytest.raises(ValueError, match="header does not describe the tensors it holds"):
        fe.load(path, target)
    assert_trees_equal(snapshot(target), before)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"load: no checkpoint file at '.*nope'"):
        fe.load(tmp_path / "nope", make_ensemble("mlp"))


class Scaled(nn.Linear):
    """A different class with exactly Linear's parameters."""


@pytest.mark.parametrize(
    ("make_target", "match"),
    [
        (lambda: make_ensemble("mlp", n=4), "holds an ensemble of 3 members; this ensemble has 4"),
        (lambda: make_ensemble("tied"), "holds an ensemble of torch.nn.*Sequential; this "),
        (
            lambda: fe.Ensemble(
                [
                    nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 4)).double()
                    for _ in range(3)
                ]
            ),
            r"parameter `2.bias` is a float64 tensor of shape \(3, 3\) in the file; "
            r"this ensemble has a float64 tensor of shape \(3, 4\). .*different architecture",
        ),
        (
            lambda: make_ensemble("mlp").float(),
            r"parameter `0.bias` is a float64 .* in the file; this ensemble has a float32 "
            r".* Convert this ensemble to float64 before loading",
        ),
        (
            lambda: fe.Ensemble(
                [nn.Sequential(nn.Linear(5, 16), nn.Tanh()).double() for _ in range(3)]
            ),
            "the file has extra parameter `2.bias`, parameter `2.weight`",
        ),
        (lambda: {"a": torch.ones(1)}, "holds an fe.Ensemble of 3 members of .*; got a dict"),
    ],
)
def test_mismatched_ensemble_raises_and_changes_nothing(
    tmp_path: Path, make_target: Any, match: str
) -> None:
    fe.save(tmp_path / "ens.safetensors", make_ensemble("mlp"))
    target = make_target()
    before = snapshot(target) if isinstance(target, fe.Ensemble) else None
    with pytest.raises(ValueError, match=f"load: '.*ens.safetensors' .*{match}"):
        fe.load(tmp_path / "ens.safetensors", target)
    if before is not None:
        assert_trees_equal(snapshot(target), before)


def test_same_tensors_other_class_raises(tmp_path: Path) -> None:
    fe.save(tmp_path / "ens.safetensors", fe.Ensemble([nn.Linear(3, 2) for _ in range(2)]))
    target = fe.Ensemble([Scaled(3, 2) for _ in range(2)])
    with pytest.raises(ValueError, match=r"holds an ensemble of torch.nn.modules.linear.Linear; "):
        fe.load(tmp_path / "ens.safetensors", target)


class Linear(nn.Linear):
    """torch.nn.Linear's name in another module, as `__main__.Net` is to `train.Net`."""


def test_member_class_is_compared_by_name_not_module(tmp_path: Path) -> None:
    saved = fe.Ensemble([nn.Linear(3, 2) for _ in range(2)])
    fe.save(tmp_path / "ens.safetensors", saved)
    target = fe.Ensemble([Linear(3, 2) for _ in range(2)])
    fe.load(tmp_path / "ens.safetensors", target)
    assert torch.equal(target.stacked.weight, saved.stacked.weight)


def _without_leaf(tree: dict) -> dict:
    del tree["params"]["0.bias"]
    return tree


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (_without_leaf, r"the file has extra leaf `\['params'\]\['0.bias'\]`"),
        (
            lambda t: {**t, "extra": torch.ones(1)},
            r"the file is missing leaf `\['extra'\]`\. Build the template",
        ),
        (
            lambda t: {**t, "opt_state": t["opt_state"]._replace(unused=torch.ones(1))},
            r"is missing leaf `\['opt_state'\].unused`",
        ),
        (
            lambda t: {**t, "opt_state": t["opt_state"]._replace(count=0.0)},
            r"leaf `\['opt_state'\].count` is a Python int in the file; the template has a "
            r"Python float",
        ),
        (
            lambda t: {**t, "buffers": {k: v[:2] for k, v in t["buffers"].items()}},
            r"leaf `\['buffers'\]\['1.num_batches_tracked'\]` is an int64 tensor of shape "
            r"\(3,\) in the file; the template has an int64 tensor of shape \(2,\)",
        ),
        (
            lambda t: {**t, "params": {k: v.float() for k, v in t["params"].items()}},
            "the template has a float32 tensor .* Convert the template to float64",
        ),
        (lambda t: make_ensemble("cnn"), "holds a pytree checkpoint; got an fe.Ensemble"),
    ],
)
def test_mismatched_template_raises(tmp_path: Path, change: Any, match: str) -> None:
    fe.save(tmp_path / "tree.safetensors", functional_tree(0))
    template = change(functional_tree(1))
    before = snapshot(template) if isinstance(template, fe.Ensemble) else None
    with pytest.raises(ValueError, match=f"load: '.*tree.safetensors' .*{match}"):
        fe.load(tmp_path / "tree.safetensors", template)
    if before is not None:
        assert_trees_equal(snapshot(template), before)


def test_load_rejects_other_objects(tmp_path: Path) -> None:
    fe.save(tmp_path / "ens.safetensors", make_ensemble("mlp"))
    with pytest.raises(
        TypeError, match=r"load: got a Sequential, an ordinary module \(expected an fe.Ensemble"
    ):
        fe.load(tmp_path / "ens.safetensors", ZOO["mlp"].make())
    with pytest.raises(
        TypeError,
        match=r"load: got a complex, which is neither .*\(expected an fe\.Ensemble",
    ):
        fe.load(tmp_path / "ens.safetensors", 3j)


# --- determinism: 10 steps + save + load + 10 steps == 20 steps --------------------------


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 2, 6, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(4, 3, generator=g, dtype=torch.float64)


def _functional_steps(tree: dict[str, Any], steps: range, opt: Any = None) -> dict[str, Any]:
    """Train ZOO["cnn"] (BatchNorm, dropout) on the functional face, from ``tree``."""
    with torch.random.fork_rng(devices=[]):  # building it must not move the RNG
        fmodel = fe.stack([make_net().double()])[0]

    def loss_fn(p: dict, b: dict, x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.mse_loss(fmodel(p, b, x), y)

    params, buffers, state = tree["params"], tree["buffers"], tree["opt_state"]
    for step in steps:
        _, grads, buffers = fe.value_and_grad(loss_fn)(params, buffers, *_batch(step))
        if opt is None:
            params, state = momentum_step(params, grads, state)
        else:
            updates, state = opt.update(grads, state, params)
            params = fe.optim.apply_updates(params, updates)
    return {"params": params, "buffers": buffers, "opt_state": state}


def _checkpointed_equals_straight(tmp_path: Path, fresh: Any, steps: Any) -> None:
    torch.manual_seed(0)
    straight = steps(fresh(0), range(20))
    torch.manual_seed(0)
    half = steps(fresh(0), range(10))
    fe.save(tmp_path / "run.safetensors", {**half, "rng": torch.get_rng_state()})
    del half
    torch.manual_seed(1234)  # the resumed run must not depend on what the process did before
    template = {**fresh(1), "rng": torch.get_rng_state()}
    resumed = fe.load(tmp_path / "run.safetensors", template)
    torch.set_rng_state(resumed.pop("rng"))
    assert_trees_equal(steps(resumed, range(10, 20)), straight)


def test_functional_face_resumes_exactly(tmp_path: Path) -> None:
    _checkpointed_equals_straight(tmp_path, functional_tree, _functional_steps)


def _adam() -> Any:
    return fe.optim.adam(1e-2, weight_decay=0.01)


def _adam_tree(seed: int) -> dict[str, Any]:
    tree = functional_tree(seed)
    return {**tree, "opt_state": _adam().init(tree["params"])}


def test_functional_face_with_fe_optim_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("funcensemble.optim")
    opt = _adam()

    def steps(tree: dict, r: range) -> dict:
        return _functional_steps(tree, r, opt)

    _checkpointed_equals_straight(tmp_path, _adam_tree, steps)


def test_module_face_resumes_exactly(tmp_path: Path) -> None:
    """An Ensemble trained with EnsembleOptimizer; its state saved as a pytree beside it."""
    pytest.importorskip("funcensemble.optim")

    def build(seed: int) -> tuple[fe.Ensemble, Any]:
        ens = fe.Ensemble.from_factory(make_net, num_members=3, seed=seed)
        ens.double().train()
        return ens, fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))

    def train(ens: fe.Ensemble, opt: Any, steps: range) -> None:
        for step in steps:
            x, y = _batch(step)
            opt.zero_grad()
            ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
            opt.step()

    torch.manual_seed(0)
    straight, opt_straight = build(0)
    train(straight, opt_straight, range(20))

    torch.manual_seed(0)
    ens, opt = build(0)
    train(ens, opt, range(10))
    fe.save(tmp_path / "ens.safetensors", ens)
    fe.save(tmp_path / "opt.safetensors", {"opt": opt.state, "rng": torch.get_rng_state()})
    del ens, opt

    torch.manual_seed(1234)
    ens, opt = build(1)
    fe.load(tmp_path / "ens.safetensors", ens)
    loaded = fe.load(tmp_path / "opt.safetensors", {"opt": opt.state, "rng": torch.get_rng_state()})
    opt.state = loaded["opt"]
    torch.set_rng_state(loaded["rng"])
    train(ens, opt, range(10, 20))
    assert_trees_equal(snapshot(ens), snapshot(straight))
    assert_trees_equal(opt.state, opt_straight.state)


# --- checksums: every changed byte is found --------------------------------------------


def write_at(f: Any, pos: int, byte: int) -> None:
    f.seek(pos)
    f.write(bytes([byte]))


def flip_positions(data: bytes) -> list[int]:
    """Every 13th byte of the header and every 89th of the data, and both ends of the file."""
    end = 8 + int.from_bytes(data[:8], "little")
    positions = {*range(8), *range(8, end, 13), *range(end, len(data), 89)}
    positions |= {*range(end - 8, end + 8), *range(len(data) - 16, len(data))}
    return sorted(positions)


@pytest.mark.slow
def test_every_flipped_byte_is_refused(tmp_path: Path) -> None:
    """One bit flipped at a time, all over a real checkpoint: never a silent load."""
    saved = {**functional_tree(0), "lr": 0.001, "step": 7, "run": "a"}
    template = {**functional_tree(1), "lr": 0.0, "step": 0, "run": ""}
    fe.save(tmp_path / "good.safetensors", saved)
    data = (tmp_path / "good.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    path = tmp_path / "flipped.safetensors"
    path.write_bytes(data)
    refused = {"header": 0, "data": 0}
    silent = []
    with open(path, "r+b", buffering=0) as f:
        for i, pos in enumerate(flip_positions(data)):
            write_at(f, pos, data[pos] ^ (1 << (i % 8)))
            try:
                fe.load(path, template)
            except ValueError as e:
                assert "corrupt" in str(e), str(e)
                refused["header" if pos < header_end else "data"] += 1
            else:
                silent.append(pos)
            write_at(f, pos, data[pos])
    print(f"byte flips refused: {refused}; silent loads: {len(silent)}")
    assert silent == []
    assert refused["header"] > 250 and refused["data"] > 250
    assert_trees_equal(fe.load(tmp_path / "good.safetensors", template), saved)


def write_version_1(path: Path, obj: Any) -> None:
    """The file the previous release wrote for ``obj``: no checksums, format version 1."""
    fe.save(path, obj)
    with safetensors.safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["funcensemble"])
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
    del header["checksums"]
    header["version"] = 1
    safetensors.torch.save_file(tensors, str(path), metadata={"funcensemble": json.dumps(header)})


def test_version_1_file_loads_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "old.safetensors"
    saved = make_ensemble("cnn", seed=0)
    write_version_1(path, saved)
    fresh = make_ensemble("cnn", seed=1)
    with pytest.warns(UserWarning, match=r"load: '.*old.safetensors' was written before .*checks"):
        fe.load(path, fresh)
    assert_trees_equal(snapshot(fresh), snapshot(saved))
    # Refusals come before the warning: a mismatch is an error, with nothing loaded.
    five = make_ensemble("cnn", n=5)
    before = snapshot(five)
    with pytest.raises(ValueError, match="holds an ensemble of 3 members"):
        fe.load(path, five)
    assert_trees_equal(snapshot(five), before)
    fe.save(path, fresh)  # saving again adds the checksums
    assert header_of(path)["version"] == 2
    fe.load(path, make_ensemble("cnn", seed=2))


def test_load_refuses_meta_tensors(tmp_path: Path) -> None:
    fmodel, params, _ = fe.stack([nn.Linear(3, 2) for _ in range(2)])
    fe.save(tmp_path / "p.safetensors", params)
    with pytest.raises(ValueError, match=r"load: leaf `\['bias'\]` of the template is on the meta"):
        fe.load(tmp_path / "p.safetensors", dict(fmodel.skeleton.named_parameters()))
    with pytest.raises(ValueError, match=r"save: leaf `\['bias'\]` is on the meta .*fe.stack"):
        fe.save(tmp_path / "s.safetensors", dict(fmodel.skeleton.named_parameters()))


# --- temporary files: named, removed, and cleaned after a kill ----------------------------


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TEMP_TAG in p.name)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_stale_temporary_files_of_dead_writers_are_removed_on_the_next_save(
    tmp_path: Path,
) -> None:
    from funcensemble._checkpoint.atomic import _host

    fe.save(tmp_path / "ens.safetensors", make_ensemble("mlp"))
    host = _host()
    dead = f".ens.safetensors{TEMP_TAG}{host}-{dead_pid()}-0123456789ab"
    alive = f".ens.safetensors{TEMP_TAG}{host}-{os.getppid()}-0123456789ab"  # e.g. the shell
    reused = f".ens.safetensors{TEMP_TAG}{host}-{os.getppid()}-ba9876543210"
    other_host = f".ens.safetensors{TEMP_TAG}{host}.elsewhere-{dead_pid()}-0123456789ab"
    other_target = f".other.safetensors{TEMP_TAG}{host}-{dead_pid()}-0123456789ab"
    for name in (dead, alive, reused, other_host, other_target):
        (tmp_path / name).write_bytes(b"half a checkpoint")
    # Last written long before the live process with that pid started: pid reused.
    os.utime(tmp_path / reused, (0, 1e9))  # 2001
    fe.save(tmp_path / "ens.safetensors", make_ensemble("mlp", seed=1))
    if os.name == "nt":
        assert dead in temp_files(tmp_path)  # no cleaning without a safe process probe
    elif os.path.exists("/proc/stat"):
        assert temp_files(tmp_path) == sorted([alive, other_host, other_target])
    else:  # no process start times: a reused pid keeps its temporary file
        assert temp_files(tmp_path) == sorted([alive, reused, other_host, other_target])


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks the saving process")
def test_kill_during_save_never_loses_the_checkpoint(tmp_path: Path) -> None:
    """20 saves of a 20 MB checkpoint killed (SIGKILL) at random points.

    After each kill the checkpoint loads, verified by its checksums, and holds the last
    save that returned, or the one being renamed into place when the kill came. The
    temporary files left are the killed process's, and the next save removes them.
    """
    import kill_during_save as writer

    path = tmp_path / "run.safetensors"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.getcwd()])}
    values = writer.base()
    template = {"w": torch.zeros_like(values), "generation": -1}
    rng = random.Random(0)
    counts = {"previous checkpoint intact": 0, "new checkpoint complete": 0, "temp files left": 0}
    with subprocess.Popen(
        [sys.executable, writer.__file__, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as helper:
        assert helper.stdin is not None and helper.stdout is not None
        ready, seconds = helper.stdout.readline().split()
        assert ready == "ready"
        latest, killed_pids = 0, set()
        for trial in range(1, 21):
            helper.stdin.write(f"{trial} {rng.uniform(0.0, 3 * float(seconds))}\n")
            helper.stdin.flush()
            killed, pid, saves = helper.stdout.readline().split()
            assert killed == "killed"
            killed_pids.add(pid)
            # Verified by its checksums: the last save that returned, or the one that
            # was being written when the kill came, if it had been renamed into place.
            loaded = fe.load(path, template)
            returned = trial * 1000 + int(saves) if int(saves) else latest
            in_flight = trial * 1000 + int(saves) + 1
            assert loaded["generation"] in (returned, in_flight)
            assert torch.equal(loaded["w"], values + loaded["generation"])
            latest = loaded["generation"]
            counts[
                "new checkpoint complete" if latest == in_flight else "previous checkpoint intact"
            ] += 1
            temps = temp_files(tmp_path)
            writers = [name.split("-")[-2] for name in temps]
            assert len(set(writers)) == len(writers) and set(writers) <= killed_pids, temps
            if int(saves):  # its saves removed what earlier killed processes left
                assert set(writers) <= {pid}, temps
            counts["temp files left"] += pid in writers
        helper.stdin.close()
    fe.save(path, {"w": values, "generation": 0})  # removes the last kill's temporary file
    assert sorted(os.listdir(tmp_path)) == [path.name]
    print(f"kill-during-save: 20 trials, 0 checkpoints lost; {counts}")


def test_loaded_tensors_do_not_change_when_the_file_is_rewritten_in_place(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    saved = {"w": torch.arange(4096.0)}
    fe.save(path, saved)
    loaded = fe.load(path, {"w": torch.zeros(4096)})
    with open(path, "r+b") as f:  # in place (same file), as a copy tool or an editor would
        f.truncate(0)
        f.write(b"\xff" * 40_000)
    assert torch.equal(loaded["w"], saved["w"])


def test_a_file_holds_tensors_only_and_loads_where_only_module_settings_differ(tmp_path):
    """checkpoints.md: the file holds no activation or slope, so it loads into a model
    that differs only there (as load_state_dict does), with the saved values."""
    torch.manual_seed(0)
    for saved, other in ((nn.Tanh(), nn.ReLU()), (nn.LeakyReLU(0.1), nn.LeakyReLU(0.2))):
        source = fe.Ensemble([nn.Sequential(nn.Linear(4, 2), saved) for _ in range(3)])
        target = fe.Ensemble([nn.Sequential(nn.Linear(4, 2), other) for _ in range(3)])
        fe.save(tmp_path / "a.safetensors", source)
        assert fe.load(tmp_path / "a.safetensors", target) is target
        assert_trees_equal(dict(target.state_dict()), dict(source.state_dict()))
        assert type(target.stacked[1]) is type(other)  # its own module kept


def test_saving_an_optimizer_writes_the_file_of_its_state_dict(tmp_path):
    """checkpoints.md: fe.save(path, opt) is the same file as fe.save(path, opt.state_dict())."""
    ens = fe.Ensemble.from_factory(lambda: nn.Linear(4, 2), 4, seed=0)
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
    ens(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    fe.save(tmp_path / "opt.safetensors", opt)
    fe.save(tmp_path / "dict.safetensors", opt.state_dict())
    assert (tmp_path / "opt.safetensors").read_bytes() == (
        tmp_path / "dict.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
    ],
    ids=["Adam", "SGD", "AdamW"],
)
def test_a_torch_optim_optimizer_saves_and_resumes_into_a_fresh_one(tmp_path, make):
    """checkpoints.md: fe.save(path, opt) / fe.load(path, fresh_opt) for torch.optim.
    A fresh optimizer has no state, so its state_dict() could not be the template (the
    load was refused, with advice that could not be followed)."""
    torch.manual_seed(0)
    ens = fe.Ensemble(
        [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(3)]
    )
    opt = make(ens.parameters())
    xs = [torch.randn(5, 3) for _ in range(5)]

    def step(e, o, x):
        o.zero_grad()
        e(x).square().sum().backward()
        o.step()

    for x in xs[:3]:
        step(ens, opt, x)
    fe.save(tmp_path / "ens.st", ens)
    fe.save(tmp_path / "opt.st", opt)
    again = fe.Ensemble(
        [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(3)]
    )
    fe.load(tmp_path / "ens.st", again)
    fresh = make(again.parameters())
    assert fe.load(tmp_path / "opt.st", fresh) is fresh
    for x in xs[3:]:
        step(ens, opt, x)
        step(again, fresh, x)
    for a, b in zip(ens.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
    # Another model's or another optimizer's state is refused, and nothing changes.
    other = fe.Ensemble(
        [nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)) for _ in range(3)]
    )
    untouched = make(other.parameters())
    with pytest.raises(ValueError, match=r"holds `\w+` of parameter 0 with shape \(3, 4, 3\)"):
        fe.load(tmp_path / "opt.st", untouched)
    assert untouched.state_dict()["state"] == {}
    kind = torch.optim.RMSprop(again.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not match this RMSprop optimizer"):
        fe.load(tmp_path / "opt.st", kind)
    assert kind.state_dict()["state"] == {}


# torch 2.8's LBFGS runs float(closure()) on a loss that requires grad, and warns.
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True:UserWarning")
@pytest.mark.parametrize("kind", ["Adafactor", "LBFGS"])
def test_an_optimizer_whose_state_is_not_shaped_like_its_parameters_round_trips(tmp_path, kind):
    """Adafactor's row/column statistics and LBFGS's flat history are not shaped like
    the parameters: the shape check that guards elementwise optimizers refused them."""
    if not hasattr(torch.optim, kind):
        pytest.skip(f"torch.optim.{kind} is not in this torch")
    torch.manual_seed(0)
    ens = fe.Ensemble([nn.Linear(4, 6) for _ in range(2)])
    make = getattr(torch.optim, kind)
    opt = make(ens.parameters(), lr=0.1)
    x = torch.randn(5, 4)

    def closure():
        opt.zero_grad()
        loss = ens(x).square().sum()
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    fe.save(tmp_path / "opt.st", opt)
    fresh = make(ens.parameters(), lr=0.1)
    if kind == "LBFGS":  # its history (lists holding None) cannot be rebuilt for a fresh one
        with pytest.raises(ValueError, match=r"holds optimizer state whose entries without"):
            fe.load(tmp_path / "opt.st", fresh)
        assert fresh.state_dict()["state"] == {}
        fresh = opt  # the optimizer itself, stepped, loads it
    fe.load(tmp_path / "opt.st", fresh)
    assert_trees_equal(fresh.state_dict()["state"], opt.state_dict()["state"])


@pytest.mark.parametrize("scheduler", ["StepLR", "OneCycleLR"])
def test_a_torch_optim_file_saved_with_a_scheduler_loads_before_the_scheduler_is_built(
    tmp_path, scheduler
):
    """torch's schedulers add entries to the groups (initial_lr; OneCycleLR also max_lr,
    min_lr and the momentum bounds), and torch's load_state_dict takes them into an
    optimizer built without a scheduler yet: fe.load refused them as extra leaves. Another
    optimizer's extra entries are still refused."""
    torch.manual_seed(0)
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(3)])
    opt = torch.optim.Adam(ens.parameters(), lr=0.1)
    if scheduler == "StepLR":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    else:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=10)
    x = torch.randn(5, 3)
    for _ in range(3):
        opt.zero_grad()
        ens(x).square().sum().backward()
        opt.step()
        sched.step()
    fe.save(tmp_path / "opt.st", opt)
    fresh = torch.optim.Adam(ens.parameters(), lr=0.1)
    expected = torch.optim.Adam(ens.parameters(), lr=0.1)
    expected.load_state_dict(opt.state_dict())
    assert fe.load(tmp_path / "opt.st", fresh) is fresh
    assert fresh.param_groups[0].keys() == expected.param_groups[0].keys()
    for key, value in expected.param_groups[0].items():
        if key != "params":
            assert fresh.param_groups[0][key] == value, key
    assert_trees_equal(fresh.state_dict()["state"], opt.state_dict()["state"])
    sgd = torch.optim.SGD(ens.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        sgd.zero_grad()
        ens(x).square().sum().backward()
        sgd.step()
    fe.save(tmp_path / "sgd.st", sgd)
    other = torch.optim.Adam(ens.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not match this Adam optimizer"):
        fe.load(tmp_path / "sgd.st", other)
    assert other.state_dict()["state"] == {}


def test_scheduler_entries_load_as_torch_loads_them_either_way(tmp_path):
    """SWALR's swa_lr was refused as an extra leaf; a file saved without a scheduler was
    refused by an optimizer that has one ("missing leaf initial_lr"). torch's
    load_state_dict takes the file's groups as they are in both cases."""
    torch.manual_seed(0)
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(3)])
    x = torch.randn(5, 3)

    def stepped(sched=None):
        opt = torch.optim.SGD(ens.parameters(), lr=0.1, momentum=0.9)
        scheduler = sched(opt) if sched else None
        for _ in range(2):
            opt.zero_grad()
            ens(x).square().sum().backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
        return opt

    swa = stepped(lambda o: torch.optim.swa_utils.SWALR(o, swa_lr=0.05, anneal_epochs=3))
    plain = stepped()
    for source, target in (
        (swa, torch.optim.SGD(ens.parameters(), lr=0.1, momentum=0.9)),
        (plain, torch.optim.SGD(ens.parameters(), lr=0.1, momentum=0.9)),
    ):
        if source is plain:  # the target has a scheduler, the file none
            torch.optim.lr_scheduler.StepLR(target, step_size=2)
        expected = torch.optim.SGD(ens.parameters(), lr=0.1, momentum=0.9)
        if source is plain:
            torch.optim.lr_scheduler.StepLR(expected, step_size=2)
        expected.load_state_dict(source.state_dict())
        fe.save(tmp_path / "opt.st", source)
        fe.load(tmp_path / "opt.st", target)
        assert target.param_groups[0].keys() == expected.param_groups[0].keys()
        for key, value in expected.param_groups[0].items():
            if key != "params":
                assert target.param_groups[0][key] == value, key
        assert_trees_equal(target.state_dict()["state"], source.state_dict()["state"])


@pytest.mark.parametrize(
    ("saved", "into"),
    [
        pytest.param(dict(lr=1), dict(lr=0.1), id="int-lr-into-float"),
        pytest.param(dict(lr=0.1), dict(lr=0.1, momentum=0.9), id="momentum-0-into-0.9"),
        pytest.param(dict(lr=0.1, foreach=None), dict(lr=0.1, foreach=False), id="None-into-False"),
        pytest.param(dict(lr=0.1, foreach=False), dict(lr=0.1), id="False-into-None"),
        pytest.param(dict(lr=0.5), dict(lr=0.1, nesterov=False), id="other-lr"),
    ],
)
def test_a_torch_optim_file_loads_with_its_own_hyperparameters_as_torch_does(tmp_path, saved, into):
    """fe.load compared the groups' values by Python type: SGD(lr=1) refused into
    SGD(lr=0.1), default momentum=0 into momentum=0.9, foreach=None into False, all of
    which torch's load_state_dict takes, putting the file's values in place. The
    checkpoints.md claim: the saved hyperparameters replace the optimizer's."""
    torch.manual_seed(0)
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(3)])
    opt = torch.optim.SGD(ens.parameters(), **saved)
    ens(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    fe.save(tmp_path / "opt.st", opt)
    ours = torch.optim.SGD(ens.parameters(), **into)
    torchs = torch.optim.SGD(ens.parameters(), **into)
    fe.load(tmp_path / "opt.st", ours)
    torchs.load_state_dict(opt.state_dict())
    assert ours.state_dict()["param_groups"] == torchs.state_dict()["param_groups"]
    assert ours.param_groups[0]["lr"] == saved["lr"]


def test_a_torch_optim_file_of_another_dtype_is_refused_by_a_fresh_optimizer_too(tmp_path):
    """A float32 Adam file loaded into a fresh Adam over float64 parameters (torch cast
    it), but was refused by one that had stepped: load's 'dtypes must match exactly'."""
    ens = fe.Ensemble([nn.Linear(3, 1) for _ in range(2)])
    opt = torch.optim.Adam(ens.parameters(), lr=1e-2)
    ens(torch.randn(4, 3)).sum().backward()
    opt.step()
    fe.save(tmp_path / "opt.st", opt)
    wide = fe.Ensemble([nn.Linear(3, 1).double() for _ in range(2)])
    fresh = torch.optim.Adam(wide.parameters(), lr=1e-2)
    with pytest.raises(
        ValueError,
        match=r"float32 tensor .* in the file; .* has a float64 .*"
        r"Build the optimizer over parameters of the saved dtype",
    ):
        fe.load(tmp_path / "opt.st", fresh)
    assert not fresh.state


def test_an_ensemble_optimizer_file_of_another_dtype_gives_advice_that_exists(tmp_path):
    """It advised .to(torch.float32) on the optimizer, which an EnsembleOptimizer has not."""
    ens = fe.Ensemble([nn.Linear(3, 1) for _ in range(2)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(lr=1e-2, momentum=0.9))
    ens(torch.randn(4, 3)).sum().backward()
    opt.step()
    fe.save(tmp_path / "opt.st", opt)
    wide = fe.Ensemble([nn.Linear(3, 1).double() for _ in range(2)])
    other = fe.optim.EnsembleOptimizer(wide, fe.optim.sgd(lr=1e-2, momentum=0.9))
    wide(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    other.step()
    before = [t.clone() for t in optree.tree_leaves(other.state)]
    with pytest.raises(ValueError, match=r"float32 tensor .* in the file") as raised:
        fe.load(tmp_path / "opt.st", other)
    assert ".to(torch.float32) before building the optimizer" in str(raised.value)
    assert "Convert this optimizer" not in str(raised.value)
    assert all(
        torch.equal(a, b) for a, b in zip(before, optree.tree_leaves(other.state), strict=True)
    )


def test_an_ensemble_optimizer_file_into_a_torch_optimizer_says_what_it_holds(tmp_path) -> None:
    """It blamed LBFGS's nested state and advised loading after one step, which failed
    too; nothing named the EnsembleOptimizer the file came from."""
    ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(3)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
    ens(torch.randn(4, 3)).sum().backward()
    opt.step()
    path = tmp_path / "opt.safetensors"
    fe.save(path, opt)
    plain = torch.optim.Adam(ens.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"holds an fe\.optim\.EnsembleOptimizer's state"):
        fe.load(path, plain)
    assert plain.state_dict()["state"] == {}
    fe.load(path, fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2)))  # the advice works


def test_an_ensembles_file_holds_and_restores_its_non_persistent_buffers(tmp_path):
    """checkpoints.md: unlike state_dict(), the file holds non-persistent buffers."""

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("cache", torch.zeros(2), persistent=False)

        def forward(self, x: Tensor) -> Tensor:
            return self.lin(x) + self.cache

    ens = fe.Ensemble([Cached() for _ in range(2)])
    ens.stacked_buffers()["cache"].fill_(1.0)
    assert not any("cache" in k for k in ens.state_dict())
    fe.save(tmp_path / "ens.st", ens)
    fresh = fe.Ensemble([Cached() for _ in range(2)])
    fe.load(tmp_path / "ens.st", fresh)
    assert torch.equal(fresh.stacked_buffers()["cache"], torch.ones(2, 2))


def test_an_ensemble_optimizer_does_not_pickle_and_deepcopies_with_its_ensemble():
    """checkpoints.md: torch.save(opt) fails; copy.deepcopy((ens, opt)) copies both."""
    torch.manual_seed(0)
    ens = fe.Ensemble([nn.Linear(3, 1) for _ in range(2)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=1e-2))
    x = torch.randn(4, 3)
    advice = r"EnsembleOptimizer cannot be pickled .* Save its state with fe\.save\(path, opt\)"
    with pytest.raises(TypeError, match=advice):
        torch.save(opt, io.BytesIO())
    with pytest.raises(TypeError, match=advice):
        pickle.dumps(opt)
    assert copy.copy(opt).state is opt.state
    ens_copy, opt_copy = copy.deepcopy((ens, opt))
    before = ens.stacked.weight.detach().clone()
    for e, o in ((ens, opt), (ens_copy, opt_copy)):
        o.zero_grad()
        e(x).pow(2).sum().backward()
        o.step()
    assert torch.equal(ens_copy.stacked.weight, ens.stacked.weight)
    assert not torch.equal(ens.stacked.weight, before)
    opt_copy.zero_grad()
    ens_copy(x).pow(2).sum().backward()
    opt_copy.step()  # steps the copy only
    assert not torch.equal(ens_copy.stacked.weight, ens.stacked.weight)


def test_a_per_member_hyperparameter_is_recorded_with_its_dtype(tmp_path):
    """checkpoints.md: a float32 tensor of the saved float64 learning rates is refused."""
    ens = fe.Ensemble([nn.Linear(3, 1) for _ in range(2)])
    lrs = torch.tensor([0.1, 0.2], dtype=torch.float64)
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(lr=lrs, momentum=0.9))
    ens(torch.randn(4, 3)).sum().backward()
    opt.step()
    fe.save(tmp_path / "opt.st", opt)
    narrow = fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(lr=lrs.float(), momentum=0.9))
    with pytest.raises(ValueError, match=r"(?s)float64\).*float32\)"):
        fe.load(tmp_path / "opt.st", narrow)
    same = fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(lr=lrs.clone(), momentum=0.9))
    fe.load(tmp_path / "opt.st", same)
    assert torch.equal(
        same.state[0].momentum_buffer["weight"], opt.state[0].momentum_buffer["weight"]
    )


class _Scaled(nn.Module):
    """A module keeping a calibrated scale as extra state (part of its state_dict)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.scale = 1.0

    def forward(self, x):
        return self.lin(x) * self.scale

    def get_extra_state(self):
        return {"scale": self.scale}

    def set_extra_state(self, state):
        self.scale = state["scale"]


def test_an_ensemble_with_extra_state_is_refused_by_save_and_load(tmp_path):
    """The file holds parameters and buffers only: fe.save dropped the scale with no
    word, and fe.load left the fresh ensemble's 1.0 where the saved one had 3.0."""
    members = [_Scaled() for _ in range(2)]
    for m in members:
        m.scale = 3.0
    ens = fe.Ensemble(members)
    path = tmp_path / "extra.safetensors"
    with pytest.raises(TypeError, match=r"^save: the root module \(_Scaled\) keeps extra state"):
        fe.save(path, ens)
    assert not path.exists()
    fe.save(path, fe.Ensemble([nn.Sequential(nn.Linear(3, 2)) for _ in range(2)]))
    fresh = fe.Ensemble([_Scaled() for _ in range(2)])
    before = {k: v.clone() for k, v in fresh.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(TypeError, match=r"^load: .* so loading would keep this ensemble's own"):
        fe.load(path, fresh)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in before.items())
    # What the message offers: torch.save of state_dict() carries it.
    torch.save(ens.state_dict(), tmp_path / "extra.pt")
    fresh.load_state_dict(torch.load(tmp_path / "extra.pt", weights_only=False))
    x = torch.randn(4, 3)
    assert fresh.stacked.scale == 3.0 and torch.equal(fresh(x), ens(x))


def test_a_torch_optimizers_file_into_an_ensemble_optimizer_is_refused_by_name(tmp_path):
    """It was refused with a list of every missing and extra leaf, ending by advising
    the very call that was made."""
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(2)])
    torch_opt = torch.optim.Adam(ens.parameters(), lr=0.01)
    ens(torch.randn(4, 3)).sum().backward()
    torch_opt.step()
    fe.save(tmp_path / "adam.safetensors", torch_opt)
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=0.01))
    state = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"holds a torch.optim optimizer's state \(expected an"):
        fe.load(tmp_path / "adam.safetensors", opt)
    assert_trees_equal(opt.state_dict(), state)


def _load_as_torch_does(path, ours, theirs, saved):
    """fe.load of ``saved``'s file into ``ours``, and torch's load_state_dict of its
    state_dict into ``theirs``, leave the two optimizers with equal states."""
    fe.load(path, ours)
    theirs.load_state_dict(saved.state_dict())
    assert_trees_equal(ours.state_dict(), theirs.state_dict())


@pytest.mark.parametrize("into_amsgrad", [False, True])
def test_a_torch_optim_file_replaces_the_state_of_an_optimizer_that_has_more(
    tmp_path, into_amsgrad
):
    """torch's load_state_dict puts the file's state in place of the optimizer's, whole:
    a file saved while one layer had no state yet (frozen, then thawed) loads into an
    optimizer that has stepped every layer, and that layer's state is dropped. fe.load
    refused it (the optimizer's own state was the template), as it refused a file with
    entries the optimizer lacked (amsgrad's max_exp_avg_sq, into one without)."""
    torch.manual_seed(0)

    ens = fe.Ensemble(
        [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(2)]
    )
    xs = [torch.randn(5, 3) for _ in range(4)]

    def step(o, x):
        o.zero_grad()
        ens(x).square().sum().backward()
        o.step()

    saved = torch.optim.Adam(ens.parameters(), lr=0.1, amsgrad=True)
    for name, p in ens.named_parameters():
        p.requires_grad_(not name.startswith("stacked.2."))
    step(saved, xs[0])
    for p in ens.parameters():
        p.requires_grad_(True)
    assert len(saved.state) == 2
    fe.save(tmp_path / "opt.st", saved)
    start = {k: v.clone() for k, v in ens.state_dict().items()}

    def stepped():
        ens.load_state_dict(start)
        o = torch.optim.Adam(ens.parameters(), lr=0.1, amsgrad=into_amsgrad)
        step(o, xs[1])
        ens.load_state_dict(start)
        return o

    ours, theirs = stepped(), stepped()
    assert len(ours.state) == 4
    _load_as_torch_does(tmp_path / "opt.st", ours, theirs, saved)
    results = []
    for o in (ours, theirs):
        ens.load_state_dict(start)
        for x in xs[2:]:
            step(o, x)
        results.append({k: v.clone() for k, v in ens.state_dict().items()})
    assert_trees_equal(results[0], results[1])


def test_an_lbfgs_file_with_empty_history_resumes_as_torch_loads_it(tmp_path):
    """LBFGS(max_iter=1) after one step holds empty history lists, which leave no leaf
    in the file: a template built from the file's leaves dropped them, the load passed
    and the next step died of a TypeError. They are kept, and the step matches torch's;
    a fresh LBFGS, which lacks them, is refused before anything changes."""
    torch.manual_seed(0)
    model, x = nn.Linear(3, 2), torch.randn(5, 3)

    def closure(o):
        def run():
            o.zero_grad()
            loss = model(x).square().sum()
            loss.backward()
            return loss

        return run

    def lbfgs():
        return torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=1)

    saved = lbfgs()
    saved.step(closure(saved))
    fe.save(tmp_path / "opt.st", saved)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ours, theirs = lbfgs(), lbfgs()
    for o in (ours, theirs):
        o.step(closure(o))
    _load_as_torch_does(tmp_path / "opt.st", ours, theirs, saved)
    after = []
    for o in (ours, theirs):
        model.load_state_dict(start)
        o.step(closure(o))
        after.append({k: v.clone() for k, v in model.state_dict().items()})
    assert_trees_equal(after[0], after[1])
    fresh = lbfgs()
    with pytest.raises(ValueError, match=r"holds optimizer state whose entries without tensors"):
        fe.load(tmp_path / "opt.st", fresh)
    assert not fresh.state


class _LegacyScaled(nn.Linear):
    """State kept the way before get_extra_state: its own _save_to_state_dict entry."""

    def __init__(self):
        super().__init__(2, 2)
        self.scale = 1.0

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "scale"] = torch.tensor(self.scale)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        self.scale = float(state_dict.pop(prefix + "scale"))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x):
        return super().forward(x) * self.scale


@pytest.mark.parametrize("how", ["file", "sharded"])
def test_state_dict_entries_beyond_parameters_and_buffers_are_refused(tmp_path, how):
    """A module adding its own state_dict entry (_save_to_state_dict, or a state-dict
    hook) was saved without it, or loaded into a throwaway tensor: a scale of 3.0 came
    back 1.0 with no error (outputs 3x off), where the loop's load_state_dict restores
    it."""
    members = [_LegacyScaled() for _ in range(2)]
    for m in members:
        m.scale = 3.0
    ens = fe.Ensemble(members)
    save, load = (fe.save, fe.load) if how == "file" else (fe.distributed.save, fe.distributed.load)
    where = "" if how == "file" else "distributed."
    path = tmp_path / "ckpt"
    with pytest.raises(TypeError, match=rf"^{where}save: state_dict\(\) holds `stacked.scale`"):
        save(path, ens)
    assert not path.exists() or not any(path.iterdir())
    save(tmp_path / "plain", fe.Ensemble([nn.Linear(2, 2) for _ in range(2)]))
    fresh = fe.Ensemble([_LegacyScaled() for _ in range(2)])
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(TypeError, match=rf"^{where}load: .* keep this ensemble's own"):
        load(tmp_path / "plain", fresh)
    assert_trees_equal(fresh.state_dict(), before)
