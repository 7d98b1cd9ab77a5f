"""fe.export_state_dicts / fe.import_state_dicts: plain per-member state_dicts, out and in."""

from typing import Any

import pytest
import torch
from helpers import ZOO, assert_trees_equal, runtime_typecheck_off
from torch import Tensor, nn

import funcensemble as fe


def snapshot(ens: fe.Ensemble) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in ens.state_dict().items()}


class WithNonPersistent(nn.Module):
    """A buffer left out of state_dict, as for a cached mask or positional table."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.register_buffer("cache", torch.randn(4), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x + self.cache)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_export_loads_strictly_into_the_original_architecture(name: str) -> None:
    zoo = ZOO[name]
    members = zoo.members(3, train=False)
    ens = fe.Ensemble(members)
    state_dicts = fe.export_state_dicts(ens)
    assert len(state_dicts) == 3
    for original, state_dict in zip(members, state_dicts, strict=True):
        # The same keys, in the same order, as the original module writes.
        assert list(state_dict) == list(original.state_dict())
        assert_trees_equal(dict(state_dict), dict(original.state_dict()))
        plain = zoo.make().double().eval()
        plain.load_state_dict(state_dict, strict=True)
        assert_trees_equal(plain(zoo.input()), original(zoo.input()))


def test_tied_weights_are_exported_under_every_name() -> None:
    ens = fe.Ensemble(ZOO["tied"].members(2, train=False))
    state_dict = fe.export_state_dicts(ens)[1]
    assert {"emb.weight", "head.weight"} <= state_dict.keys()
    assert state_dict.keys() == ZOO["tied"].make().state_dict().keys()
    assert torch.equal(state_dict["head.weight"], ens.stacked.emb.weight[1])


def test_non_persistent_buffers_stay_out() -> None:
    ens = fe.Ensemble([WithNonPersistent() for _ in range(2)])
    state_dict = fe.export_state_dicts(ens)[0]
    assert set(state_dict) == {"linear.weight", "linear.bias"}
    fresh = fe.Ensemble([WithNonPersistent() for _ in range(2)])
    fe.import_state_dicts(fresh, fe.export_state_dicts(ens))
    assert torch.equal(fresh.stacked.linear.weight, ens.stacked.linear.weight)


def test_export_copies_and_detaches() -> None:
    ens = fe.Ensemble(ZOO["mlp"].members(2, train=False))
    before = snapshot(ens)
    state_dicts = fe.export_state_dicts(ens)
    for state_dict in state_dicts:
        for t in state_dict.values():
            assert not t.requires_grad
            t.add_(1.0)
    assert_trees_equal(snapshot(ens), before)


def test_functional_face_exports_the_same() -> None:
    members = ZOO["int_buffers"].members(3, train=True)
    fmodel, params, buffers = fe.stack(members)
    assert_trees_equal(
        [dict(sd) for sd in fe.export_state_dicts(fmodel, params, buffers)],
        [dict(sd) for sd in fe.export_state_dicts(fe.Ensemble(members))],
    )


@pytest.mark.parametrize("name", sorted(ZOO))
def test_import_round_trips(name: str) -> None:
    torch.manual_seed(0)
    source = fe.Ensemble(ZOO[name].members(3, train=False))
    torch.manual_seed(1)
    target = fe.Ensemble([ZOO[name].make().double().eval() for _ in range(3)])
    live = target.stacked_params()
    assert fe.import_state_dicts(target, fe.export_state_dicts(source)) is target
    assert_trees_equal(snapshot(target), snapshot(source))
    assert all(p is live[k] for k, p in target.stacked_params().items())  # in place


def test_import_from_separately_trained_modules() -> None:
    members = ZOO["cnn"].members(4, train=False)
    ens = fe.Ensemble.from_factory(lambda: ZOO["cnn"].make().double().eval(), num_members=4)
    fe.import_state_dicts(ens, [m.state_dict() for m in members])
    x = ZOO["cnn"].input()
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-10, atol=1e-12)


def test_import_accepts_tensors_on_another_device_and_order() -> None:
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(2)])
    state_dicts = [
        {"bias": torch.full((2,), float(i)), "weight": torch.ones(2, 3)} for i in range(2)
    ]
    fe.import_state_dicts(ens, tuple(state_dicts))
    assert torch.equal(ens.stacked.bias, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


def _good(n: int = 3) -> list[dict[str, Tensor]]:
    return [dict(m.state_dict()) for m in ZOO["tied"].members(n, train=False)]


def _change(i: int, fn: Any) -> list[dict[str, Any]]:
    state_dicts = _good()
    fn(state_dicts[i])
    return state_dicts


@pytest.mark.parametrize(
    ("state_dicts", "error", "match"),
    [
        (_good(2), ValueError, "got 2 state_dicts; the ensemble has 3 members"),
        (
            _change(2, lambda sd: sd.pop("head.weight")),
            ValueError,
            "member 2 is missing `head.weight` compared with the ensemble's architecture",
        ),
        (
            _change(1, lambda sd: sd.update(extra=torch.ones(1))),
            ValueError,
            "member 1 has extra `extra` compared",
        ),
        (
            _change(2, lambda sd: sd.update({"mix.bias": torch.zeros(5, dtype=torch.float64)})),
            ValueError,
            r"member 2 has `mix.bias` with shape \(5,\); the ensemble has \(4,\)",
        ),
        (
            _change(1, lambda sd: sd.update({"mix.bias": torch.zeros(4)})),
            ValueError,
            "member 1 has `mix.bias` with dtype torch.float32; the ensemble has torch.float64",
        ),
        (
            _change(2, lambda sd: sd.update({"head.weight": sd["head.weight"] + 1})),
            ValueError,
            "member 2 has different values under `emb.weight` and `head.weight`, which are one "
            "tied weight",
        ),
        (
            _change(2, lambda sd: sd.update({"mix.bias": [0.0] * 4})),
            TypeError,
            r"member 2 has `mix.bias` of type list \(expected a Tensor, got list\)",
        ),
        (_good()[0], TypeError, "expected a sequence .*got a dict. Wrap a single state_dict"),
        (
            [*_good(2), [1, 2]],
            TypeError,
            r"state_dicts\[2\] is a list, not a mapping \(expected a mapping .*got list\)",
        ),
    ],
)
def test_import_errors_change_nothing(state_dicts: Any, error: type, match: str) -> None:
    ens = fe.Ensemble(ZOO["tied"].members(3, train=False, dtype=torch.float64))
    torch.manual_seed(5)
    with torch.no_grad():
        for p in ens.parameters():
            p.normal_()
    before = snapshot(ens)
    with runtime_typecheck_off(), pytest.raises(error, match=f"import_state_dicts: {match}"):
        fe.import_state_dicts(ens, state_dicts)
    assert_trees_equal(snapshot(ens), before)


def test_export_argument_errors() -> None:
    fmodel, params, buffers = fe.stack([nn.Linear(3, 2) for _ in range(2)])
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(2)])
    with pytest.raises(TypeError, match="export_state_dicts: pass an Ensemble alone"):
        fe.export_state_dicts(ens, params, buffers)
    with pytest.raises(TypeError, match=r"needs its stacked params and buffers"):
        fe.export_state_dicts(fmodel)
    # Anything else is named (found by an audit: AttributeErrors, or advice about a
    # FunctionalModule for a plain module).
    sds = fe.export_state_dicts(fmodel, params, buffers)
    with runtime_typecheck_off():
        with pytest.raises(TypeError, match=r"export_state_dicts: expected .*got Linear"):
            fe.export_state_dicts(nn.Linear(3, 2))
        with pytest.raises(TypeError, match=r"import_state_dicts: expected .*got Func.*fe\.stack"):
            fe.import_state_dicts(fmodel, sds)
        with pytest.raises(TypeError, match=r"import_state_dicts: expected .*got Linear"):
            fe.import_state_dicts(nn.Linear(3, 2), sds)


@pytest.mark.parametrize("hetero", [False, True])
def test_import_refuses_views_of_the_ensembles_own_tensors(hetero: bool) -> None:
    # Found by an audit: per-member dicts sliced from ens.state_dict() (to reorder the
    # members) were read after earlier members had been written, so every member became
    # old member 2, with no error.
    torch.manual_seed(0)
    widths = [3, 5, 3] if hetero else [3, 3, 3]
    members = [nn.Sequential(nn.Linear(2, w), nn.Linear(w, 1)) for w in widths]
    ens = fe.HeteroEnsemble(members) if hetero else fe.Ensemble(members)
    before = snapshot(ens)
    exported = fe.export_state_dicts(ens)
    perm = [2, 1, 0]
    if hetero:  # a dict of member 0's own row in its group
        group = ens.groups[0].stacked.state_dict()
        views = [{k: v[0] for k, v in group.items()}, *exported[1:]]
    else:
        stacked = ens.stacked.state_dict()
        views = [{k: v[perm[i]] for k, v in stacked.items()} for i in range(3)]
    with pytest.raises(
        ValueError,
        match=r"member 0's `0.weight` shares memory with the ensemble's own `(groups.0.)?stacked",
    ):
        fe.import_state_dicts(ens, views)
    assert_trees_equal(snapshot(ens), before)
    if not hetero:  # new storage objects inside the ensemble's memory (found by a review)
        inside = [
            {k: torch.from_numpy(v.detach().numpy()[perm[i]]) for k, v in stacked.items()}
            for i in range(3)
        ]
        with pytest.raises(ValueError, match=r"member 0's `0.weight` shares memory"):
            fe.import_state_dicts(ens, inside)
        assert_trees_equal(snapshot(ens), before)
    # Cloned first, they are imported as the loop's load_state_dict of each would.
    fe.import_state_dicts(ens, [{k: v.clone() for k, v in d.items()} for d in views])
    expected = [exported[perm[i]] for i in range(3)] if not hetero else exported
    assert_trees_equal(fe.export_state_dicts(ens), expected)


class WithExtraState(nn.Module):
    """A module whose forward reads non-tensor state saved with get_extra_state."""

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.temperature = temperature

    def get_extra_state(self) -> dict:
        return {"temperature": self.temperature}

    def set_extra_state(self, state: dict) -> None:
        self.temperature = state["temperature"]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) / self.temperature


def test_extra_state_round_trips_and_must_agree_between_members() -> None:
    torch.manual_seed(0)
    trained = [WithExtraState(2.0) for _ in range(3)]
    ens = fe.Ensemble([WithExtraState() for _ in range(3)])
    state_dicts = fe.export_state_dicts(ens)
    assert state_dicts[0]["_extra_state"] == {"temperature": 1.0}
    fe.import_state_dicts(ens, [m.state_dict() for m in trained])
    x = torch.randn(4, 3)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in trained]))
    before = {k: v.clone() for k, v in ens.stacked_params().items()}
    trained[2].temperature = 5.0
    with pytest.raises(
        ValueError,
        match=r"import_state_dicts: member 2 has `_extra_state` = \{'temperature': 5\.0\}; "
        r"member 0 has \{'temperature': 2\.0\}\. .*must be the same in every member",
    ):
        fe.import_state_dicts(ens, [m.state_dict() for m in trained])
    assert_trees_equal(ens.stacked_params(), before)
    assert ens.stacked.temperature == 2.0


class _HalvedWeight(nn.Module):
    """Saves its weight halved and doubles it back on load (a legacy file format)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self._register_state_dict_hook(_HalvedWeight._save)
        self._register_load_state_dict_pre_hook(_HalvedWeight._load)

    @staticmethod
    def _save(module, state_dict, prefix, metadata):
        state_dict[prefix + "linear.weight"] = state_dict[prefix + "linear.weight"] / 2

    @staticmethod
    def _load(state_dict, prefix, *args):
        state_dict[prefix + "linear.weight"] = state_dict[prefix + "linear.weight"] * 2

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


