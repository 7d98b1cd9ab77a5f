"""fe.reduce: every reduction against a plain Python loop over members, in float64."""

import functools
import itertools
import math
from collections.abc import Callable

import pytest
import torch
from helpers import runtime_typecheck_off
from torch import Tensor

import funcensemble as fe

RTOL, ATOL = 1e-10, 1e-12
CLASSIFIER_FNS = [
    fe.reduce.mean_probs,
    fe.reduce.mean_log_probs,
    fe.reduce.predictive_entropy,
    fe.reduce.expected_entropy,
    fe.reduce.mutual_information,
    fe.reduce.disagreement,
]


def members(values: Tensor) -> list[Tensor]:
    return [values[i] for i in range(values.shape[0])]


def loop_mean(values: Tensor) -> Tensor:
    return sum(members(values)) / values.shape[0]


def loop_var(values: Tensor, correction: float = 1) -> Tensor:
    m = loop_mean(values)
    return sum((x - m) ** 2 for x in members(values)) / (values.shape[0] - correction)


def loop_min(values: Tensor) -> Tensor:
    return functools.reduce(torch.minimum, members(values))


def loop_max(values: Tensor) -> Tensor:
    return functools.reduce(torch.maximum, members(values))


def loop_probs(logits: Tensor) -> Tensor:
    return loop_mean(torch.stack([torch.softmax(x, dim=-1) for x in members(logits)]))


def entropy(probs: Tensor) -> Tensor:
    return torch.special.entr(probs).sum(dim=-1)


def loop_predictive(logits: Tensor) -> Tensor:
    return entropy(loop_probs(logits))


def loop_expected(logits: Tensor) -> Tensor:
    return loop_mean(torch.stack([entropy(torch.softmax(x, dim=-1)) for x in members(logits)]))


def loop_disagreement(logits: Tensor) -> Tensor:
    ensemble = loop_probs(logits).argmax(dim=-1)
    votes = [(x.argmax(dim=-1) != ensemble).double() for x in members(logits)]
    return loop_mean(torch.stack(votes)).to(logits.dtype)


def assert_same_values_and_grads(
    fn: Callable[[Tensor], Tensor], reference: Callable[[Tensor], Tensor], x: Tensor
) -> None:
    x = x.detach().requires_grad_(True)
    out, expected = fn(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    weights = torch.randn(out.shape, dtype=out.dtype)
    (grad,) = torch.autograd.grad((out * weights).sum(), x)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), x)
    torch.testing.assert_close(grad, expected_grad, rtol=RTOL, atol=ATOL)


# --- moments and extremes ----------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("rest", [(), (3,), (2, 4)])
def test_moments_and_extremes_match_loop(n: int, rest: tuple[int, ...]) -> None:
    torch.manual_seed(n)
    x = torch.randn(n, *rest, dtype=torch.float64)
    assert_same_values_and_grads(fe.reduce.mean, loop_mean, x)
    assert_same_values_and_grads(fe.reduce.min, loop_min, x)
    assert_same_values_and_grads(fe.reduce.max, loop_max, x)
    for correction in [0, 1] if n > 1 else [0]:
        assert_same_values_and_grads(
            functools.partial(fe.reduce.var, correction=correction),
            functools.partial(loop_var, correction=correction),
            x,
        )
        if n > 1:  # std of one member is 0, where sqrt's slope is infinite
            assert_same_values_and_grads(
                functools.partial(fe.reduce.std, correction=correction),
                lambda v, c=correction: loop_var(v, c).sqrt(),
                x,
            )


@pytest.mark.parametrize("correction", [0, 1, 2, 0.5])
def test_correction(correction: float) -> None:
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(fe.reduce.var(x, correction=correction), loop_var(x, correction))
    torch.testing.assert_close(
        fe.reduce.std(x, correction=correction), loop_var(x, correction).sqrt()
    )


def test_default_correction_is_unbiased() -> None:
    x = torch.randn(6, 5, dtype=torch.float64)
    torch.testing.assert_close(fe.reduce.var(x), loop_var(x, 1))
    torch.testing.assert_close(fe.reduce.std(x), x.std(dim=0))


def test_float32_matches_float64_loop() -> None:
    x = torch.randn(5, 7, dtype=torch.float64)
    for fn, ref in [(fe.reduce.mean, loop_mean), (fe.reduce.var, loop_var)]:
        out = fn(x.float())
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref(x), rtol=1e-5, atol=1e-6)


