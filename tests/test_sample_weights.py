"""fe.bootstrap_masks and fe.weighted_mean: each member weights its own samples of a shared
batch, against a loop where member i trains on its own weighted loss with torch.optim.Adam."""

import math

import pytest
import torch
from helpers import runtime_typecheck_off
from torch import nn

import funcensemble as fe

N, BATCH, STEPS, LR = 4, 6, 5, 0.05
TOLS = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}
EMPTY = (2, 1)  # member 2 keeps no sample at step 1


def members(dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype) for _ in range(N)]


def batches(dtype: torch.dtype, distribution: str) -> list[tuple[torch.Tensor, ...]]:
    """Per step: a shared batch (x, y) and [N, BATCH] weights, member 2 empty at step 1."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        x = torch.randn(BATCH, 3, generator=g, dtype=dtype)
        y = torch.randn(BATCH, 1, generator=g, dtype=dtype)
        w = fe.bootstrap_masks(N, BATCH, distribution=distribution, dtype=dtype, generator=g)
        if step == EMPTY[1]:
            w[EMPTY[0]] = 0
        out.append((x, y, w))
    return out


def loop_loss(per_sample: torch.Tensor, w: torch.Tensor, normalize: str) -> torch.Tensor:
    """The loop's weighted loss, written out by hand (an empty member: a zero loss)."""
    if normalize == "samples":
        return (w * per_sample).sum() / per_sample.numel()
    if w.sum() == 0:
        return (0 * per_sample).sum()
    return (w * per_sample).sum() / w.sum()


def run_loop(dtype, data, normalize):
    modules = members(dtype)
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in modules]
    losses = []
    for x, y, w in data:
        step_losses = []
        for i, (m, opt) in enumerate(zip(modules, opts, strict=True)):
            opt.zero_grad()
            loss = loop_loss((m(x) - y).pow(2).mean(-1), w[i], normalize)
            loss.backward()
            assert all(p.grad.isfinite().all() for p in m.parameters())
            opt.step()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses))
    return modules, opts, losses


def assert_matches_loop(params, mu, nu, losses, loop, dtype):
    modules, opts, loop_losses = loop
    tol = TOLS[dtype]
    for got, want in zip(losses, loop_losses, strict=True):
        torch.testing.assert_close(got, want, **tol)
    for name in params:
        ps = [m.get_parameter(name) for m in modules]
        torch.testing.assert_close(
            params[name].detach(), torch.stack([p.detach() for p in ps]), **tol
        )
        states = [o.state[p] for o, p in zip(opts, ps, strict=True)]
        torch.testing.assert_close(mu[name], torch.stack([s["exp_avg"] for s in states]), **tol)
        torch.testing.assert_close(nu[name], torch.stack([s["exp_avg_sq"] for s in states]), **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("distribution", ["bernoulli", "poisson", "multinomial"])
@pytest.mark.parametrize("normalize", ["weights", "samples"])
def test_functional_face_matches_the_loop(dtype, distribution, normalize):
    data = batches(dtype, distribution)
    loop = run_loop(dtype, data, normalize)

    fmodel, params, buffers = fe.stack(members(dtype))

    def loss_fn(p, b, x, y, w):  # one member, its own weights
        per_sample = (fmodel(p, b, x) - y).pow(2).mean(-1)
        return fe.weighted_mean(per_sample, w, normalize=normalize)

    step = fe.value_and_grad(loss_fn, in_dims=(None, None, 0))
    opt = fe.optim.adam(lr=LR)
    state = opt.init(params)
    losses = []
    for k, (x, y, w) in enumerate(data):
        step_losses, grads, buffers = step(params, buffers, x, y, w)
        if k == EMPTY[1]:
            assert step_losses[EMPTY[0]].item() == 0.0
            assert all((g[EMPTY[0]] == 0).all() for g in grads.values())
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
        losses.append(step_losses)
    assert_matches_loop(params, state[0].mu, state[0].nu, losses, loop, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_module_face_matches_the_loop(dtype):
    data = batches(dtype, "bernoulli")
    loop = run_loop(dtype, data, "weights")

    ens = fe.Ensemble(members(dtype))
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=LR))
    losses = []
    for x, y, w in data:
        opt.zero_grad()
        per_sample = (ens(x) - y).pow(2).mean(-1)  # [N, BATCH]
        per_member = fe.weighted_mean(per_sample, w, dim=1)
        per_member.sum().backward()
        opt.step()
        losses.append(per_member.detach())
    adam_state = opt.state[0]
    assert_matches_loop(ens.stacked_params(), adam_state.mu, adam_state.nu, losses, loop, dtype)