class _SavedInHalfPrecision(nn.Linear):
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = destination[prefix + "weight"].half()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_import_runs_the_members_state_dict_hooks_as_load_state_dict(dtype):
    """A hook or override that changes what the file holds: each dict is loaded as the
    member's own load_state_dict loads it (the hooks wrote into temporaries before, and
    nothing was loaded: 0.81 off)."""
    torch.manual_seed(0)
    trained = [_HalvedWeight().to(dtype) for _ in range(3)]
    ens = fe.Ensemble.from_factory(_HalvedWeight, 3, seed=1).to(dtype)
    assert fe.import_state_dicts(ens, [m.state_dict() for m in trained]) is ens
    for i, m in enumerate(trained):
        assert_trees_equal(dict(ens.member(i).named_parameters()), dict(m.named_parameters()))
    x = torch.randn(5, 4, dtype=dtype)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in trained]))
    # An override saving in half precision: loaded (and rounded) as load_state_dict does.
    halves = [_SavedInHalfPrecision(4, 3).to(dtype) for _ in range(2)]
    ens = fe.Ensemble([_SavedInHalfPrecision(4, 3).to(dtype) for _ in range(2)])
    fe.import_state_dicts(ens, [m.state_dict() for m in halves])
    for i, m in enumerate(halves):
        want = _SavedInHalfPrecision(4, 3).to(dtype)
        want.load_state_dict(m.state_dict())
        assert_trees_equal(dict(ens.member(i).named_parameters()), dict(want.named_parameters()))
    # A dict that does not load is refused before any member is written.
    before = {k: v.clone() for k, v in ens.stacked_params().items()}
    bad = [halves[0].state_dict(), {"weight": torch.zeros(3, 4)}]
    with pytest.raises(ValueError, match=r"member 1's state_dict does not load .*bias"):
        fe.import_state_dicts(ens, bad)
    assert_trees_equal(ens.stacked_params(), before)


