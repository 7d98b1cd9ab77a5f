"""fe.value_and_grad / fe.grad against torch.autograd.grad on each module, one at a time."""

import copy
import weakref

import pytest
import torch
from helpers import Snapshot
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import funcensemble as fe

TOL = {"rtol": 1e-10, "atol": 1e-12}


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        self.unused = nn.Parameter(torch.randn(3))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def make_members(n: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [WithUnused().double() for _ in range(n)]


def loop_reference(modules, xs, ys, per_member: bool):
    losses, grads = [], []
    for i, m in enumerate(modules):
        x, y = (xs[i], ys[i]) if per_member else (xs, ys)
        loss = F.mse_loss(m(x), y)
        names = [k for k, _ in m.named_parameters()]
        g = torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)
        losses.append(loss.detach())
        grads.append(dict(zip(names, g, strict=True)))
    return torch.stack(losses), grads


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("per_member", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_value_and_grad_matches_loop(n, per_member, chunk_size):
    modules = make_members(n)
    fmodel, params, buffers = fe.stack(modules)
    before = {k: v.clone() for k, v in buffers.items()}
    shape = (n, 16) if per_member else (16,)
    xs = torch.randn(*shape, 4, dtype=torch.float64)
    ys = torch.randn(*shape, 1, dtype=torch.float64)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    in_dims = 0 if per_member else None
    step = fe.value_and_grad(loss_fn, in_dims, chunk_size=chunk_size)
    losses, grads, new_buffers = step(params, buffers, xs, ys)

    ref_losses, ref_grads = loop_reference(modules, xs, ys, per_member)
    torch.testing.assert_close(losses, ref_losses, **TOL)
    for i in range(n):
        for name, g in ref_grads[i].items():
            if g is None:
                assert grads[name] is None, name
            else:
                torch.testing.assert_close(grads[name][i], g, **TOL)
    # The loop's forward updated each module's BatchNorm statistics: so did ours, in a
    # fresh buffers dict, while the input buffers stay untouched (pure step).
    for name, t in before.items():
        assert torch.equal(buffers[name], t)
        ref = torch.stack([dict(m.named_buffers())[name] for m in modules])
        torch.testing.assert_close(new_buffers[name], ref, **TOL)
    assert new_buffers["body.1.num_batches_tracked"].tolist() == [1] * n
    assert losses.grad_fn is None and not any(
        g is not None and g.grad_fn is not None for g in grads.values()
    )


def test_grad_has_aux_and_kwargs():
    modules = make_members(3)
    fmodel, params, buffers = fe.stack(modules)
    x = torch.randn(8, 4, dtype=torch.float64)

    def loss_fn(p, b, x, *, target):
        out = fmodel(p, b, x)
        return (out - target).pow(2).mean(), {"out": out}

    grads, _, aux = fe.grad(loss_fn, has_aux=True)(params, buffers, x, target=1.0)
    assert aux["out"].shape == (3, 8, 1)
    assert aux["out"].grad_fn is None
    ref = [torch.autograd.grad((m(x) - 1.0).pow(2).mean(), m.scale)[0] for m in modules]
    torch.testing.assert_close(grads["scale"], torch.stack(ref), **TOL)


def test_functorch_path_matches_autograd_path():
    """Inside another torch.func transform fe.grad switches to torch.func.grad."""
    modules = make_members(3)
    for m in modules:
        m.eval()
    fmodel, params, buffers = fe.stack(modules)
    x = torch.randn(8, 4, dtype=torch.float64)

    def loss_fn(p, b, x):
        return fmodel(p, b, x).pow(2).mean()

    _, eager, _ = fe.value_and_grad(loss_fn)(params, buffers, x)

    def via_transform(x):
        losses, grads, _ = fe.value_and_grad(loss_fn)(params, buffers, x)
        return grads["body.0.weight"], losses

    # jacrev needs no grads of x here; vmap over a batch of one input is the simplest
    # enclosing transform.
    nested, _ = torch.func.vmap(via_transform)(x.unsqueeze(0))
    torch.testing.assert_close(nested[0], eager["body.0.weight"], **TOL)
    # torch.func.grad reports unused parameters as zeros, not None.
    _, grads_t, _ = torch.func.vmap(lambda x: fe.value_and_grad(loss_fn)(params, buffers, x))(
        x.unsqueeze(0)
    )
    assert torch.equal(grads_t["unused"], torch.zeros(1, 3, 3, dtype=torch.float64))
    assert eager["unused"] is None


def test_losses_must_be_scalar_per_member():
    fmodel, params, buffers = fe.stack([nn.Linear(2, 2) for _ in range(2)])
    step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x))
    with pytest.raises(
        ValueError, match=r"one scalar per member \(expected shape \(\) per member, got \(5, 2\)"
    ):
        step(params, buffers, torch.randn(5, 2))


