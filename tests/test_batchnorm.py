"""BatchNorm folded into one batch_norm over N * C channels equals the loop."""

import copy

import pytest
import torch
from torch import nn

import funcensemble as fe
from funcensemble._kernels import batchnorm as _batchnorm

TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture
def folded(monkeypatch):
    """Records, per F.batch_norm call under vmap, whether the fold ran it."""
    calls = []
    original = _batchnorm._fold

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_batchnorm, "_fold", spy)
    return calls


def cnn(affine: bool = True, track: bool = True) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4, affine=affine, track_running_stats=track),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
        nn.BatchNorm1d(5, momentum=0.3, affine=affine, track_running_stats=track),
        nn.Linear(5, 2),
    ).double()


def members(n: int = 3, **kwargs) -> list[nn.Module]:
    torch.manual_seed(0)
    out = [cnn(**kwargs) for _ in range(n)]
    for i, m in enumerate(out):  # members with different statistics already
        with torch.no_grad():
            for b in m.buffers():
                if b.is_floating_point():
                    b.add_(0.1 * (i + 1))
    return out


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize(("affine", "track"), [(True, True), (False, False)])
def test_module_face_folds_and_equals_the_loop(train, affine, track, folded):
    modules = [m.train(train) for m in members(affine=affine, track=track)]
    loop = copy.deepcopy(modules)
    ens = fe.Ensemble(modules)
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    for _ in range(2):  # the second call sees the statistics the first one updated
        out = ens(x)
        ref = torch.stack([m(x) for m in loop])
        torch.testing.assert_close(out, ref, **TOL)
    assert folded and all(folded)
    for name, buf in ens.stacked_buffers().items():
        torch.testing.assert_close(buf, torch.stack([dict(m.named_buffers())[name] for m in loop]))
    out.sum().backward()
    ref.sum().backward()
    for name, p in ens.stacked_params().items():
        expected = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
        torch.testing.assert_close(p.grad, expected, **TOL)


def test_value_and_grad_folds_per_member_batches(folded):
    modules = [m.train() for m in members()]
    loop = copy.deepcopy(modules)
    fmodel, params, buffers = fe.stack(modules)
    xs = torch.randn(3, 6, 3, 6, 6, dtype=torch.float64)

    def loss_fn(p, b, x):
        return fmodel(p, b, x).pow(2).mean()

    losses, grads, new_buffers = fe.value_and_grad(loss_fn, in_dims=0)(params, buffers, xs)
    assert folded and all(folded)
    for i, m in enumerate(loop):
        loss = m(xs[i]).pow(2).mean()
        loss.backward()
        torch.testing.assert_close(losses[i], loss.detach(), **TOL)
        for name, p in m.named_parameters():
            torch.testing.assert_close(grads[name][i], p.grad, **TOL)
        for name, b in m.named_buffers():
            torch.testing.assert_close(new_buffers[name][i], b)


def test_a_shared_input_into_batch_norm_is_left_to_vmap(folded):
    # The input is not batched (every member sees the same tensor): vmap's rule runs.
    torch.manual_seed(1)
    modules = [nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2)).double() for _ in range(3)]
    loop = copy.deepcopy(modules)
    ens = fe.Ensemble(modules)
    x = torch.randn(8, 4, dtype=torch.float64)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]), **TOL)
    assert folded == [False]


# --- a call that fails changes nothing -------------------------------------------------


def failing_members(n: int = 3, momentum: float | None = 0.1) -> list[nn.Module]:
    """A CNN whose Linear accepts 6x6 images only: on 7x7 it raises after both BatchNorms."""
    torch.manual_seed(0)
    out = []
    for _ in range(n):
        m = nn.Sequential(
            nn.BatchNorm2d(3, momentum=momentum),
            nn.Conv2d(3, 4, 3),
            nn.BatchNorm2d(4, momentum=momentum),
            nn.Flatten(),
            nn.Linear(4 * 4 * 4, 2),
        ).double()
        with torch.no_grad():
            for b in m.buffers():
                b.add_(torch.randint(1, 5, ()).to(b.dtype))
        out.append(m)
    return out