def test_an_empty_member_gets_zero_loss_and_zero_gradient_never_nan():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    weights = torch.tensor([[1.0, 0.0], [0.0, 0.0]], requires_grad=True)
    out = fe.weighted_mean(values, weights, dim=1)
    out.sum().backward()
    assert out.tolist() == [1.0, 0.0]
    assert values.grad.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert weights.grad.isfinite().all()
    # Weights that cancel to a zero sum count as empty too.
    assert fe.weighted_mean(torch.tensor([1.0, 2.0]), torch.tensor([1.0, -1.0])).item() == 0.0


def test_a_left_out_sample_does_not_enter_the_value_even_if_not_finite():
    values = torch.tensor([1.0, 3.0, math.inf, math.nan])
    weights = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert fe.weighted_mean(values, weights).item() == 2.0
    assert fe.weighted_mean(values, weights, normalize="samples").item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [None, 1, (0, 1)])
def test_normalize_samples_is_the_mean_of_the_masked_losses_bit_for_bit(dtype, dim):
    # The docstring's "what (mask * loss).mean() computes": in half precision .mean sums
    # in float32, where a float16 sum of 10,000 tens overflows to inf.
    g = torch.Generator().manual_seed(0)
    values = (torch.rand(3, 10000, generator=g) * 20).to(dtype)
    masks = (torch.rand(3, 10000, generator=g) < 0.7).to(dtype)
    got = fe.weighted_mean(values, masks, dim=dim, normalize="samples")
    expected = (masks * values).mean() if dim is None else (masks * values).mean(dim)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)
    assert got.isfinite().all()


def formula(values, weights, normalize, dim=None):
    """weighted_mean's formula, written out (for members whose weights do not sum to 0)."""
    dims = tuple(range(values.dim())) if dim is None else dim
    total = (weights * values).sum(dim=dims)
    if normalize == "samples":
        return total / math.prod(values.shape[d] for d in dims)
    return total / weights.sum(dim=dims)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("normalize", "w0"),
    [
        (normalize, w0)
        for normalize in ("weights", "samples")
        for w0 in ([1.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.5], [0.3, 1.0, 2.0, 0.7])
    ]
    # all zero: "weights" gives an empty member 0, not the formula's 0 / 0 (tested above)
    + [("samples", [0.0, 0.0, 0.0, 0.0])],
)
def test_gradients_are_the_formulas_also_at_zero_weights(dtype, normalize, w0):
    """Learning to reweight starts weights at 0: d/dweights there is the value's signal."""
    values = torch.tensor([1.0, 2.0, 5.0, -4.0], dtype=dtype, requires_grad=True)
    weights = torch.tensor(w0, dtype=dtype, requires_grad=True)
    out = fe.weighted_mean(values, weights, normalize=normalize)
    got = torch.autograd.grad(out, (values, weights))
    want = torch.autograd.grad(formula(values, weights, normalize), (values, weights))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOLS[dtype])