def test_adam_training_step_matches_loop():
    """fe.value_and_grad drives torch.optim.Adam on the stacked leaves like the loop."""
    # No BatchNorm here: a bias right before BatchNorm has a gradient of pure round-off,
    # which Adam's normalisation blows up to +-lr, so no tolerance would be meaningful.
    torch.manual_seed(0)
    modules = [
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double() for _ in range(3)
    ]
    clones = copy.deepcopy(modules)
    fmodel, params, buffers = fe.stack(clones)
    opt = torch.optim.Adam(params.values(), lr=1e-2)
    ref_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in modules]
    x = torch.randn(16, 4, dtype=torch.float64)
    y = torch.randn(16, 1, dtype=torch.float64)
    step = fe.value_and_grad(lambda p, b, x, y: F.mse_loss(fmodel(p, b, x), y))
    for _ in range(5):
        _, grads, buffers = step(params, buffers, x, y)
        for k, p in params.items():
            p.grad = grads[k]
        opt.step()
        for m, o in zip(modules, ref_opts, strict=True):
            o.zero_grad(set_to_none=True)
            F.mse_loss(m(x), y).backward()
            o.step()
    for k, p in params.items():
        ref = torch.stack([dict(m.named_parameters())[k].detach() for m in modules])
        torch.testing.assert_close(p.detach(), ref, rtol=1e-9, atol=1e-10)


# -- chunk_size: forward and backward chunk by chunk -----------------------------------


def _loop_with_aux(modules, xs, ys):
    """Each module's own loss, grads (None if unused), aux output and BatchNorm buffers."""
    losses, grads, outs = [], [], []
    for m, x, y in zip(modules, xs, ys, strict=True):
        out = m(x)
        loss = F.mse_loss(out, y)
        names = [k for k, _ in m.named_parameters()]
        g = torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)
        losses.append(loss.detach())
        grads.append(dict(zip(names, g, strict=True)))
        outs.append(out.detach())
    buffers = {
        k: torch.stack([dict(m.named_buffers())[k] for m in modules])
        for k, _ in modules[0].named_buffers()
    }
    return torch.stack(losses), grads, torch.stack(outs), buffers


# (in_dims, how the batch is passed): shared, per member, mixed, a nested pytree argument.
_LAYOUTS = {
    "shared": None,
    "per-member": 0,
    "mixed": (0, None),
    "pytree": ({"x": 0, "y": None},),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 8])