def _loss(fmodel):
    return lambda p, b, x: fmodel(p, b, x).pow(2).mean()


def _ensemble(**kwargs):
    def face(members, dims):
        ens = fe.Ensemble(members, **kwargs)
        return lambda x: ens(x, in_dims=dims), ens.stacked_params(), ens.stacked_buffers()

    return face


def _functional(transform, **kwargs):
    def face(members, dims):
        fmodel, params, buffers = fe.stack(members)
        mapped = transform(fmodel, dims, **kwargs)
        return lambda x: mapped(params, buffers, x), params, buffers

    return face


# Each face: (members, in_dims) -> (call(x), live parameters, live buffers).
FACES = {
    "Ensemble": _ensemble(),
    "Ensemble, chunked": _ensemble(chunk_size=2),
    "vmap": _functional(lambda f, dims, **kw: fe.vmap(f, dims, **kw)),
    "vmap, chunked": _functional(lambda f, dims, **kw: fe.vmap(f, dims, **kw), chunk_size=2),
    "vmap of a loss": _functional(lambda f, dims, **kw: fe.vmap(_loss(f), dims, **kw)),
    "value_and_grad": _functional(lambda f, dims, **kw: fe.value_and_grad(_loss(f), dims, **kw)),
    "value_and_grad, chunked": _functional(
        lambda f, dims, **kw: fe.value_and_grad(_loss(f), dims, **kw), chunk_size=2
    ),
}
_SHAPE_ERROR = (
    r"shapes cannot be multiplied|Expected size for first two dimensions|expects \d+ input features"
)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("per_member", [False, True])
@pytest.mark.parametrize("face", sorted(FACES))
def test_a_failed_forward_leaves_the_running_statistics(face, per_member, momentum):
    members = failing_members(momentum=momentum)
    loop = copy.deepcopy(members)
    call, params, buffers = FACES[face](members, 0 if per_member else None)
    lead = (3, 5) if per_member else (5,)
    before = copy.deepcopy((params, buffers))
    with pytest.raises((RuntimeError, ValueError), match=_SHAPE_ERROR):
        call(torch.randn(*lead, 3, 7, 7, dtype=torch.float64))
    for kind, old, new in zip(("parameter", "buffer"), before, (params, buffers), strict=True):
        for name in old:
            assert torch.equal(new[name], old[name]), f"{face}: {kind} `{name}` changed"
    # The next good call sees the loop's statistics: the failed one left no trace.
    x = torch.randn(*lead, 3, 6, 6, dtype=torch.float64)
    got = call(x)
    expected = torch.stack([m(x[i] if per_member else x) for i, m in enumerate(loop)])
    if face.startswith("value_and_grad"):
        got, buffers = got[0], got[2]
    if "loss" in face or face.startswith("value_and_grad"):
        expected = expected.pow(2).mean(dim=tuple(range(1, expected.dim())))
    torch.testing.assert_close(got, expected.detach(), **TOL)
    for name, buf in buffers.items():
        torch.testing.assert_close(buf, torch.stack([dict(m.named_buffers())[name] for m in loop]))


# --- momentum=None: the cumulative moving average, as the loop computes it ---------------