def test_single_member() -> None:
    x = torch.randn(1, 3, dtype=torch.float64)
    assert torch.equal(fe.reduce.var(x, correction=0), torch.zeros(3, dtype=torch.float64))
    assert torch.equal(fe.reduce.mean(x), x[0])
    assert torch.equal(fe.reduce.min(x), x[0])
    with runtime_typecheck_off(), pytest.raises(ValueError, match=r"correction=1.*1 member"):
        fe.reduce.var(x)
    with runtime_typecheck_off(), pytest.raises(ValueError, match="correction=0 for the"):
        fe.reduce.std(x)


def test_std_gradient_is_zero_where_members_agree() -> None:
    x = torch.tensor([[1.0, 2.0], [1.0, 3.0], [1.0, 4.0]], dtype=torch.float64)
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad(fe.reduce.std(x).sum(), x)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[:, 0], torch.zeros(3, dtype=torch.float64))
    (expected,) = torch.autograd.grad(x[:, 1].std(), x)
    torch.testing.assert_close(grad[:, 1], expected[:, 1])


def test_std_of_nan_or_inf_is_nan_as_torch_std() -> None:
    """A NaN or inf among the values gives NaN (it read 0, "all members agree")."""
    x = torch.tensor([[1.0, 1.0, 1.0], [float("nan"), 2.0, 1.0], [3.0, float("inf"), 1.0]])
    torch.testing.assert_close(fe.reduce.std(x), torch.std(x, dim=0), equal_nan=True)
    assert fe.reduce.std(x)[:2].isnan().all() and fe.reduce.std(x)[2] == 0


def test_min_max_of_integers() -> None:
    x = torch.tensor([[3, -1], [2, 5]])
    assert fe.reduce.min(x).tolist() == [2, -1]
    assert fe.reduce.max(x).tolist() == [3, 5]


def test_gradcheck_moments() -> None:
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    for fn in [fe.reduce.mean, fe.reduce.var, fe.reduce.std, fe.reduce.min, fe.reduce.max]:
        assert torch.autograd.gradcheck(fn, (x,))


# --- subset_min ----------------------------------------------------------------------


def chosen_members(n: int, batch: int, k: int, seed: int, per_sample: bool) -> Tensor:
    """Which members subset_min picks for this seed, as a bool mask ``[batch, n]``.

    Column j of the probe is 0 for member j and 1 for the others, so its subset minimum
    is 0 exactly when member j was drawn.
    """
    probe = (1 - torch.eye(n, dtype=torch.float64)).unsqueeze(1).expand(n, batch, n)
    g = torch.Generator().manual_seed(seed)
    return fe.reduce.subset_min(probe, k, generator=g, per_sample=per_sample) == 0


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_subset_min_matches_loop_over_drawn_members(k: int, per_sample: bool) -> None:
    n, batch, seed = 5, 6, 7
    mask = chosen_members(n, batch, k, seed, per_sample)
    assert mask.sum(dim=1).tolist() == [k] * batch  # k distinct members per sample
    if not per_sample:
        assert (mask == mask[0]).all()

    x = torch.randn(n, batch, 3, dtype=torch.float64)

    def loop(values: Tensor) -> Tensor:
        rows = [loop_min(values[mask[b], b]) for b in range(batch)]
        return torch.stack(rows)

    def drawn(values: Tensor) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        return fe.reduce.subset_min(values, k, generator=g, per_sample=per_sample)

    assert_same_values_and_grads(drawn, loop, x)
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad(drawn(x).sum(), x)
    not_drawn = ~mask.T.unsqueeze(-1).expand_as(x)
    assert (grad[not_drawn] == 0).all()


@pytest.mark.parametrize("per_sample", [False, True])
def test_subset_min_draws_uniform_subsets(per_sample: bool) -> None:
    n, k = 5, 2
    if per_sample:
        masks = chosen_members(n, 20_000, k, seed=0, per_sample=True)
    else:
        masks = torch.cat([chosen_members(n, 1, k, seed, per_sample=False) for seed in range(2000)])
    draws = masks.shape[0]
    assert (masks.sum(dim=1) == k).all()
    # Each member in k/N of the draws, each of the C(N, k) pairs in 1/C(N, k): 5 sigma.
    p = k / n
    frequency = masks.double().mean(dim=0)
    assert (frequency - p).abs().max() < 5 * math.sqrt(p * (1 - p) / draws)
    pairs = list(itertools.combinations(range(n), k))
    q = 1 / len(pairs)
    for i, j in pairs:
        share = (masks[:, i] & masks[:, j]).double().mean().item()
        assert abs(share - q) < 5 * math.sqrt(q * (1 - q) / draws)