def test_chunked_value_and_grad_matches_unchunked_and_loop(layout, chunk_size):
    n = 5
    modules = make_members(n)
    fmodel, params, buffers = fe.stack(copy.deepcopy(modules))
    before = {k: v.clone() for k, v in buffers.items()}
    per_member_x = layout != "shared"
    per_member_y = layout == "per-member"
    x = torch.randn(*((n,) if per_member_x else ()), 12, 4, dtype=torch.float64)
    y = torch.randn(*((n,) if per_member_y else ()), 12, 1, dtype=torch.float64)
    xs = list(x) if per_member_x else [x] * n
    ys = list(y) if per_member_y else [y] * n

    def loss_fn(p, b, x, y):
        out = fmodel(p, b, x)
        return F.mse_loss(out, y), {"out": out}

    if layout == "pytree":
        args = ({"x": x, "y": y},)
        fn = lambda p, b, batch: loss_fn(p, b, batch["x"], batch["y"])  # noqa: E731
    else:
        args, fn = (x, y), loss_fn
    in_dims = _LAYOUTS[layout]
    chunked = fe.value_and_grad(fn, in_dims, has_aux=True, chunk_size=chunk_size)
    whole = fe.value_and_grad(fn, in_dims, has_aux=True)
    losses, grads, new_buffers, aux = chunked(params, buffers, *args)
    w_losses, w_grads, w_buffers, w_aux = whole(params, buffers, *args)
    ref_losses, ref_grads, ref_out, ref_buffers = _loop_with_aux(modules, xs, ys)

    torch.testing.assert_close(losses, ref_losses, **TOL)
    torch.testing.assert_close(losses, w_losses, **TOL)
    torch.testing.assert_close(aux["out"], ref_out, **TOL)
    torch.testing.assert_close(aux["out"], w_aux["out"], **TOL)
    assert grads["unused"] is None and w_grads["unused"] is None
    for name in params:
        if name == "unused":
            continue
        ref = torch.stack([g[name] for g in ref_grads])
        torch.testing.assert_close(grads[name], ref, **TOL)
        torch.testing.assert_close(grads[name], w_grads[name], **TOL)
    for name, t in before.items():
        assert torch.equal(buffers[name], t)  # the input buffers stay untouched
        torch.testing.assert_close(new_buffers[name], ref_buffers[name], **TOL)
        torch.testing.assert_close(new_buffers[name], w_buffers[name], **TOL)
    assert losses.grad_fn is None and aux["out"].grad_fn is None
    assert all(g is None or g.grad_fn is None for g in grads.values())


def test_chunked_grad_fills_a_chunk_that_left_a_parameter_unused_with_zeros():
    """A loss that (pathologically) uses a parameter in one chunk only."""
    modules = make_members(5)
    for m in modules:
        m.eval()
    fmodel, params, buffers = fe.stack(modules)
    calls = []

    def loss_fn(p, b, x):
        calls.append(None)  # traced once per chunk
        loss = fmodel(p, b, x).pow(2).mean()
        return loss + p["unused"].sum() if len(calls) == 2 else loss

    grads, _ = fe.grad(loss_fn, chunk_size=2)(
        params, buffers, torch.randn(6, 4, dtype=torch.float64)
    )
    assert len(calls) == 3
    expected = torch.zeros(5, 3, dtype=torch.float64)
    expected[2:4] = 1.0
    assert torch.equal(grads["unused"], expected)


def _dropout_members(n):
    torch.manual_seed(0)
    member = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1)).double()
    return [copy.deepcopy(member) for _ in range(n)]  # equal members: only the masks differ


def test_chunked_randomness_different_draws_what_chunked_vmap_draws():
    fmodel, params, buffers = fe.stack(_dropout_members(5))
    x = torch.randn(8, 4, dtype=torch.float64)

    def loss_fn(p, b, x):
        return fmodel(p, b, x).pow(2).mean()

    torch.manual_seed(1)
    losses, _, _ = fe.value_and_grad(loss_fn, chunk_size=2)(params, buffers, x)
    after = torch.rand(3)
    torch.manual_seed(1)
    expected = fe.vmap(loss_fn, chunk_size=2)(params, buffers, x)
    assert torch.equal(losses, expected)
    assert torch.equal(after, torch.rand(3))
    assert len(set(losses.tolist())) == 5  # independent masks


def test_chunked_randomness_same_shares_one_draw_across_chunks():
    fmodel, params, buffers = fe.stack(_dropout_members(5))
    x = torch.randn(8, 4, dtype=torch.float64)

    def loss_fn(p, b, x):
        return fmodel(p, b, x).pow(2).mean()

    torch.manual_seed(1)
    losses, grads, _ = fe.value_and_grad(loss_fn, randomness="same", chunk_size=2)(
        params, buffers, x
    )
    after = torch.rand(3)
    torch.manual_seed(1)
    w_losses, w_grads, _ = fe.value_and_grad(loss_fn, randomness="same")(params, buffers, x)
    torch.testing.assert_close(losses, w_losses, **TOL)
    torch.testing.assert_close(losses, losses[:1].expand(5), **TOL)
    torch.testing.assert_close(grads["0.weight"], w_grads["0.weight"], **TOL)
    assert torch.equal(after, torch.rand(3))  # the generator moved as for one draw
    with pytest.raises(RuntimeError, match="randomness='error'"):
        fe.value_and_grad(loss_fn, randomness="error", chunk_size=2)(params, buffers, x)