def cumulative_members(n: int, counts: str, dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(2)
    out = [cnn().to(dtype) for _ in range(n)]
    for i, m in enumerate(out):
        for layer in (m[1], m[5]):
            layer.momentum = None
            if counts == "different":  # e.g. members restored from different runs
                layer.num_batches_tracked.fill_(3 * i)
    return out


CUMULATIVE_TOL = {torch.float64: TOL, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("counts", ["same", "different"])
@pytest.mark.parametrize("per_member", [False, True])
@pytest.mark.parametrize("face", ["Ensemble", "Ensemble, chunked", "vmap", "value_and_grad"])
def test_momentum_none_equals_the_loop_over_steps(face, per_member, counts, dtype):
    members = cumulative_members(3, counts, dtype)
    loop = copy.deepcopy(members)
    dims = 0 if per_member else None
    tol = CUMULATIVE_TOL[dtype]
    if face.startswith("Ensemble"):
        ens = fe.Ensemble(members, chunk_size=2 if "chunked" in face else None)
        buffers = ens.stacked_buffers()
    else:
        fmodel, params, buffers = fe.stack(members)
    for step in range(4):
        x = torch.randn(*((3, 6) if per_member else (6,)), 3, 6, 6, dtype=dtype)
        outs = [m(x[i] if per_member else x) for i, m in enumerate(loop)]
        if face.startswith("Ensemble"):
            got, expected = ens(x, in_dims=dims), torch.stack(outs)
        elif face == "vmap":
            got, expected = fe.vmap(fmodel, dims)(params, buffers, x), torch.stack(outs)
        else:
            loss_fn = lambda p, b, x: fmodel(p, b, x).pow(2).mean()  # noqa: E731
            got, grads, buffers = fe.value_and_grad(loss_fn, dims)(params, buffers, x)
            losses = [o.pow(2).mean() for o in outs]
            expected = torch.stack(losses).detach()
            for loss in losses:
                loss.backward()
            for name, g in grads.items():
                want = torch.stack([dict(m.named_parameters())[name].grad for m in loop])
                torch.testing.assert_close(g, want, **tol, msg=f"step {step}: grad {name}")
            for m in loop:
                m.zero_grad()
        torch.testing.assert_close(got, expected, **tol, msg=f"step {step}: outputs")
        for name, buf in buffers.items():
            want = torch.stack([dict(m.named_buffers())[name] for m in loop])
            torch.testing.assert_close(buf, want, **tol, msg=f"step {step}: {name}")
    assert buffers["1.num_batches_tracked"].tolist() == (
        [4] * 3 if counts == "same" else [4, 7, 10]
    )
    # In eval mode the running averages are what normalizes: still the loop's.
    x = torch.randn(5, 3, 6, 6, dtype=dtype)
    for m in loop:
        m.eval()
    if face.startswith("Ensemble"):
        got = ens.eval()(x)
    else:
        fmodel.skeleton.eval()
        got = fe.vmap(fmodel)(params, buffers, x)
    torch.testing.assert_close(got, torch.stack([m(x) for m in loop]).detach(), **tol)


def test_momentum_none_with_different_counts_inside_another_transform_is_refused():
    # fe.value_and_grad inside another torch.func transform takes torch.func.grad, whose
    # layer hides the per-member counts from the BatchNorm: refused, not guessed.
    members = cumulative_members(3, "different", torch.float64)
    fmodel, params, buffers = fe.stack(members)
    loss_fn = lambda p, b, x: fmodel(p, b, x).pow(2).mean()  # noqa: E731
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    before = copy.deepcopy(buffers)

    def outer(scale):
        return fe.value_and_grad(loss_fn)(params, buffers, x * scale)[0].sum()

    with pytest.raises(
        RuntimeError,
        match=r"BatchNorm `1` has momentum=None \(a cumulative moving average\) and members "
        r"with different num_batches_tracked \((\[1, 4, 7\]|not readable inside this transform)\), "
        r"inside a torch.func transform",
    ):
        torch.func.grad(outer)(torch.tensor(1.0, dtype=torch.float64))
    for name, buf in buffers.items():
        assert torch.equal(buf, before[name]), name
    # With one count for all members the same nesting runs.
    for layer in (fmodel.skeleton[1], fmodel.skeleton[5]):
        assert layer.momentum is None
    same = fe.stack(cumulative_members(3, "same", torch.float64))[2]
    torch.func.grad(lambda s: fe.value_and_grad(loss_fn)(params, same, x * s)[0].sum())(
        torch.tensor(1.0, dtype=torch.float64)
    )


class ReadsItsCount(nn.Module):
    """A forward that reads a cumulative BatchNorm's count itself, before or after it."""

    def __init__(self, after: bool) -> None:
        super().__init__()
        self.after = after
        self.lin = nn.Linear(4, 3, bias=False)
        self.bn = nn.BatchNorm1d(3, momentum=None)

    def forward(self, x):
        if self.after:
            return self.bn(self.lin(x)) + 0.1 * float(self.bn.num_batches_tracked)
        return self.bn(self.lin(x)) * (1 + self.bn.num_batches_tracked.item())


class ScalesByItsCount(nn.BatchNorm1d):
    """A BatchNorm subclass reading its own count in its own forward."""

    def forward(self, x):
        t = float(self.num_batches_tracked)
        return super().forward(x) * min(1.0, (t + 1) / 10)


class WithOwnNorm(nn.Module):
    def __init__(self, after: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3, bias=False)
        self.bn = ScalesByItsCount(3, momentum=None)

    def forward(self, x):
        return self.bn(self.lin(x))


@pytest.mark.parametrize("model", [ReadsItsCount, WithOwnNorm])
@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("counts", ["same", "different"])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_a_forward_reading_a_cumulative_count_equals_the_loop_or_is_refused(
    model, after, counts, chunk_size
):
    """Each member of the loop reads its own count; one vectorized call has one number
    (it gave NaN outputs for members counting differently)."""
    torch.manual_seed(0)
    members = [model(after).double() for _ in range(3)]
    for i, m in enumerate(members):
        m.bn.num_batches_tracked.fill_(i + 1 if counts == "different" else 5)
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members, chunk_size=chunk_size)
    before = {k: v.clone() for k, v in ens.stacked_buffers().items()}
    x = torch.randn(6, 4, dtype=torch.float64)
    if counts == "same":
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]), **TOL)
        for name, buf in ens.stacked_buffers().items():
            want = torch.stack([dict(m.named_buffers())[name] for m in loop])
            torch.testing.assert_close(buf, want, **TOL, msg=name)
        return
    with pytest.raises(
        RuntimeError,
        match=r"forward reads float\(\) or \.item\(\) of BatchNorm `bn`'s num_batches_tracked, "
        r"and its members count differently \(\[[\d, ]+\]\)",
    ):
        ens(x)
    for name, buf in ens.stacked_buffers().items():
        assert torch.equal(buf, before[name]), name


