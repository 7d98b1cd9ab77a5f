"""State a member's forward leaves besides its outputs, against the plain loop.

A buffer re-assigned in forward carries its new value as the loop's module keeps it; a
tensor of a member's data kept on ``self``, a re-assigned parameter or buffer of
another shape, and an in-place change to an input all members share are refused.
"""

import collections
import copy
import itertools
import random
from typing import ClassVar

import numpy as np
import pytest
import torch
from helpers import Snapshot, export_queries_vmapped_layout
from torch import nn

import funcensemble as fe

N = 3


class Ema(nn.Module):
    """A running mean kept by re-assignment (not in place), and a call counter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("avg", torch.zeros(2))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.avg = 0.9 * self.avg + 0.1 * y.detach().mean(0)
        self.calls = self.calls + 1
        return y - self.avg


def members() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Ema().double() for _ in range(N)]


def batch(step: int, per_member: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(*((N,) if per_member else ()), 5, 4, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per-member"])
@pytest.mark.parametrize("face", ["module", "value_and_grad", "vmap"])
def test_a_buffer_reassigned_in_forward_keeps_its_new_value_as_in_the_loop(face, per_member):
    loop, ours = members(), members()
    fmodel, params, buffers = fe.stack(ours)
    ens = fe.Ensemble(copy.deepcopy(ours))
    dims = (0,) if per_member else None
    loss = lambda p, b, x: fmodel(p, b, x).pow(2).mean()  # noqa: E731
    for step in range(4):
        x = batch(step, per_member)
        expected = torch.stack([m(x[i] if per_member else x) for i, m in enumerate(loop)])
        if face == "module":
            got = ens(x, in_dims=0 if per_member else None)
        elif face == "vmap":
            got = fe.vmap(fmodel, in_dims=dims)(params, buffers, x)
        else:
            losses, _, buffers = fe.value_and_grad(loss, in_dims=dims)(params, buffers, x)
            got = None
            torch.testing.assert_close(losses, expected.pow(2).mean((1, 2)).detach())
        if got is not None:
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    state = ens.stacked_buffers() if face == "module" else buffers
    torch.testing.assert_close(state["avg"], torch.stack([m.avg for m in loop]))
    assert state["calls"].tolist() == [4] * N


class EmaThenFails(Ema):
    """Ema, then a failure after the buffers were re-assigned: in a later layer at a
    chosen call (a chunk), or a shared input changed in place."""

    fail_at: int | None = None
    calls_seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        type(self).calls_seen += 1
        if type(self).calls_seen == self.fail_at:
            raise ValueError("a later layer fails")
        if self.fail_at is None:
            x.mul_(1.0)  # the shared input changed in place: refused after the call
        return y


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("failure", ["later_layer", "shared_input_changed"])
@pytest.mark.parametrize("face", ["module", "vmap"])
def test_a_failed_call_puts_re_assigned_buffers_back(face, failure, chunk_size):
    # The re-assigned values were written into the stacked buffers as each call (each
    # chunk) ended: a later failure left them, for some members or all, where
    # BatchNorm's statistics are put back ("A call that fails changes nothing").
    torch.manual_seed(0)
    mods = [EmaThenFails().double() for _ in range(N)]
    EmaThenFails.calls_seen = 0
    EmaThenFails.fail_at = None if failure == "shared_input_changed" else (2 if chunk_size else 1)
    try:
        if face == "module":
            ens = fe.Ensemble(mods, chunk_size=chunk_size)
            buffers = ens.stacked_buffers()
            call = lambda: ens(torch.randn(5, 4, dtype=torch.float64))  # noqa: E731
        else:
            fmodel, params, buffers = fe.stack(mods)
            mapped = fe.vmap(fmodel, chunk_size=chunk_size)
            call = lambda: mapped(params, buffers, torch.randn(5, 4, dtype=torch.float64))  # noqa: E731
        before = {k: v.clone() for k, v in buffers.items()}
        with pytest.raises(ValueError, match=r"a later layer fails|an input shared by all"):
            call()
        for k, v in buffers.items():
            assert torch.equal(v, before[k]), k
    finally:
        EmaThenFails.fail_at = None


class Reassigns(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("count", torch.zeros(()))
        self.what = what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.what == "dtype":
            self.count = self.count.to(torch.float64) + 1
        elif self.what == "shape":
            self.count = torch.zeros(3)
        else:
            self.lin.weight = nn.Parameter(self.lin.weight * 2)
        return self.lin(x)


@pytest.mark.parametrize(
    "what, message",
    [
        ("dtype", r"re-assigned the buffer `count` with shape \(\), dtype torch.float64"),
        ("shape", r"re-assigned the buffer `count` with shape \(3,\)"),
        ("parameter", r"re-assigned the parameter `lin.weight`"),
    ],
)
def test_a_reassignment_the_stacked_tensors_cannot_hold_is_refused(what, message):
    ens = fe.Ensemble([Reassigns(what) for _ in range(N)])
    before = {k: v.detach().clone() for k, v in ens.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        ens(torch.ones(5, 4))
    after = ens.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


class KeepsLast(nn.Module):
    def __init__(self, start: torch.Tensor | None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        if start is not None:
            self.prev = None if isinstance(start, str) else start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.prev = out.detach()
        self.shape_only = torch.ones(3)  # not member data: kept, as in the loop
        return out


@pytest.mark.parametrize(
    "start", [None, torch.zeros(5, 2), "none"], ids=["new", "replaced", "was-None"]
)
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_a_tensor_of_member_data_kept_on_the_module_is_refused_and_put_back(start, chunk_size):
    fmodel, params, buffers = fe.stack([KeepsLast(start) for _ in range(N)])
    skeleton = fmodel.skeleton
    kept = getattr(skeleton, "prev", None)
    with pytest.raises(ValueError, match=r"kept a tensor computed from a member's data .* `prev`"):
        fe.vmap(fmodel, in_dims=(0,), chunk_size=chunk_size)(params, buffers, torch.ones(N, 5, 4))
    if start is None:
        assert not hasattr(skeleton, "prev")
    else:
        assert skeleton.prev is kept  # the tensor it held, or None


FEATURES: dict = {}  # a module-level store, as feature-extraction code keeps one


class Logs(nn.Module):
    """Keeps what it computes in containers: an attribute list and dict, a module-level
    dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.log: list = []
        self.cache: dict = {"h": torch.zeros(5, 2)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.log.append(out)
        return out


def _tanh_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


@pytest.mark.parametrize(
    "keeper", ["attribute-list", "attribute-dict", "module-level", "hook-shared", "hook-per-member"]
)
@pytest.mark.parametrize("face", ["Ensemble", "vmap", "chunked"])
def test_a_tensor_of_member_data_kept_in_a_container_is_refused_and_removed(keeper, face):
    """What a forward or forward hook keeps in a list or dict was torch.func's internal
    tensor of all members: reading it raised "escaped from inside a function being
    vmapped", copies of the ensemble failed, and with a hook per member writing its own
    dict the other members' dicts kept stale values (0.79 where the loop's held it)."""
    torch.manual_seed(0)
    stores = [{"h": torch.zeros(5, 3)} for _ in range(N)]
    if keeper.startswith("hook"):
        members = [_tanh_mlp() for _ in range(N)]
        for i, m in enumerate(members):
            store = stores[0] if keeper == "hook-shared" else stores[i]
            m[1].register_forward_hook(lambda mod, inp, out, store=store: store.update(h=out))
    else:
        kind = {"attribute-list": Logs, "attribute-dict": _CachesInDict}.get(keeper, _KeepsGlobally)
        members = [kind() for _ in range(N)]
    ens = fe.Ensemble(members, chunk_size=2 if face == "chunked" else None)
    x = torch.randn(5, 4)
    FEATURES.clear()
    with pytest.raises(ValueError, match="a tensor computed from the members' data was left in"):
        if face == "vmap":
            fe.vmap(ens.fmodel)(ens.stacked_params(), ens.stacked_buffers(), x)
        else:
            ens(x)
    assert ens.stacked.__dict__.get("log", []) == []
    assert "h" not in FEATURES
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    assert not any(wrapped(v) for store in stores for v in store.values())
    copy.deepcopy(ens)  # nothing unreadable left behind


class _CachesInDict(Logs):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.cache["h"] = out.detach().clone()
        return out


class _KeepsGlobally(Logs):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        FEATURES["h"] = out
        return out


def test_a_loss_reading_in_the_same_call_what_a_hook_kept_runs_as_the_loop():
    """A hook keeping an activation for the loss to read inside the same call (an
    activation penalty) is the loop's computation: not refused."""
    torch.manual_seed(0)
    kept: dict = {}
    members = [_tanh_mlp().double() for _ in range(N)]
    for m in members:
        m[1].register_forward_hook(lambda mod, inp, out: kept.update(h=out))
    loop = copy.deepcopy(members)
    fmodel, params, buffers = fe.stack(members)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)

    def loss_fn(p, b, x, y):
        out = fmodel(p, b, x)
        return (out - y).pow(2).mean() + 0.1 * kept["h"].pow(2).mean()

    losses, grads, _ = fe.value_and_grad(loss_fn)(params, buffers, x, y)
    for i, m in enumerate(loop):
        loss = (m(x) - y).pow(2).mean() + 0.1 * kept["h"].pow(2).mean()
        loss.backward()
        torch.testing.assert_close(losses[i], loss.detach(), rtol=1e-12, atol=0)
        for name, p in m.named_parameters():
            torch.testing.assert_close(grads[name][i], p.grad, rtol=1e-12, atol=1e-15)