def test_subset_min_is_reproducible() -> None:
    x = torch.randn(8, 64, dtype=torch.float64)
    for per_sample in [False, True]:
        a = fe.reduce.subset_min(
            x, 3, generator=torch.Generator().manual_seed(1), per_sample=per_sample
        )
        b = fe.reduce.subset_min(
            x, 3, generator=torch.Generator().manual_seed(1), per_sample=per_sample
        )
        assert torch.equal(a, b)
        torch.manual_seed(5)
        c = fe.reduce.subset_min(x, 3, per_sample=per_sample)
        torch.manual_seed(5)
        assert torch.equal(c, fe.reduce.subset_min(x, 3, per_sample=per_sample))
    g = torch.Generator().manual_seed(0)
    outs = {tuple(fe.reduce.subset_min(x, 3, generator=g).tolist()) for _ in range(10)}
    assert len(outs) > 1  # the generator advances


def test_subset_min_extremes() -> None:
    x = torch.randn(4, 10, dtype=torch.float64)
    for per_sample in [False, True]:
        assert torch.equal(fe.reduce.subset_min(x, 4, per_sample=per_sample), x.amin(dim=0))
    one = fe.reduce.subset_min(x, 1)
    assert any(torch.equal(one, member) for member in members(x))


# --- classifiers ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("batch", [(), (4,), (2, 3)])
@pytest.mark.parametrize("classes", [1, 5])
def test_classifier_reductions_match_loop(n: int, batch: tuple[int, ...], classes: int) -> None:
    torch.manual_seed(n + classes)
    logits = 3 * torch.randn(n, *batch, classes, dtype=torch.float64)
    assert_same_values_and_grads(fe.reduce.mean_probs, loop_probs, logits)
    assert_same_values_and_grads(fe.reduce.mean_log_probs, lambda x: loop_probs(x).log(), logits)
    assert_same_values_and_grads(fe.reduce.predictive_entropy, loop_predictive, logits)
    assert_same_values_and_grads(fe.reduce.expected_entropy, loop_expected, logits)
    assert_same_values_and_grads(
        fe.reduce.mutual_information, lambda x: loop_predictive(x) - loop_expected(x), logits
    )
    out = fe.reduce.disagreement(logits)
    assert torch.equal(out, loop_disagreement(logits))
    assert out.grad_fn is None


def test_gradcheck_classifiers() -> None:
    logits = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    for fn in CLASSIFIER_FNS[:-1]:
        assert torch.autograd.gradcheck(fn, (logits,))


def test_opposed_confident_members() -> None:
    logits = torch.tensor([[[1e4, 0.0, 0.0]], [[0.0, 1e4, 0.0]]])
    torch.testing.assert_close(fe.reduce.mean_probs(logits), torch.tensor([[0.5, 0.5, 0.0]]))
    log2 = torch.tensor([math.log(2)])
    torch.testing.assert_close(fe.reduce.predictive_entropy(logits), log2)
    assert torch.equal(fe.reduce.expected_entropy(logits), torch.zeros(1))
    torch.testing.assert_close(fe.reduce.mutual_information(logits), log2)
    # The ensemble's probabilities tie; the tie goes to class 0, so member 1 disagrees.
    assert fe.reduce.disagreement(logits).tolist() == [0.5]


def test_huge_logits_are_finite_and_correct() -> None:
    torch.manual_seed(0)
    exact = 1e4 * torch.randn(4, 16, 6, dtype=torch.float64)
    logits = exact.float().requires_grad_(True)
    references = [
        loop_probs,
        None,  # log(0) is -inf in the reference; checked through mean_probs
        loop_predictive,
        loop_expected,
        lambda x: loop_predictive(x) - loop_expected(x),
        loop_disagreement,
    ]
    for fn, ref in zip(CLASSIFIER_FNS, references, strict=True):
        out = fn(logits)
        assert torch.isfinite(out).all(), fn.__name__
        if ref is not None:
            torch.testing.assert_close(out.double(), ref(exact), rtol=1e-5, atol=1e-5)
        if out.requires_grad:
            (grad,) = torch.autograd.grad(out.sum(), logits)
            assert torch.isfinite(grad).all(), fn.__name__