def test_chunked_errors_as_unchunked():
    fmodel, params, buffers = fe.stack([nn.Linear(2, 1) for _ in range(4)])

    def loss_fn(p, b, x):
        return fmodel(p, b, x).pow(2).mean()

    for chunk_size in (None, 3):
        step = fe.value_and_grad(loss_fn, 0, chunk_size=chunk_size)
        with pytest.raises(
            ValueError, match="has size 3 along its member dim 0, but the ensemble has 4"
        ):
            step(params, buffers, torch.randn(3, 5, 2))
        with pytest.raises(ValueError, match="in_dims has 2 entries"):
            fe.value_and_grad(loss_fn, (0, None), chunk_size=chunk_size)(
                params, buffers, torch.randn(4, 5, 2)
            )
        not_scalar = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x), chunk_size=chunk_size)
        with pytest.raises(
            ValueError,
            match=r"one scalar per member \(expected shape \(\) per member, got \(5, 1\)",
        ):
            not_scalar(params, buffers, torch.randn(5, 2))


class PeakLiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors allocated while the mode is active.

    Deterministic, unlike the process's RSS: every op's fresh output storage is
    counted until it is freed (views and in-place results share an input's storage
    and are not counted again).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._counted:
                continue
            self._counted.add(key)
            self.live += storage.nbytes()
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def test_chunk_size_bounds_the_memory_of_a_training_step():
    """With k of N members at a time, a step's intermediates are about k/N as large.

    The activations (64 rows x 256 hidden, per member) dominate; the gradients that
    come out are the same for every chunk size. Autograd through one chunked forward
    (all chunks' saved tensors alive until the backward) peaks at about 0.4x here.
    """
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 256), nn.ReLU(), nn.Linear(256, 1)) for _ in range(16)]
    fmodel, params, buffers = fe.stack([m.double() for m in members])
    x = torch.randn(64, 4, dtype=torch.float64)

    def loss_fn(p, b, x):
        return fmodel(p, b, x).pow(2).mean()

    peaks = {}
    for chunk_size in (None, 2):
        with PeakLiveBytes() as tracked:
            losses, grads, _ = fe.value_and_grad(loss_fn, chunk_size=chunk_size)(params, buffers, x)
        peaks[chunk_size] = tracked.peak
        grad_bytes = sum(g.nbytes for g in grads.values())
        del losses, grads
    assert peaks[2] < peaks[None] / 4, peaks
    assert peaks[2] > grad_bytes  # it did see the step


# -- errors that name the argument -----------------------------------------------------


@pytest.mark.parametrize("path", ["plain", "chunked", "inside a transform"])
def test_has_aux_without_a_pair_is_a_clear_error(path):
    fmodel, params, buffers = fe.stack([nn.Linear(2, 1) for _ in range(3)])
    x = torch.randn(5, 2)
    chunk_size = 2 if path == "chunked" else None

    def run(loss_fn):
        step = fe.value_and_grad(loss_fn, has_aux=True, chunk_size=chunk_size)
        if path == "inside a transform":
            return torch.func.vmap(lambda x: step(params, buffers, x)[0])(x.unsqueeze(0))
        return step(params, buffers, x)

    with pytest.raises(
        TypeError,
        match=r"has_aux=True loss_fn must return a pair \(loss, aux\), got a single Tensor",
    ):
        run(lambda p, b, x: fmodel(p, b, x).pow(2).mean())
    with pytest.raises(
        ValueError, match=r"must return a pair \(loss, aux\), got a tuple of 3 values"
    ):
        run(lambda p, b, x: (fmodel(p, b, x).pow(2).mean(), x, x))


@pytest.mark.parametrize("argument", ["params", "buffers"])
@pytest.mark.parametrize("function", [fe.value_and_grad, fe.grad])
def test_params_or_buffers_not_a_dict_is_a_type_error(argument, function):
    fmodel, params, buffers = fe.stack([nn.BatchNorm1d(2) for _ in range(3)])
    state = {"params": params, "buffers": buffers}
    state[argument] = list(state[argument].values())
    step = function(lambda p, b, x: fmodel(p, b, x).pow(2).mean())
    with pytest.raises(
        TypeError,
        match=rf"{function.__name__}: {argument} must be a dict of stacked tensors "
        r".*\(expected a dict, got list\)",
    ):
        step(state["params"], state["buffers"], torch.randn(5, 2))