@pytest.mark.parametrize("strict", [True, False])
def test_ensemble_state_dict_with_extra_state_loads_back(strict) -> None:
    """The checks read `.shape` of every entry: a module's non-tensor extra state raised
    AttributeError, where a plain module round-trips its own state_dict."""
    torch.manual_seed(0)
    ens = fe.Ensemble([WithExtraState(2.0) for _ in range(3)])
    saved = ens.state_dict()
    other = fe.Ensemble([WithExtraState() for _ in range(3)])
    other.load_state_dict(saved, strict=strict)
    x = torch.randn(4, 3)
    torch.testing.assert_close(other(x), ens(x), rtol=0, atol=0)
    assert other.stacked.temperature == 2.0


def test_import_refuses_a_meta_tensor_before_writing_any_member():
    """Members 0 and 1 were written before torch's 'Cannot copy out of meta tensor'."""
    ens = fe.Ensemble([nn.Linear(3, 2) for _ in range(3)])
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    good = [nn.Linear(3, 2).state_dict() for _ in range(3)]
    state_dicts = [good[0], good[1], {k: v.to("meta") for k, v in good[2].items()}]
    with pytest.raises(ValueError, match=r"member 2 has `weight` on the meta device"):
        fe.import_state_dicts(ens, state_dicts)
    assert all(torch.equal(before[k], v) for k, v in ens.state_dict().items())


def test_export_and_unstack_refuse_tensors_of_another_member_shape():
    """A (3, 5) bias for Linear(3, 4) members exported a dict that the architecture's
    load_state_dict then refused elsewhere."""
    fmodel, params, buffers = fe.stack([nn.Linear(3, 4) for _ in range(3)])
    params = {**params, "bias": torch.zeros(3, 5)}
    message = r"parameter `bias` has shape \(3, 5\), but the members were built with \(4,\)"
    with pytest.raises(ValueError, match=message):
        fe.export_state_dicts(fmodel, params, buffers)
    with pytest.raises(ValueError, match=message):
        fe.unstack(fmodel, params, buffers)