@pytest.mark.parametrize("normalize", ["weights", "samples"])
def test_gradients_over_several_dims_match_the_formula(normalize):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weights = fe.bootstrap_masks(12, 5, dtype=torch.float64, generator=g).view(3, 4, 5)
    weights[:, 0] = 0  # ensure zeros, but no empty member
    weights[:, 1, 0] = 1
    weights.requires_grad_(True)
    got = torch.autograd.grad(
        fe.weighted_mean(values, weights, dim=(1, 2), normalize=normalize).sum(), (values, weights)
    )
    want = torch.autograd.grad(
        formula(values, weights, normalize, dim=(1, 2)).sum(), (values, weights)
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("normalize", ["weights", "samples"])
def test_a_not_finite_loss_at_zero_weight_counts_as_a_zero_loss(normalize):
    """The docstring's one exception: an inf/NaN loss at weight 0 counts as a loss of 0,
    for the value and every gradient (its weight's: 0, or -result / sum(w))."""
    values = torch.tensor([1.0, math.inf, 5.0, math.nan], dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    out = fe.weighted_mean(values, weights, normalize=normalize)
    got_v, got_w = torch.autograd.grad(out, (values, weights))
    finite = values.detach().nan_to_num(0.0, 0.0, 0.0).requires_grad_(True)
    w = weights.detach().requires_grad_(True)
    ref = formula(finite, w, normalize)
    want_v, want_w = torch.autograd.grad(ref, (finite, w))
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(got_v, want_v, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dim", [None, 0, -1, (0,), (-1,)])
@pytest.mark.parametrize("normalize", ["weights", "samples"])
def test_a_0_dim_loss_takes_the_dims_torch_does(dim, normalize):
    """As torch.sum, a 0-dim tensor takes dim 0 and -1."""
    values, weights = torch.tensor(3.0), torch.tensor(2.0)
    want = values if normalize == "weights" else weights * values
    assert torch.equal(fe.weighted_mean(values, weights, dim=dim, normalize=normalize), want)
    kwargs = {} if dim is None else {"dim": dim}
    assert values.sum(**kwargs).shape == ()


def test_weighted_mean_matches_the_formula_over_several_dims():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    weights = torch.rand(3, 4, 5, generator=g, dtype=torch.float64)
    got = fe.weighted_mean(values, weights, dim=(1, -1))
    want = (weights * values).sum(dim=(1, 2)) / weights.sum(dim=(1, 2))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    total = fe.weighted_mean(values, weights)
    torch.testing.assert_close(total, (weights * values).sum() / weights.sum(), rtol=1e-12, atol=0)
    samples = fe.weighted_mean(values, weights, dim=2, normalize="samples")
    torch.testing.assert_close(samples, (weights * values).mean(dim=2), rtol=1e-12, atol=0)


def test_multinomial_counts_are_bootstrap_indices_and_give_the_resample_mean():
    counts = fe.bootstrap_masks(
        5, 40, distribution="multinomial", dtype=torch.float64,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    idx = fe.bootstrap_indices(5, 40, generator=torch.Generator().manual_seed(3))
    expected = torch.stack([torch.bincount(row, minlength=40) for row in idx]).double()
    assert torch.equal(counts, expected)
    losses = torch.randn(40, dtype=torch.float64)
    for i in range(5):
        torch.testing.assert_close(
            fe.weighted_mean(losses, counts[i]), losses[idx[i]].mean(), rtol=1e-12, atol=0
        )


@pytest.mark.parametrize(
    ("distribution", "p", "mean", "var"),
    [("bernoulli", 0.3, 0.3, 0.21), ("bernoulli", None, 0.5, 0.25), ("poisson", None, 1.0, 1.0)],
)
def test_mask_distributions(distribution, p, mean, var):
    g = torch.Generator().manual_seed(0)
    masks = fe.bootstrap_masks(8, 20_000, distribution=distribution, p=p, generator=g)
    assert masks.shape == (8, 20_000) and masks.dtype == torch.get_default_dtype()
    assert (masks >= 0).all() and torch.equal(masks, masks.round())
    # 160,000 draws: the sample mean is within 5 standard errors of the true mean.
    assert abs(masks.mean().item() - mean) < 5 * math.sqrt(var / masks.numel())
    assert abs(masks.var().item() - var) < 0.02
    again = fe.bootstrap_masks(
        8, 20_000, distribution=distribution, p=p, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(masks, again)


def test_p_one_keeps_everything():
    assert torch.equal(fe.bootstrap_masks(2, 5, p=1.0), torch.ones(2, 5))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_members": 0}, ValueError, "num_members must be a positive int"),
        ({"num_samples": 2.0}, TypeError, "num_samples must be a positive int"),
        ({"distribution": "gamma"}, ValueError, "unknown distribution \\(expected 'bernoulli'"),
        ({"p": 0.0}, ValueError, r"p must lie in \(0, 1\]"),
        ({"p": 1.5}, ValueError, r"p must lie in \(0, 1\]"),
        ({"p": "half"}, TypeError, "p must be a float"),
        ({"distribution": "poisson", "p": 0.5}, ValueError, "takes no p"),
        ({"dtype": torch.int64}, TypeError, "dtype must be a floating-point"),
    ],
)
def test_bootstrap_masks_refuses_bad_arguments(kwargs, error, match):
    args = {"num_members": 3, "num_samples": 4, **kwargs}
    with runtime_typecheck_off(), pytest.raises(error, match=match):
        fe.bootstrap_masks(args.pop("num_members"), args.pop("num_samples"), **args)


@pytest.mark.parametrize(
    ("values", "weights", "kwargs", "error", "match"),
    [
        (torch.ones(2, 3), torch.ones(2), {}, ValueError, "weights must have the shape of values"),
        (
            torch.ones(3),
            torch.ones(3, dtype=torch.int64),
            {},
            TypeError,
            "weights must be a floating-point",
        ),
        (
            torch.ones(3, dtype=torch.int64),
            torch.ones(3),
            {},
            TypeError,
            "values must be a floating-point",
        ),
        ([1.0], torch.ones(1), {}, TypeError, "values must be a tensor"),
        (torch.ones(3), torch.ones(3), {"dim": 1}, ValueError, "dim 1 is out of range"),
        (torch.ones(3), torch.ones(3), {"dim": ()}, ValueError, "empty tuple"),
        (torch.tensor(1.0), torch.tensor(1.0), {"dim": 1}, ValueError, r"from -1 to 0\)"),
        (torch.tensor(1.0), torch.tensor(1.0), {"dim": -2}, ValueError, "dim -2 is out of"),
        (torch.tensor(1.0), torch.tensor(1.0), {"dim": (0, -1)}, ValueError, "twice"),
        (torch.ones(2, 3), torch.ones(2, 3), {"dim": (1, -1)}, ValueError, "twice"),
        (torch.ones(3), torch.ones(3), {"dim": 0.5}, TypeError, "dim must be None"),
        (torch.ones(3), torch.ones(3), {"normalize": "sum"}, ValueError, "normalize must be"),
    ],
)
def test_weighted_mean_refuses_bad_arguments(values, weights, kwargs, error, match):
    with runtime_typecheck_off(), pytest.raises(error, match=match):
        fe.weighted_mean(values, weights, **kwargs)


def test_weighted_mean_leaves_its_inputs_alone():
    values, weights = torch.randn(3, 4), fe.bootstrap_masks(3, 4)
    before = (values.clone(), weights.clone())
    fe.weighted_mean(values, weights, dim=1)
    assert torch.equal(values, before[0]) and torch.equal(weights, before[1])


def test_weights_summing_to_zero_give_zero_whatever_their_signs() -> None:
    """As weighted_mean's docstring says (the formula would give -inf here)."""
    values = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    weights = torch.tensor([[1.0, -1.0], [0.0, 0.0]])
    assert fe.weighted_mean(values, weights, dim=1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_values_of_another_kind_get_advice_that_converts_them(dtype):
    """The advice was .to(values.dtype), for values themselves."""
    values, weights = torch.ones(3, 4).to(dtype), torch.ones(3, 4)
    with (
        runtime_typecheck_off(),
        pytest.raises(TypeError, match=r"values must be a floating-point tensor .* a float dtype"),
    ):
        fe.weighted_mean(values, weights)


def test_a_numpy_keep_probability_is_taken_as_a_float():
    import numpy as np

    with runtime_typecheck_off():
        masks = fe.bootstrap_masks(
            3, 50, p=np.float32(0.25), generator=torch.Generator().manual_seed(0)
        )
    expected = fe.bootstrap_masks(3, 50, p=0.25, generator=torch.Generator().manual_seed(0))
    assert torch.equal(masks, expected)