def test_wrong_input_width_inside_value_and_grad_names_the_layer():
    """The general path (BatchNorm): the layer by its state-dict path, not GEMM shapes."""
    modules = make_members(3)
    fmodel, params, buffers = fe.stack(modules)
    step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).pow(2).mean())
    with pytest.raises(
        ValueError,
        match=r"layer `body.0` .*expected an input of shape \(\.\.\., 4\), got \(\.\.\., 3\)",
    ):
        step(params, buffers, torch.randn(8, 3, dtype=torch.float64))


def test_gradients_come_in_the_parameters_layout_and_update_in_place_as_the_module_face():
    """A parameter concatenated along a later dim gets a strided gradient from autograd;
    value_and_grad hands it over contiguous, as ``.grad`` is (autograd's layout
    contract), so ``update_`` runs the fused kernel as ``EnsembleOptimizer`` does."""

    class Halves(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.left = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
            self.right = torch.nn.Parameter(torch.randn(4, 2, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x @ torch.cat([self.left, self.right], dim=1))

    torch.manual_seed(0)
    members = [Halves() for _ in range(3)]
    ens = fe.Ensemble(copy.deepcopy(members))
    ens_opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(1e-2))
    fmodel, params, buffers = fe.stack(members)
    params = {k: v.detach() for k, v in params.items()}
    opt = fe.optim.adam(1e-2)
    state = opt.init(params)
    step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).pow(2).mean())
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(3):
        _, grads, _ = step(params, buffers, x)
        assert all(g.is_contiguous() for g in grads.values())
        state = opt.update_(grads, state, params)
        ens_opt.zero_grad()
        ens(x).pow(2).mean(dim=(1, 2)).sum().backward()
        ens_opt.step()
    for k, v in ens.stacked.named_parameters():
        assert torch.equal(v.detach(), params[k]), k


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_a_complex_loss_is_refused_as_torch_autograd_refuses_it(chunk_size):
    """A complex loss was differentiated as its real part (torch.autograd.grad refuses
    it: 'grad can be implicitly created only for real scalar outputs')."""
    fmodel, params, buffers = fe.stack([nn.Linear(3, 2) for _ in range(3)])
    step = fe.value_and_grad(
        lambda p, b, x: fmodel(p, b, x).sum() * (1 + 2j), chunk_size=chunk_size
    )
    with pytest.raises(ValueError, match=r"returned a complex64 loss .* \(\.abs\(\), \.real\)"):
        step(params, buffers, torch.randn(4, 3))


def test_an_integer_loss_is_refused_inside_a_transform_too():
    """Inside torch.func.vmap (and under torch.compile) an integer loss (a count of
    errors) came back with all-zero gradients; eagerly it was refused."""
    fmodel, params, buffers = fe.stack([nn.Linear(3, 2) for _ in range(3)])
    step = fe.value_and_grad(lambda p, b, x: (fmodel(p, b, x).argmax(-1) != 0).sum())
    xs = torch.randn(2, 4, 3)  # two data sets
    with pytest.raises(ValueError, match=r"returned a int64 loss .* has no gradient"):
        torch.func.vmap(lambda x: step(params, buffers, x)[0])(xs)
    with pytest.raises(ValueError, match=r"returned a int64 loss"):
        step(params, buffers, xs[0])