def test_masked_classes() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 5, dtype=torch.float64)
    masked = torch.cat([logits, torch.full((3, 4, 1), -math.inf, dtype=torch.float64)], dim=-1)
    masked[1, 0, 2] = -math.inf  # masked for one member only
    kept = masked[..., :5]
    masked.requires_grad_(True)
    probs = fe.reduce.mean_probs(masked)
    assert torch.equal(probs[..., 5], torch.zeros(4, dtype=torch.float64))
    # Documented: the masked class's log is the most negative finite value, not -inf.
    low = torch.finfo(torch.float64).min
    assert (fe.reduce.mean_log_probs(masked)[..., 5] == low).all()
    torch.testing.assert_close(probs[..., :5], loop_probs(kept))
    for fn in CLASSIFIER_FNS[2:]:
        out = fn(masked)
        torch.testing.assert_close(out, fn(kept))
        if out.requires_grad:
            (grad,) = torch.autograd.grad(out.sum(), masked)
            assert torch.isfinite(grad).all(), fn.__name__
            assert (grad[..., 5] == 0).all() and grad[1, 0, 2] == 0


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float16, 16.0), (torch.float32, 1e33)])
def test_masked_classes_beside_large_logits_stay_finite(dtype, scale) -> None:
    """The floor once went on the logits: log_softmax's subtraction of the row maximum
    then overflowed it back to -inf, and the entropies were NaN (float16 logits of 16)."""
    logits = torch.tensor(
        [[-math.inf, scale, 0.0], [-math.inf, 0.0, scale]], dtype=dtype, requires_grad=True
    )
    kept = logits.detach()[..., 1:].double()
    assert (fe.reduce.mean_log_probs(logits)[..., 0] == torch.finfo(dtype).min).all()
    for fn in CLASSIFIER_FNS[2:]:
        out = fn(logits)
        assert torch.isfinite(out).all(), fn.__name__
        want = fn(kept).to(dtype)
        got = out[..., 1:] if out.shape[-1:] == (3,) else out
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        if out.requires_grad:
            (grad,) = torch.autograd.grad(out.sum(), logits)
            assert torch.isfinite(grad).all() and (grad[..., 0] == 0).all(), fn.__name__


def test_disagreement_fractions() -> None:
    # Members vote 0, 0, 1, 2 on input 0 and all vote 1 on input 1.
    logits = torch.tensor(
        [
            [[5.0, 0.0, 0.0], [0.0, 1.0, 0.0]],
            [[4.0, 0.0, 0.0], [0.0, 2.0, 0.0]],
            [[0.0, 1.0, 0.0], [0.0, 3.0, 0.0]],
            [[0.0, 0.0, 1.0], [0.0, 4.0, 0.0]],
        ]
    )
    assert fe.reduce.disagreement(logits).tolist() == [0.5, 0.0]


def test_disagreement_reaches_1_where_no_member_votes_the_averaged_class() -> None:
    # Votes 0 and 2; the averaged probabilities pick class 1, which neither votes for.
    logits = torch.tensor([[[3.0, 2.9, -5.0]], [[-5.0, 2.9, 3.0]]])
    assert fe.reduce.mean_probs(logits).argmax(-1).tolist() == [1]
    assert fe.reduce.disagreement(logits).tolist() == [1.0]


def test_disagreement_votes_are_each_members_argmax_of_its_logits() -> None:
    # Two logits one ulp apart: log_softmax rounds them into a tie, the logits do not.
    low = torch.tensor(1e-3)
    high = torch.nextafter(low, torch.tensor(1.0))
    logits = torch.stack([torch.stack([low, high]), torch.tensor([0.0, 1.0])]).unsqueeze(1)
    assert logits.argmax(-1).flatten().tolist() == [1, 1]
    assert fe.reduce.disagreement(logits).tolist() == [0.0]


# --- bad input ------------------------------------------------------------------------

ALL_FNS = [
    fe.reduce.mean,
    fe.reduce.var,
    fe.reduce.std,
    fe.reduce.min,
    fe.reduce.max,
    functools.partial(fe.reduce.subset_min, k=1),
    *CLASSIFIER_FNS,
]


@pytest.mark.parametrize("fn", ALL_FNS, ids=lambda f: getattr(f, "__name__", "subset_min"))
def test_rejects_non_tensors_and_empty_shapes(fn: Callable[..., Tensor]) -> None:
    with runtime_typecheck_off():
        with pytest.raises(
            TypeError,
            match=r": values is not a tensor \(expected a tensor of stacked outputs.*got list\)",
        ):
            fn([[1.0, 2.0]])
        with pytest.raises(
            ValueError,
            match=r"values has too few dimensions \(expected a tensor of shape .* got shape \(\)",
        ):
            fn(torch.tensor(1.0))
        with pytest.raises(ValueError, match=r"member axis \(dim 0\) is empty"):
            fn(torch.zeros(0, 3))