class _KeepsWhileTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)
        self.acts: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.training:
            self.acts["h"] = h  # for the loss, read in the same call
        return self.b(h)


features: dict = {}  # another model's feature-extraction dict (named like an attribute)
CONTEXT: list = []  # a side input the caller sets inside its own torch.func transform


class _ReadsFeaturesAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)) * CONTEXT[-1]


def test_what_an_earlier_call_or_the_callers_transform_left_is_not_this_calls():
    """Review of the container check: it refused the first eval call after a training
    call whose loss read what forward kept (the tensor was the earlier call's), an
    ensemble whose forward reads self.features because a module-level dict was named
    `features`, and a side input wrapped by the caller's own torch.func.grad; each
    computed what the loop computes before the check."""
    torch.manual_seed(0)
    dtype = torch.float64
    members = [_KeepsWhileTraining().to(dtype) for _ in range(N)]
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members)
    x, y = torch.randn(6, 4, dtype=dtype), torch.randn(6, 1, dtype=dtype)
    fmodel = ens.fmodel

    def loss_fn(p, b, x, y):
        out = fmodel(p, b, x)
        return (out - y).pow(2).mean() + 0.1 * fmodel.skeleton.acts["h"].pow(2).mean()

    losses, _, _ = fe.value_and_grad(loss_fn)(ens.stacked_params(), ens.stacked_buffers(), x, y)
    want = [(m(x) - y).pow(2).mean() + 0.1 * m.acts["h"].pow(2).mean() for m in loop]
    torch.testing.assert_close(losses, torch.stack(want).detach(), rtol=1e-12, atol=0)
    ens.eval()
    for m in loop:
        m.eval()
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]), rtol=1e-12, atol=0)

    # A module-level dict named like the attribute forward reads, holding another
    # call's tensor; and a side input of the caller's own transform, read by forward.
    hooked = [_tanh_mlp().to(dtype) for _ in range(N)]
    for m in hooked:
        m[1].register_forward_hook(lambda mod, inp, out: features.update(h=out))
    f2, p2, b2 = fe.stack(hooked)
    fe.value_and_grad(lambda p, b, x: f2(p, b, x).sum() + features["h"].sum())(p2, b2, x)
    readers = [_ReadsFeaturesAttribute().to(dtype) for _ in range(N)]
    plain = copy.deepcopy(readers)
    ens2 = fe.Ensemble(readers)
    z = torch.tensor(2.0, dtype=dtype)

    def through(call):
        def total(z):
            CONTEXT[:] = [z]
            return call().sum()

        return torch.func.grad(total)(z)

    got = through(lambda: ens2(x))
    want = through(lambda: torch.stack([m(x) for m in plain]))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert "h" in features  # the other model's entry is left alone
    CONTEXT.clear()