@pytest.mark.parametrize("layer", [nn.SyncBatchNorm, nn.LazyBatchNorm1d])
def test_batch_norms_reading_their_own_count_in_their_own_forward_equal_the_loop(layer):
    """SyncBatchNorm (on the CPU, without a process group, F.batch_norm) reads its count
    with .item() in its own forward: members counting differently were refused as if a
    user had read it (the first version of that refusal)."""
    torch.manual_seed(0)
    width = 3
    members = []
    for i in range(3):
        norm = layer(width, momentum=None) if layer is nn.SyncBatchNorm else layer(momentum=None)
        m = nn.Sequential(nn.Linear(4, width, bias=False), norm).double()
        m(torch.randn(2, 4, dtype=torch.float64))  # a lazy layer takes its width
        m[1].num_batches_tracked.fill_(i + 1)
        members.append(m)
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members)
    x = torch.randn(6, 4, dtype=torch.float64)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]), **TOL)
    for name, buf in ens.stacked_buffers().items():
        want = torch.stack([dict(m.named_buffers())[name] for m in loop])
        torch.testing.assert_close(buf, want, **TOL, msg=name)


def test_a_failed_forward_leaves_instance_norm_statistics():
    torch.manual_seed(0)
    members = [
        nn.Sequential(
            nn.InstanceNorm1d(3, track_running_stats=True), nn.Flatten(), nn.Linear(15, 2)
        ).double()
        for _ in range(3)
    ]
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members)
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in loop]), **TOL)
    before = copy.deepcopy(ens.stacked_buffers())
    assert not torch.equal(before["0.running_mean"], torch.zeros(3, 3, dtype=torch.float64))
    with pytest.raises((RuntimeError, ValueError), match=_SHAPE_ERROR):
        ens(torch.randn(4, 3, 6, dtype=torch.float64))  # the Linear expects 15 features
    for name, buf in ens.stacked_buffers().items():
        assert torch.equal(buf, before[name]), name