@pytest.mark.parametrize(("chunk_size", "runs"), [(None, 1), (2, 2), (3, 2)])
def test_side_effects_of_the_mapped_loss_run_once_per_call_or_chunk(chunk_size, runs):
    """chunking.md: a closure's side effects run once per call, or once per chunk, not
    once per member."""
    fmodel, params, buffers = fe.stack([nn.Linear(3, 2) for _ in range(4)])
    calls = []

    def loss_fn(p, b, x):
        calls.append(1)
        return fmodel(p, b, x).sum()

    fe.value_and_grad(loss_fn, chunk_size=chunk_size)(params, buffers, torch.randn(5, 3))
    assert len(calls) == runs


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_has_aux_with_three_values_says_to_return_a_pair(chunk_size):
    """(loss, aux, 1) was blamed on vmap's 'returned a int among its outputs'."""
    fmodel, params, buffers = fe.stack([nn.Linear(3, 1) for _ in range(3)])
    step = fe.value_and_grad(
        lambda p, b, x: (fmodel(p, b, x).sum(), x, 1), has_aux=True, chunk_size=chunk_size
    )
    with pytest.raises(ValueError, match=r"must return a pair \(loss, aux\), got a tuple of 3"):
        step(params, buffers, torch.randn(4, 3))


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_buffers_come_back_without_autograd_history(chunk_size):
    # A forward that copies a differentiable value into a buffer (no .detach()) gave
    # the returned buffers a graph, which every later step starting from them kept.
    torch.manual_seed(0)
    mods = [Snapshot().double() for _ in range(3)]
    fmodel, params, buffers = fe.stack(mods)
    x = torch.randn(4, 3, dtype=torch.float64)
    step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum(), chunk_size=chunk_size)
    for _ in range(2):
        _, grads, buffers = step(params, buffers, x)
        assert not buffers["snap"].requires_grad and buffers["snap"].grad_fn is None
        torch.testing.assert_close(buffers["snap"], 2 * params["lin.bias"])
        # d/d bias of sum(W x + b + 2 b) over 4 rows: 3 per row.
        torch.testing.assert_close(grads["lin.bias"], torch.full((3, 2), 12.0, dtype=torch.float64))


def test_value_and_grad_inside_inference_mode_says_so():
    """It blamed the loss (no trainable parameter: a .detach()?) where the caller's
    inference_mode block records nothing; under no_grad it runs."""
    fmodel, params, buffers = fe.stack([nn.Linear(3, 1) for _ in range(2)])
    step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())
    x = torch.randn(4, 3)
    with (
        torch.inference_mode(),
        pytest.raises(RuntimeError, match=r"inside torch\.inference_mode\(\)"),
    ):
        step(params, buffers, x)
    with torch.no_grad():
        assert step(params, buffers, x)[1]["weight"] is not None


@pytest.mark.parametrize("arch", ["mlp", "linear", "layer_norm"])
@pytest.mark.parametrize("face", ["ensemble", "vmap", "value_and_grad"])
def test_an_ensemble_built_under_inference_mode_is_refused_in_training(arch, face):
    """Its stacked tensors are inference tensors, which autograd cannot record: the
    loop's modules raise at their first recorded forward (or, a lone Linear on an input
    without history, give no gradient at all); the fast path's reshaped views gave only
    the last weight a gradient, and EnsembleOptimizer trained that layer alone. Refused
    before anything runs; under inference_mode or no_grad the call equals the loop."""
    make = {
        "mlp": lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
        "linear": lambda: nn.Linear(3, 2),
        "layer_norm": lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)),
    }[arch]
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    with torch.inference_mode():
        modules = [make() for _ in range(3)]
        ens = fe.Ensemble(copy.deepcopy(modules))
        fmodel, params, buffers = fe.stack(copy.deepcopy(modules))
    if face == "ensemble":
        call = lambda: ens(x)  # noqa: E731
        before = {k: v.clone() for k, v in ens.state_dict().items()}
    elif face == "vmap":
        call = lambda: fe.vmap(fmodel)(params, buffers, x)  # noqa: E731
    else:
        step = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).pow(2).mean())
        call = lambda: step(params, buffers, x)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"parameter `(0\.)?weight` is an inference tensor"):
        call()
    if face == "ensemble":
        for k, v in ens.state_dict().items():
            assert torch.equal(v, before[k]), k
    if face == "value_and_grad":
        return
    with torch.no_grad():
        want = torch.stack([m(x) for m in modules])
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            torch.testing.assert_close(call(), want)


# -- results are the caller's own tensors ------------------------------------------------