class _NestsInTuples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.log: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.log.append(("step", (out, 1)))
        return out


class _Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.prev = self.lin(x)
        return self.prev


class _RootLogs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = _Child()
        self.log: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.child(x)
        self.log.append(out)
        return out


class _Saver:
    def __init__(self) -> None:
        self.store: dict = {}

    def __call__(self, module, inputs, output) -> None:
        self.store["h"] = output


SAVED: list = []


class _SavesGlobally:
    def __call__(self, module, inputs, output) -> None:
        SAVED.append(output)


class _InheritsItsCall(_SavesGlobally):
    pass


def test_containers_the_first_check_missed_are_refused_and_everything_is_cleaned():
    """Review of the container check: a tensor inside a tuple inside a tuple, and a
    forward hook that is a callable object (the ensemble runs a copy of it, whose dict
    kept the tensor), went unseen; with both a container and a child's attribute left,
    the attribute stayed (copies of the ensemble failed)."""
    x = torch.randn(5, 4)
    tupled = fe.Ensemble([_NestsInTuples() for _ in range(N)])
    with pytest.raises(ValueError, match="left in attribute `log` of _NestsInTuples"):
        tupled(x)
    assert tupled.stacked.log == []
    saved = [_tanh_mlp() for _ in range(N)]
    for m in saved:
        m[1].register_forward_hook(_Saver())
    with pytest.raises(ValueError, match=r"left in `_Saver\.store`, used by its forward hook"):
        fe.Ensemble(saved)(x)
    inherited = [_tanh_mlp() for _ in range(N)]
    for m in inherited:
        m[1].register_forward_hook(_InheritsItsCall())
    with pytest.raises(ValueError, match=r"left in the module-level `SAVED`, used by its forward"):
        fe.Ensemble(inherited)(x)
    assert SAVED == []
    both = fe.Ensemble([_RootLogs() for _ in range(N)])
    with pytest.raises(ValueError, match=r"the forward kept a tensor|was left in attribute"):
        both(x)
    assert both.stacked.log == [] and not hasattr(both.stacked.child, "prev")
    copy.deepcopy(both)


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log: list = []


class _MakesItsRecorder(nn.Module):
    """Creates a submodule in its first forward and keeps what it computes on it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        if not hasattr(self, "rec"):
            self.rec = _Holder()
        self.rec.log.append(out)
        return out


class _SwapsAnAttribute(nn.Module):
    """Deletes one attribute and adds a list: as many attributes as before."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.a = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        if hasattr(self, "a"):
            del self.a
            self.b: list = []
        self.b.append(out)
        return out


def test_what_the_final_review_found_the_container_check_missing():
    """The final review: a submodule made by the forward was not walked (the module list
    was taken before the forward), an attribute deleted and another added kept the
    cached names (their count unchanged), and a refusal removed earlier calls' tensors
    past the window it had looked at before the call."""
    x = torch.randn(5, 4)
    for kind, where in ((_MakesItsRecorder, "`rec`"), (_SwapsAnAttribute, "attribute `b`")):
        ens = fe.Ensemble([kind() for _ in range(N)])
        with pytest.raises(ValueError, match=f"was left in .*{where}"):
            ens(x)
        copy.deepcopy(ens)  # nothing unreadable left behind

    hooked = [_tanh_mlp() for _ in range(N)]
    kept: list = []
    for m in hooked:
        m[1].register_forward_hook(lambda mod, inp, out: kept.append(out))
    fmodel, params, buffers = fe.stack(hooked)
    for _ in range(300):  # allowed: a loss reads them in its own call
        fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum() + kept[-1].sum())(
            params, buffers, x
        )
    earlier = list(kept)
    with pytest.raises(ValueError, match="used by its forward hook"):
        fe.vmap(fmodel)(params, buffers, x)
    assert len(kept) == 300 and all(a is b for a, b in zip(kept, earlier, strict=True))