def test_one_value_per_channel_in_training_is_refused_in_one_members_sizes():
    members = [torch.nn.BatchNorm1d(3) for _ in range(4)]
    with pytest.raises(ValueError) as loop_error:
        members[0](torch.randn(1, 3))
    before = {k: v.clone() for k, v in fe.Ensemble(members).state_dict().items()}
    ens = fe.Ensemble(members)
    with pytest.raises(ValueError) as ours:
        ens(torch.randn(1, 3))
    assert str(ours.value).startswith(str(loop_error.value))  # [1, 3], not [1, 12]
    assert all(torch.equal(ens.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("face", ["module", "vmap", "hetero"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_updates_the_statistics_as_the_loop(face, reentrant):
    """``torch.utils.checkpoint`` recomputes the forward during backward, and the loop's
    BatchNorm updates its statistics again there. Non-reentrant checkpointing stops that
    recomputation by raising once backward has what it needs: the statistics updated so
    far stay updated (the rollback of a failed call must not take it for a failure)."""
    from torch.utils.checkpoint import checkpoint

    modules = [m.train() for m in members()]
    if face == "hetero":  # two groups: one with another momentum
        modules[1][1].momentum = 0.5
    loop = copy.deepcopy(modules)
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    if face == "vmap":
        fmodel, params, buffers = fe.stack(modules)
        params = {k: v.detach().requires_grad_() for k, v in params.items()}
        forward = fe.vmap(fmodel)
        out = checkpoint(lambda p, x: forward(p, buffers, x), params, x, use_reentrant=reentrant)
        state = lambda: buffers  # noqa: E731
    else:
        ens = fe.HeteroEnsemble(modules) if face == "hetero" else fe.Ensemble(modules)
        out = checkpoint(ens, x, use_reentrant=reentrant)
        state = lambda: dict(ens.stacked.named_buffers()) if face == "module" else None  # noqa: E731
    out.pow(2).sum().backward()
    for m in loop:
        checkpoint(m, x, use_reentrant=reentrant).pow(2).sum().backward()
    if face == "hetero":
        for got, want in zip(ens.unstack(), loop, strict=True):
            for (name, b), (_, w) in zip(got.named_buffers(), want.named_buffers(), strict=True):
                torch.testing.assert_close(b, w, **TOL, msg=name)
        return
    for name, b in state().items():
        want = torch.stack([dict(m.named_buffers())[name] for m in loop])
        torch.testing.assert_close(b, want, **TOL, msg=name)
    assert state()["1.num_batches_tracked"].tolist() == [2, 2, 2]


def test_statistics_updated_under_a_vmap_of_your_own_name_the_buffer_not_only_an_input():
    """A torch.func.vmap of the user's around fe.vmap of train-mode BatchNorm members
    with momentum=None and different counts: the in-place update of the statistics,
    shared by the outer vmap's entries, was blamed on a shared input changed in place
    (nn.Dropout(inplace=True)), which the forward does not have."""
    members = cumulative_members(3, "different", torch.float64)
    fmodel, params, buffers = fe.stack(members)
    before = copy.deepcopy(buffers)
    xs = torch.randn(2, 6, 3, 6, 6, dtype=torch.float64)
    with pytest.raises(
        RuntimeError,
        match=r"one of the vmap levels around it does not batch.*BatchNorm's running statistics",
    ):
        torch.func.vmap(lambda x: fe.vmap(fmodel)(params, buffers, x))(xs)
    for name, buf in buffers.items():
        assert torch.equal(buf, before[name]), name