@pytest.mark.parametrize("fn", [fe.reduce.mean, fe.reduce.var, fe.reduce.std, *CLASSIFIER_FNS])
def test_rejects_integer_tensors_where_floats_are_needed(fn: Callable[..., Tensor]) -> None:
    with runtime_typecheck_off(), pytest.raises(TypeError, match=r"floating-point.*torch\.int64"):
        fn(torch.ones(2, 3, dtype=torch.int64))


@pytest.mark.parametrize("fn", [fe.reduce.mean, fe.reduce.var, fe.reduce.std, *CLASSIFIER_FNS])
def test_complex_values_are_refused_with_advice_that_keeps_the_imaginary_part(fn) -> None:
    with runtime_typecheck_off():
        with pytest.raises(TypeError, match=r"Convert them with \.float\(\) first\.$"):
            fn(torch.ones(2, 3, dtype=torch.int64))  # for integers, .float() loses nothing
        with pytest.raises(
            TypeError,
            match=r"got torch\.complex64\)\. Reduce their real and imaginary parts as real "
            r"numbers: torch\.view_as_real\(values\) .* \.float\(\) would drop the imaginary part",
        ):
            fn(torch.ones(2, 3, dtype=torch.complex64))
    # The advice, followed: the complex mean, exactly.
    z = torch.randn(4, 3, dtype=torch.complex128, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.view_as_complex(fe.reduce.mean(torch.view_as_real(z))), z.mean(0))


@pytest.mark.parametrize("fn", CLASSIFIER_FNS)
def test_classifiers_need_a_class_axis(fn: Callable[..., Tensor]) -> None:
    with runtime_typecheck_off(), pytest.raises(ValueError, match=r"classes last.*shape \(3,\)"):
        fn(torch.zeros(3))


@pytest.mark.parametrize("fn", [fe.reduce.var, fe.reduce.std])
def test_rejects_bad_corrections(fn: Callable[..., Tensor]) -> None:
    x = torch.randn(3, 2)
    with runtime_typecheck_off():
        with pytest.raises(
            ValueError, match=r"correction must be >= 0 \(expected 0 or more, got -1\)"
        ):
            fn(x, correction=-1)
        with pytest.raises(ValueError, match="correction=3 the spread of 3 member"):
            fn(x, correction=3)
        with pytest.raises(
            TypeError, match=r"correction must be an int or a float \(expected e\.g\. 1, got bool\)"
        ):
            fn(x, correction=True)
        with pytest.raises(TypeError, match="got str"):
            fn(x, correction="1")


def test_subset_min_takes_a_numpy_integer_k() -> None:
    """A count read from an array (``np.int64``) is an int, as ``chunk_size`` takes it;
    the draw is the one an int ``k`` gives. (Annotated ``int``: the run's runtime
    checker is turned off for the call, as a user's code has none.)"""
    import numpy as np

    q = torch.randn(5, 7, dtype=torch.float64)
    for per_sample in (False, True):
        with runtime_typecheck_off():
            got = fe.reduce.subset_min(
                q, np.int64(3), generator=torch.Generator().manual_seed(1), per_sample=per_sample
            )
        want = fe.reduce.subset_min(
            q, 3, generator=torch.Generator().manual_seed(1), per_sample=per_sample
        )
        assert torch.equal(got, want)


def test_subset_min_rejects_bad_options() -> None:
    x = torch.randn(3, 4)
    with runtime_typecheck_off():
        for k in [0, 4, -1]:
            with pytest.raises(
                ValueError, match=rf"1 <= k <= N = 3, the member count \(expected 1 to 3, got {k}\)"
            ):
                fe.reduce.subset_min(x, k)
        for k in [2.0, True, None]:
            with pytest.raises(TypeError, match="k must be an int"):
                fe.reduce.subset_min(x, k)
        with pytest.raises(
            TypeError,
            match=r"generator must be a torch\.Generator.*\(expected one of those, got int\)",
        ):
            fe.reduce.subset_min(x, 2, generator=0)
        with pytest.raises(
            TypeError, match=r"per_sample must be a bool \(expected True or False, got int\)"
        ):
            fe.reduce.subset_min(x, 2, per_sample=1)
        with pytest.raises(ValueError, match=r"no dim after the member axis"):
            fe.reduce.subset_min(torch.randn(3), 2, per_sample=True)