def test_a_shared_input_modified_in_place_is_refused_a_per_member_one_runs_as_the_loop():
    class AddsOne(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.add_(1.0)  # the loop's members would each see the changes of those before
            return self.lin(x)

    torch.manual_seed(0)
    loop = [AddsOne().double() for _ in range(N)]
    ens = fe.Ensemble(copy.deepcopy(loop))
    x = torch.zeros(5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"modified its positional argument 0, an input shared"):
        ens(x)
    xs = torch.zeros(N, 5, 4, dtype=torch.float64)
    expected = torch.stack([m(xs[i].clone()) for i, m in enumerate(loop)])
    torch.testing.assert_close(ens(xs, in_dims=0), expected)
    assert torch.equal(xs, torch.ones(N, 5, 4, dtype=torch.float64))  # once each, as the loop


@pytest.mark.parametrize("where", ["dict", "tuple", "kwarg", "partly mapped"])
def test_a_shared_tensor_inside_an_argument_modified_in_place_is_refused(where):
    """Shared tensors nested in dicts, tuples and keyword arguments are checked like a
    shared tensor argument: in the loop each member would see the changes of those
    before it (0.33 off the loop before this check)."""

    class AddsOne(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, batch=None, *, kw=None) -> torch.Tensor:
            given = kw if kw is not None else batch
            x = given["x"] if isinstance(given, dict) else given[0]
            x.add_(1.0)
            return self.lin(x)

    torch.manual_seed(0)
    ens = fe.Ensemble([AddsOne().double() for _ in range(N)])
    x = torch.zeros(5, 4, dtype=torch.float64)
    match = r"modified a tensor inside its (positional|keyword) argument"
    with pytest.raises(ValueError, match=match):
        if where == "dict":
            ens({"x": x})
        elif where == "tuple":
            ens((x,))
        elif where == "kwarg":
            ens(kw={"x": x})
        else:
            scale = torch.ones(N, 1, dtype=torch.float64)
            ens({"x": x, "scale": scale}, in_dims=({"x": None, "scale": 0},))


@pytest.mark.parametrize("act", [nn.LeakyReLU(0.1, inplace=True), nn.ReLU(inplace=True)], ids=str)
def test_an_in_place_activation_on_the_input_of_an_mlp_runs_as_written(act):
    # The MLP fast path never writes its input: an in-place activation applied to the
    # input itself leaves it to the general path (refused for a shared input, as the
    # loop's members would each change it in turn; per member, as the loop).
    torch.manual_seed(0)
    loop = [nn.Sequential(copy.deepcopy(act), nn.Linear(4, 2)).double() for _ in range(N)]
    ens = fe.Ensemble(copy.deepcopy(loop))
    with pytest.raises(ValueError, match=r"modified its positional argument 0, an input shared"):
        ens(torch.randn(5, 4, dtype=torch.float64))
    xs = torch.randn(N, 5, 4, dtype=torch.float64)
    ours = xs.clone()
    expected = torch.stack([m(xs[i]) for i, m in enumerate(loop)])  # changes xs in place
    torch.testing.assert_close(ens(ours, in_dims=0), expected)
    assert torch.equal(ours, xs)


def test_in_place_dropout_on_a_shared_input_is_refused_before_it_changes():
    torch.manual_seed(0)
    ens = fe.Ensemble(
        [nn.Sequential(nn.Dropout(0.5, inplace=True), nn.Linear(4, 2)) for _ in range(N)]
    )
    x = torch.randn(5, 4)
    before = x.clone()
    with pytest.raises(
        RuntimeError, match=r"Ensemble: forward changes in place a tensor that all members share"
    ):
        ens(x)
    assert torch.equal(x, before)


def test_in_place_dropout_on_a_shared_input_with_randomness_same_is_refused_after():
    """inputs.md: with randomness="same" vmap runs it, changing the input once; the
    library's check refuses it after the call."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Dropout(0.5, inplace=True), nn.Linear(4, 2)) for _ in range(N)]
    ens = fe.Ensemble(layers, randomness="same")
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"Ensemble: .*modified its positional argument 0"):
        ens(x)


def test_an_inference_tensor_changed_in_place_is_not_seen_as_documented():
    """inputs.md: the check reads version counters, which tensors made under
    torch.inference_mode() do not keep; such a change passes unseen."""

    class AddsOne(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.add_(1.0)
            return self.lin(x)

    ens = fe.Ensemble([AddsOne() for _ in range(N)])
    with torch.inference_mode():
        x = torch.zeros(5, 4)
        ens(x)  # no error: nothing to compare against
    assert torch.equal(x, torch.ones(5, 4))  # changed once, not once per member


class _Warmup(nn.Module):
    """A forward that keeps Python state: a call counter and a log of its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.calls = 0
        self.log: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.log.append("call")
        return self.lin(x) * min(1.0, self.calls / 10)


@pytest.mark.parametrize("face", ["Ensemble", "vmap", "value_and_grad"])
@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_python_attributes_changed_by_forward_end_as_each_loop_member(face, chunk_size):
    """Every chunk starts from the attributes the call started from (a warm-up counter
    that grew per chunk gave later chunks another factor: 0.36 off the loop)."""
    torch.manual_seed(0)
    loop = [_Warmup().double() for _ in range(N)]
    members = copy.deepcopy(loop)
    x = torch.randn(6, 4, dtype=torch.float64)
    for call in range(2):
        want = torch.stack([m(x) for m in loop])
        if face == "Ensemble":
            ens = members if call else fe.Ensemble(members, chunk_size=chunk_size)
            members, skeleton, got = ens, ens.stacked, ens(x)
        else:
            if not call:
                fmodel, params, buffers = fe.stack(members)
            skeleton = fmodel.skeleton
            if face == "vmap":
                got = fe.vmap(fmodel, chunk_size=chunk_size)(params, buffers, x)
            else:
                loss = fe.value_and_grad(
                    lambda p, b, x, f=fmodel: (f(p, b, x) ** 2).sum(), chunk_size=chunk_size
                )
                got = loss(params, buffers, x)[0]
                want = (want**2).sum(dim=(1, 2))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        assert skeleton.calls == loop[0].calls == call + 1
        assert skeleton.log == loop[0].log == ["call"] * (call + 1)


class _Schedule:
    def __init__(self) -> None:
        self.step = 0


class _NestedState(nn.Module):
    """Python state changed inside what attributes hold: an object's field, a list in a
    dict, a random.Random. Chunks once saw only the attributes themselves, so later
    chunks started from what earlier ones left (0.18 off the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.schedule = _Schedule()
        self.history = {"calls": [0]}
        self.rng = random.Random(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.schedule.step += 1
        self.history["calls"][0] += 1
        scale = min(1.0, self.schedule.step / 10) * self.rng.random()
        return self.lin(x) * scale * self.history["calls"][0]


@pytest.mark.parametrize("face", ["Ensemble", "vmap", "value_and_grad"])
def test_state_changed_inside_attributes_is_replayed_per_chunk(face):
    torch.manual_seed(0)
    loop = [_NestedState().double() for _ in range(N)]
    members = copy.deepcopy(loop)
    x = torch.randn(6, 4, dtype=torch.float64)
    if face == "Ensemble":
        ens = fe.Ensemble(members, chunk_size=2)
        skeleton = ens.stacked
    else:
        fmodel, params, buffers = fe.stack(members)
        skeleton = fmodel.skeleton
    for _ in range(2):
        want = torch.stack([m(x) for m in loop])
        if face == "Ensemble":
            got = ens(x)
        elif face == "vmap":
            got = fe.vmap(fmodel, chunk_size=2)(params, buffers, x)
        else:
            loss = fe.value_and_grad(lambda p, b, x: (fmodel(p, b, x) ** 2).sum(), chunk_size=2)
            got = loss(params, buffers, x)[0]
            want = (want**2).sum(dim=(1, 2))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert skeleton.schedule.step == loop[0].schedule.step == 2
    assert skeleton.history == loop[0].history == {"calls": [2]}
    assert skeleton.rng.getstate() == loop[0].rng.getstate()


class _NumpyRandom(nn.Module):
    """NumPy generators drawn in forward: RandomState (a C object without __dict__) was
    not put back between chunks, so later chunks drew on (0.26 off the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.legacy = np.random.RandomState(0)
        self.gen = np.random.default_rng(0)
        self.bits = np.random.PCG64(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.legacy.rand() + self.gen.random() + self.bits.random_raw() % 5
        return self.lin(x) * float(scale)


@pytest.mark.parametrize("face", ["Ensemble", "vmap"])
def test_numpy_generators_are_put_back_per_chunk(face):
    torch.manual_seed(0)
    loop = [_NumpyRandom().double() for _ in range(N)]
    members = copy.deepcopy(loop)
    x = torch.randn(6, 4, dtype=torch.float64)
    if face == "Ensemble":
        ens = fe.Ensemble(members, chunk_size=1)
        skeleton = ens.stacked
    else:
        fmodel, params, buffers = fe.stack(members)
        skeleton = fmodel.skeleton
    for _ in range(2):
        want = torch.stack([m(x) for m in loop])
        got = ens(x) if face == "Ensemble" else fe.vmap(fmodel, chunk_size=1)(params, buffers, x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert skeleton.legacy.randint(1 << 30) == loop[0].legacy.randint(1 << 30)
    assert skeleton.gen.integers(1 << 30) == loop[0].gen.integers(1 << 30)
    assert skeleton.bits.random_raw() == loop[0].bits.random_raw()


class _Logged(nn.Module):
    """forward appends to a deque and a bytearray (C objects without __dict__): with
    chunks they were watched as opaque and the call refused, where a list is put back."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.recent = collections.deque(maxlen=4)
        self.marks = bytearray()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recent.append(len(self.recent))
        self.marks.append(len(self.marks))
        return self.lin(x) * (1 + len(self.recent) + sum(self.marks))


class _History(collections.deque):
    pass


class _Totalled(nn.Module):
    """A container subclass with an attribute of its own beside its items: chunks put
    back the items only, so later chunks counted on (3.0 off the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.history = _History()
        self.history.total = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.history.append(1)
        self.history.total += 1
        return self.lin(x) * self.history.total


def test_a_container_subclasss_own_attributes_are_put_back_per_chunk():
    torch.manual_seed(0)
    loop = [_Totalled().double() for _ in range(N)]
    ens = fe.Ensemble(copy.deepcopy(loop), chunk_size=1)
    x = torch.randn(2, 4, dtype=torch.float64)
    for _ in range(2):
        want = torch.stack([m(x) for m in loop])
        torch.testing.assert_close(ens(x), want, rtol=1e-12, atol=1e-14)
    assert ens.stacked.history.total == loop[0].history.total == 2


def test_a_deque_and_a_bytearray_changed_in_forward_are_put_back_per_chunk():
    torch.manual_seed(0)
    loop = [_Logged().double() for _ in range(N)]
    ens = fe.Ensemble(copy.deepcopy(loop), chunk_size=1)
    x = torch.randn(2, 4, dtype=torch.float64)
    for _ in range(3):
        want = torch.stack([m(x) for m in loop])
        torch.testing.assert_close(ens(x), want, rtol=1e-12, atol=1e-14)
    assert ens.stacked.recent == loop[0].recent and ens.stacked.marks == loop[0].marks


class _Tally(nn.Module):
    """Counts its calls in a NumPy array of ``size`` elements, read by forward."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.tally = np.zeros(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tally += 1
        return self.lin(x) * float(self.tally[0])


@pytest.mark.parametrize("size", [10, 65536, 65537])
def test_numpy_arrays_changed_in_forward_are_put_back_per_chunk_up_to_65536_elements(size):
    # chunking.md: arrays of up to 65,536 elements are put back before each chunk (the
    # module ends as each loop member); a larger one is compared by identity only, so
    # forward's change counts once per chunk, as documented.
    torch.manual_seed(0)
    loop = [_Tally(size).double() for _ in range(N)]
    ens = fe.Ensemble(copy.deepcopy(loop), chunk_size=1)
    x = torch.randn(2, 4, dtype=torch.float64)
    out = ens(x)
    if size <= 65536:
        torch.testing.assert_close(out, torch.stack([m(x) for m in loop]), rtol=1e-12, atol=0)
        assert ens.stacked.tally[0] == 1
    else:
        assert ens.stacked.tally[0] == N


class _Table(nn.Module):
    """Reads a large NumPy table through torch.from_numpy."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.table = np.arange(70000, dtype=np.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.from_numpy(self.table)[:3] + float(self.table[10:20].sum())


def test_a_large_numpy_table_read_in_chunks_matches_the_loop_and_stays_writable():
    torch.manual_seed(0)
    loop = [_Table().double() for _ in range(N)]
    ens = fe.Ensemble([_Table().double() for _ in range(N)], chunk_size=1)
    for m, twin in zip(loop, ens.unstack(), strict=True):
        m.load_state_dict(twin.state_dict())
    x = torch.randn(2, 4, dtype=torch.float64)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]), rtol=1e-12, atol=0)
    assert ens.stacked.table.flags.writeable


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.calls = itertools.count()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * next(self.calls)


def test_a_c_object_changed_in_forward_is_refused_with_chunks():
    """An itertools.count cannot be put back: later chunks counted on from where the
    first left it (1, 2, ... where every loop member sees 0), without a word."""
    ens = fe.Ensemble([_Counting() for _ in range(3)], chunk_size=1)
    with pytest.raises(ValueError, match=r"`calls`.*cannot be put back between chunks"):
        ens(torch.randn(2, 4))
    unchunked = fe.Ensemble([_Counting() for _ in range(3)])
    unchunked(torch.randn(2, 4))  # one call of forward: as the loop's


class _Config:
    def __init__(self) -> None:
        self.scale = 1.0


def _warmup_closure():
    calls = 0

    def factor() -> float:
        nonlocal calls
        calls += 1
        return min(1.0, calls / 10)

    return factor


class _KeptReferences(nn.Module):
    """State reached by two paths, a config object the user keeps a handle to, a
    closure counter and a function attribute: chunks once broke the first two (fresh
    copies per chunk) and did not replay the last two (0.12-2.3 off)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen: list[int] = []
        self.tracker = {"items": self.seen}
        self.config = _Config()
        self.factor = _warmup_closure()

        def bump() -> int:
            bump.calls += 1
            return bump.calls

        bump.calls = 0
        self.bump = bump

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tracker["items"].append(1)
        scale = self.config.scale * self.factor() * self.bump() * len(self.seen)
        return self.lin(x) * scale


def test_chunks_put_back_what_attributes_reach_in_place():
    # Built twice from one seed: deepcopy would share the closures between the two.
    torch.manual_seed(0)
    loop = [_KeptReferences().double() for _ in range(N)]
    torch.manual_seed(0)
    ens = fe.Ensemble([_KeptReferences().double() for _ in range(N)], chunk_size=1)
    config, seen = ens.stacked.config, ens.stacked.seen
    x = torch.randn(6, 4, dtype=torch.float64)
    for call in range(3):
        if call == 2:
            config.scale = 3.0  # through the handle kept before the chunked calls
            for m in loop:
                m.config.scale = 3.0
        want = torch.stack([m(x) for m in loop])
        torch.testing.assert_close(ens(x), want, rtol=1e-12, atol=1e-14)
    assert ens.stacked.config is config and ens.stacked.seen is seen
    assert ens.stacked.tracker["items"] is ens.stacked.seen == loop[0].seen
    assert ens.stacked.bump.calls == loop[0].bump.calls == 3


def test_attributes_that_end_differently_in_two_chunks_are_refused_and_put_back():
    class Stamps(nn.Module):
        clock: ClassVar[list[int]] = [0]  # shared by every instance: each chunk reads anew

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.stamp = -1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            Stamps.clock[0] += 1
            self.stamp = Stamps.clock[0]
            return self.lin(x)

    ens = fe.Ensemble([Stamps().double() for _ in range(N)], chunk_size=1)
    x = torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"changed the attribute `stamp` of a Stamps differently"):
        ens(x)
    assert ens.stacked.stamp == -1
    ens_whole = fe.Ensemble([Stamps().double() for _ in range(N)])
    ens_whole(x)  # one call for all members: each member's own forward ran once
    assert ens_whole.stacked.stamp == Stamps.clock[0]


def test_a_large_collection_is_put_back_as_a_whole():
    """chunking.md: a collection of more than 4,096 items is put back as a whole (its
    items are data, not followed): a forward appending to it ends as each loop member."""

    class Buffered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.buffer = [(i, float(i)) for i in range(5000)]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.buffer.append((len(self.buffer), 0.0))
            return self.lin(x) * len(self.buffer)

    torch.manual_seed(0)
    loop = [Buffered().double() for _ in range(N)]
    ens = fe.Ensemble(copy.deepcopy(loop), chunk_size=1)
    x = torch.randn(6, 4, dtype=torch.float64)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]), rtol=1e-12, atol=1e-14)
    assert len(ens.stacked.buffer) == len(loop[0].buffer) == 5001


def _doubles(x: torch.Tensor) -> None:
    x.mul_(2.0)


class ChangesItsInput(nn.Module):
    """A Linear(4, 2) after ``change(x)``, an in-place change of its input (doubling it
    by default); members given one function have the same architecture."""

    def __init__(self, change=_doubles) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.change = change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.change(x)
        return self.lin(x)


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("face", ["vmap", "value_and_grad", "Ensemble"])
def test_a_shared_input_changed_in_place_is_refused_after_one_change(face, chunk_size):
    """The message says the input "has been modified once": a chunked fe.vmap ran every
    chunk before checking, doubling the input once per chunk (x16 with chunk_size=1)."""

    members = [ChangesItsInput() for _ in range(4)]
    fmodel, params, buffers = fe.stack(members)
    x = torch.ones(5, 4)
    call = {
        "vmap": lambda: fe.vmap(fmodel, chunk_size=chunk_size)(params, buffers, x),
        "value_and_grad": lambda: fe.value_and_grad(
            lambda p, b, x: fmodel(p, b, x).sum(), chunk_size=chunk_size
        )(params, buffers, x),
        "Ensemble": lambda: fe.Ensemble(members, chunk_size=chunk_size)(x),
    }[face]
    with pytest.raises(ValueError, match=r"an input shared by all members.* modified once"):
        call()
    assert torch.equal(x, torch.full((5, 4), 2.0))


@pytest.mark.parametrize("face", ["vmap", "value_and_grad"])
def test_a_shared_input_changed_through_a_vmap_of_ones_own_is_refused(face):
    """Inside a torch.func.vmap over seeds, the input every member shares is a wrapper
    whose own version counter an in-place op leaves alone: the plain tensor's is read."""

    fmodel, params, buffers = fe.stack([ChangesItsInput() for _ in range(3)])
    per_seed = {
        "vmap": lambda x: fe.vmap(fmodel)(params, buffers, x),
        "value_and_grad": lambda x: fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())(
            params, buffers, x
        )[0],
    }[face]
    xs = torch.ones(2, 5, 4)
    if face == "vmap":
        with pytest.raises(ValueError, match=r"an input shared by all members.* modified once"):
            torch.func.vmap(per_seed)(xs)
        assert torch.equal(xs, torch.full((2, 5, 4), 2.0))
    else:  # inside a transform value_and_grad runs torch.func.grad, which refuses first
        with pytest.raises(RuntimeError, match="would mutate a captured Tensor"):
            torch.func.vmap(per_seed)(xs)
        assert torch.equal(xs, torch.ones(2, 5, 4))


@pytest.mark.parametrize("view", [False, True])
def test_a_shared_input_changed_in_place_is_refused_by_a_non_strict_export(view):
    """torch.export's default (non-strict) tracing runs forward in Python on fake
    tensors, outside Dynamo, where the trace-time check does nothing: the program
    exported, and ran 3.2 off the loop (x[0].mul_(2) applied once for all members)."""

    change = (lambda x: x[0].mul_(2.0)) if view else _doubles
    ens = fe.Ensemble([ChangesItsInput(change) for _ in range(3)]).eval()
    x = torch.ones(5, 4)
    refused = r"shared by all members.* torch.export traced the call"
    if export_queries_vmapped_layout():  # or torch 2.6's tracer stops first (versions.md)
        with pytest.raises((ValueError, RuntimeError), match=rf"{refused}|NYI: querying"):
            torch.export.export(ens, (x,), strict=False)
    else:
        with pytest.raises(ValueError, match=refused):
            torch.export.export(ens, (x,), strict=False)
    assert torch.equal(x, torch.ones(5, 4))


def test_a_change_through_data_is_not_seen_as_inputs_md_says():
    """``x.data`` has a version counter of its own: the check cannot see a change made
    through it (inputs.md says so; autograd's own checks miss it in the loop too)."""

    def doubles_data(x: torch.Tensor) -> None:
        x.data.mul_(2.0)

    x = torch.ones(5, 4)
    fe.Ensemble([ChangesItsInput(doubles_data) for _ in range(3)])(x)
    assert torch.equal(x, torch.full((5, 4), 2.0))  # changed once, not refused


@pytest.mark.parametrize("face", ["module", "vmap"])
def test_a_chunked_write_with_autograd_history_into_a_buffer_is_explained(face):
    # The second chunk's write failed inside torch ("a leaf Variable that requires
    # grad is being used in an in-place operation") and left the ensemble's stacked
    # buffer holding a graph.
    torch.manual_seed(0)
    mods = [Snapshot() for _ in range(N)]
    x = torch.randn(4, 3)
    if face == "module":
        ens = fe.Ensemble(mods, chunk_size=2)
        buffers = ens.stacked_buffers()
        call = lambda: ens(x)  # noqa: E731
    else:
        fmodel, params, buffers = fe.stack(mods)
        call = lambda: fe.vmap(fmodel, chunk_size=2)(params, buffers, x)  # noqa: E731
    with pytest.raises(
        ValueError, match=r"wrote a value with autograd history into the buffer `snap`"
    ):
        call()
    assert not buffers["snap"].requires_grad and buffers["snap"].grad_fn is None


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_other_leaf_in_place_errors_are_left_as_torch_raises_them(chunk_size):
    # The explanation above fired on any "leaf Variable that requires grad" error while
    # a buffer required grad: it blamed a buffer the caller made require grad (a leaf)
    # for the forward's own in-place op on a parameter, and detached that buffer.
    class ChangesItsBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("scale", torch.ones(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin.bias.add_(0.0)
            return self.lin(x) * self.scale

    fmodel, params, _ = fe.stack([ChangesItsBias() for _ in range(N)])
    buffers = {"scale": torch.ones(N, 2, requires_grad=True)}
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        fe.vmap(fmodel, chunk_size=chunk_size)(params, buffers, torch.randn(5, 3))
    assert buffers["scale"].requires_grad and buffers["scale"].is_leaf


class _UpdatesThenFails(nn.Module):
    """spectral_norm's power iteration and Embedding(max_norm) write their own tensors
    as the forward passes; the Linear after them refuses a wrong width."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4, max_norm=0.5)
        self.sn = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))
        self.out = nn.Linear(4, 2)

    def forward(self, i, width):
        h = self.sn(self.emb(i))
        return self.out(h[..., :width])


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("face", ["Ensemble", "vmap", "value_and_grad"])
def test_a_failed_call_puts_back_spectral_norm_and_max_norm_updates(face, chunk_size):
    torch.manual_seed(0)
    members = [_UpdatesThenFails().double() for _ in range(3)]
    for m in members:  # rows above max_norm: the lookup renormalises them
        with torch.no_grad():
            m.emb.weight.mul_(10)
    i = torch.tensor([0, 2, 5])
    if face == "Ensemble":
        ens = fe.Ensemble(members, chunk_size=chunk_size)
        params, buffers = ens.stacked_params(), ens.stacked_buffers()
        call = lambda width: ens(i, width)  # noqa: E731
    elif face == "vmap":
        fmodel, params, buffers = fe.stack(members)
        mapped = fe.vmap(fmodel, chunk_size=chunk_size)
        call = lambda width: mapped(params, buffers, i, width)  # noqa: E731
    else:  # the given buffers are never written; the renormalised rows are the params'
        fmodel, params, buffers = fe.stack(members)
        # Member 2 alone reads a row its table lacks: a later chunk fails.
        rows = torch.tensor([[0, 2, 5], [1, 3, 4], [0, 1, 2]])
        step = fe.value_and_grad(
            lambda p, b, i, w: fmodel(p, b, i, w).sum(), in_dims=(0, None), chunk_size=chunk_size
        )

        def call(width):
            bad = rows.clone()
            if width == 3:
                bad[2, 0] = 9
            return step(params, buffers, bad, 4)

    assert any(k.endswith("_u") for k in buffers)
    before = {k: v.detach().clone() for k, v in {**params, **buffers}.items()}
    with pytest.raises((RuntimeError, ValueError, IndexError)):
        call(3)  # 3 features where the last Linear expects 4 (or a row out of range)
    for name, t in {**params, **buffers}.items():
        assert torch.equal(t, before[name]), name
    call(4)  # and the same call that succeeds updates them, as the loop's does
    changed = [k for k, t in {**params, **buffers}.items() if not torch.equal(t, before[k])]
    assert "emb.weight" in changed, changed
    if face != "value_and_grad":
        assert any(k.endswith("_u") for k in changed), changed


def test_another_ensemble_called_inside_a_failed_call_is_put_back_as_buffers_md_says():
    torch.manual_seed(0)

    def make():
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()

    teacher = fe.Ensemble([make() for _ in range(2)])
    fmodel, params, buffers = fe.stack([make() for _ in range(2)])
    x = torch.randn(5, 3, dtype=torch.float64)

    def student(p, b, x, fail):
        with torch.no_grad():
            teacher(x)
        out = fmodel(p, b, x)
        if fail:
            raise RuntimeError("the student's own failure")
        return out

    def teachers() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in teacher.stacked_buffers().items()}

    before = teachers()
    fe.vmap(student)(params, buffers, x, False)
    # A call that succeeds keeps the teacher's update.
    assert any(not torch.equal(v, before[k]) for k, v in teacher.stacked_buffers().items())
    before = teachers()
    with pytest.raises(RuntimeError, match="the student's own failure"):
        fe.vmap(student)(params, buffers, x, True)
    for k, v in teacher.stacked_buffers().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_value_and_grad_refusing_its_loss_puts_back_the_renormalised_rows(chunk_size):
    """The losses are checked after the mapped call's own transaction: a loss of the
    wrong shape was refused after Embedding(max_norm) had renormalised the caller's
    rows (unchunked)."""
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Embedding(6, 3, max_norm=0.5), nn.Linear(3, 1)).double() for _ in range(2)
    ]
    for m in members:
        with torch.no_grad():
            m[0].weight.mul_(10)
    fmodel, params, buffers = fe.stack(members)
    before = {k: v.detach().clone() for k, v in params.items()}
    step = fe.value_and_grad(lambda p, b, i: fmodel(p, b, i), chunk_size=chunk_size)  # not a scalar
    with pytest.raises(ValueError, match=r"loss_fn must return one scalar per member"):
        step(params, buffers, torch.tensor([0, 2, 5]))
    for name, t in params.items():
        assert torch.equal(t, before[name]), name