class Scaled(nn.Module):
    """A member whose loss can be one of its own tensors, or its input."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.register_buffer("count", torch.tensor(3.0))

    def forward(self, x):
        return x * self.scale


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize(
    "returns",
    [
        "parameter",
        "loss as aux",
        "buffer as aux",
        "input as aux",
        "parameter as aux",
        "closed-over tensor as aux",
    ],
)
@pytest.mark.parametrize("n", [1, 3])
def test_losses_and_aux_share_no_memory_with_the_inputs(returns, chunk_size, n):
    """The loop's torch.stack of per-member losses (and aux) is a new tensor: changing it
    in place changes no parameter, buffer, input or other result."""
    fmodel, params, buffers = fe.stack([Scaled() for _ in range(n)])
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    xs = torch.randn(n, 4)
    table = torch.arange(4.0)

    def loss_fn(p, b, x):
        loss = fmodel(p, b, x).sum()
        if returns == "parameter":
            return p["scale"]
        if returns == "loss as aux":
            return loss, loss
        if returns == "buffer as aux":
            return loss, b["count"]
        if returns == "input as aux":
            return loss, x
        if returns == "closed-over tensor as aux":  # (with one member: silently a view)
            return loss, table
        return loss, p["scale"]

    has_aux = returns != "parameter"
    step = fe.value_and_grad(loss_fn, in_dims=(0,), has_aux=has_aux, chunk_size=chunk_size)
    out = step(params, buffers, xs)
    results = [out[0], *(out[3:] if has_aux else ())]
    held = {_storage(t) for t in (*params.values(), *buffers.values(), *out[2].values(), xs, table)}
    ptrs = [_storage(t) for t in results]
    assert not held & set(ptrs), returns
    assert len(set(ptrs)) == len(ptrs), returns
    before = [t.clone() for t in (*params.values(), *out[2].values(), xs, table)]
    with torch.no_grad():
        for t in results:
            t.add_(1.0)
    after = (*params.values(), *out[2].values(), xs, table)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


_ADDED = {
    "weight_norm": (
        lambda m: torch.nn.utils.parametrizations.weight_norm(m),
        r"a parametrization \(_WeightNorm\) was added to `weight` of submodule `0`",
    ),
    "spectral_norm": (
        lambda m: torch.nn.utils.parametrizations.spectral_norm(m),
        r"a parametrization \(_SpectralNorm\) was added to `weight` of submodule `0`",
    ),
    "pruning": (
        lambda m: torch.nn.utils.prune.l1_unstructured(m, "weight", amount=0.3),
        r"pruning was added to `weight` of submodule `0`",
    ),
    # The hook-based forms (which fe.stack refuses in members) gave torch's shape errors.
    "legacy weight_norm": (
        lambda m: torch.nn.utils.weight_norm(m),
        r"torch.nn.utils.weight_norm was added to `weight` of submodule `0`.*Use "
        r"torch.nn.utils.parametrizations.weight_norm on each member",
    ),
    "legacy spectral_norm": (
        lambda m: torch.nn.utils.spectral_norm(m),
        r"torch.nn.utils.spectral_norm was added to `weight` of submodule `0`.*Use "
        r"torch.nn.utils.parametrizations.spectral_norm on each member",
    ),
}


@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated:FutureWarning")
@pytest.mark.parametrize("face", ["value_and_grad", "vmap", "torch.func.vmap", "Ensemble"])
@pytest.mark.parametrize("added", sorted(_ADDED))
def test_a_weight_transform_added_to_an_mlp_after_stacking_is_refused(face, added):
    """The MLP fast path runs only plain layers: a parametrization or pruning added to
    the stacked module after building sends the call to the check that refuses it,
    before anything runs, as for any other architecture (named before the shapes it
    changed)."""
    members = [nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)) for _ in range(3)]
    ens = fe.Ensemble(members) if face == "Ensemble" else None
    fmodel, params, buffers = fe.stack(members)
    x = torch.randn(4, 3)
    loss_fn = lambda p, b, x: fmodel(p, b, x).pow(2).mean()  # noqa: E731
    call = {
        "value_and_grad": lambda: fe.value_and_grad(loss_fn)(params, buffers, x),
        "vmap": lambda: fe.vmap(fmodel)(params, buffers, x),
        "torch.func.vmap": lambda: torch.func.vmap(fmodel, in_dims=(0, 0, None))(
            params, buffers, x
        ),
        "Ensemble": lambda: ens(x),
    }[face]
    call()  # runs before
    add, match = _ADDED[added]
    add(ens.stacked[0] if ens is not None else fmodel.skeleton[0])
    with pytest.raises(ValueError, match=match):
        call()