def test_runtime_checker_sees_the_member_axis() -> None:
    # In the test run jaxtyping checks the annotations: the member axis is required.
    with pytest.raises(TypeError, match="member"):
        fe.reduce.mean(torch.tensor(1.0))


def test_a_member_with_every_class_masked_gives_nan_as_softmax() -> None:
    logits = torch.tensor([[[-math.inf, -math.inf], [0.0, -math.inf]], [[0.0, 1.0], [2.0, 1.0]]])
    want = logits.softmax(-1).mean(0)
    torch.testing.assert_close(fe.reduce.mean_probs(logits), want, equal_nan=True)
    assert fe.reduce.mean_probs(logits)[0].isnan().all()
    assert fe.reduce.predictive_entropy(logits)[0].isnan()
    assert fe.reduce.mean_probs(logits)[1].isfinite().all()  # one masked class: finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mutual_information_of_identical_members_is_zero_up_to_rounding(dtype):
    torch.manual_seed(0)
    one = torch.randn(1, 64, 10, dtype=dtype)
    assert torch.equal(fe.reduce.mutual_information(one), torch.zeros(64, dtype=dtype))
    for n in (2, 3, 5, 8):
        same = fe.reduce.mutual_information(one.expand(n, 64, 10))
        assert (same >= 0).all()
        assert same.max() <= 4 * torch.finfo(dtype).eps  # the entropies are ~log(10)


def test_subset_min_shares_the_gradient_among_tied_members():
    """subset_min's docstring: members tying for the minimum share its gradient evenly
    (torch.amin's rule)."""
    q = torch.ones(3, 2, requires_grad=True)
    fe.reduce.subset_min(q, 3).sum().backward()
    assert torch.allclose(q.grad, torch.full((3, 2), 1 / 3))


@pytest.mark.parametrize("fn", ["min", "max", "subset_min"])
def test_complex_values_are_refused_before_a_subset_is_drawn(fn: str) -> None:
    """min/max/subset_min gave torch's raw "min_values_cpu not implemented for
    'ComplexFloat'", and subset_min only after drawing its subset: the caller's
    generator had moved, shifting every later draw."""
    g = torch.Generator().manual_seed(0)
    before = g.get_state()
    call = {
        "min": lambda v: fe.reduce.min(v),
        "max": lambda v: fe.reduce.max(v),
        "subset_min": lambda v: fe.reduce.subset_min(v, 2, generator=g),
    }[fn]
    with (
        runtime_typecheck_off(),
        pytest.raises(TypeError, match=r"complex .*got torch\.complex64\).* no order"),
    ):
        call(torch.ones(3, 4, dtype=torch.complex64))
    assert torch.equal(g.get_state(), before)


def test_disagreement_of_no_classes_is_refused_as_the_loops_argmax_is():
    with pytest.raises(ValueError, match=r"disagreement: the logits have no classes"):
        fe.reduce.disagreement(torch.zeros(3, 4, 0))


def test_mutual_information_float32_error_for_logits_of_order_one() -> None:
    """The docstring: under 5.3e-7 (two ulps of ln 10) for logits of order 1 with 10
    classes, whatever the mutual information, so a large relative error where the
    members nearly agree."""
    torch.manual_seed(0)
    base = torch.randn(1, 256, 10, dtype=torch.float64)
    ulp = torch.finfo(torch.float32).eps * math.log(10)
    for spread in (0.0, 1e-4, 1e-3, 1e-2):
        logits = (base + spread * torch.randn(6, 256, 10, dtype=torch.float64)).float()
        exact = fe.reduce.mutual_information(logits.double())
        error = (fe.reduce.mutual_information(logits).double() - exact).abs().max().item()
        assert error < 2 * ulp, (spread, error)
    assert torch.equal(fe.reduce.mutual_information(base.float()), torch.zeros(256))


def test_numpy_corrections_are_taken_as_torch_takes_them():
    # Found by an audit: np.int64(1) was refused, where torch.var takes it.
    import numpy as np

    x = torch.randn(4, 3, dtype=torch.float64)
    with runtime_typecheck_off():
        for correction in (np.int64(1), np.float32(0.5), np.float64(0.0)):
            for fn, ref in ((fe.reduce.var, torch.var), (fe.reduce.std, torch.std)):
                expected = ref(x, dim=0, correction=float(correction))
                torch.testing.assert_close(fn(x, correction=correction), expected)
        with pytest.raises(TypeError, match="correction must be an int or a float"):
            fe.reduce.var(x, correction=np.bool_(True))
