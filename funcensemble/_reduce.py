"""Reductions over the member axis (dim 0) of stacked ensemble outputs."""

import math
import numbers

import torch
from jaxtyping import Float, Int, Real
from torch import Tensor

from ._messages import boolean, expected_got

# " member *rest" starts with a space so that linters do not parse it as the Python
# expression `member * rest` (jaxtyping's advice); jaxtyping ignores the space.


def _check(where: str, values: object, *, floating: bool, min_dims: int = 1) -> Tensor:
    if not isinstance(values, Tensor):
        raise TypeError(
            f"{where}: values is not a tensor (expected a tensor of stacked outputs with the "
            f"member axis first, got {type(values).__name__}). Stack the members' outputs "
            "with torch.stack."
        )
    if values.dim() < min_dims:
        axes = "[N, ...]" if min_dims == 1 else "[N, ..., C] (member axis first, classes last)"
        raise ValueError(
            f"{where}: values has too few dimensions (expected a tensor of shape {axes}, "
            f"got shape {tuple(values.shape)} with {values.dim()} dimension(s)). Stack the "
            "members' outputs along a new first axis (torch.stack)."
        )
    if values.shape[0] == 0:
        raise ValueError(
            f"{where}: the member axis (dim 0) is empty (expected at least one member, got "
            f"shape {tuple(values.shape)}). An ensemble has at least one member."
        )
    if floating:
        return check_floating(where, values)
    if values.is_complex():
        # (Checked before anything else: subset_min would draw, advancing the caller's
        # generator, before torch's kernel refused the dtype.)
        raise TypeError(
            f"{where}: the values are complex {expected_got('real values', values.dtype)}: "
            "complex numbers have no order to take a minimum or maximum in. "
            + to_real_advice(values)
        )
    return values


def to_real_advice(values: Tensor) -> str:
    """What to do with values of a dtype the reductions refuse: ``.float()`` would drop
    a complex number's imaginary part (also ``fe.distributed``'s advice)."""
    if values.is_complex():
        return (
            "Reduce their real and imaginary parts as real numbers: "
            "torch.view_as_real(values) puts them on a last axis of 2 (or pass values.real "
            "or values.abs(), if only that is wanted); .float() would drop the imaginary "
            "part."
        )
    return "Convert them with .float() first."


def check_floating(where: str, values: Tensor) -> Tensor:
    """``values`` if floating point (also ``fe.distributed``'s reductions' check)."""
    if not values.is_floating_point():
        raise TypeError(
            f"{where}: the values are not floating point "
            f"{expected_got('a floating-point dtype', values.dtype)}. " + to_real_advice(values)
        )
    return values


def mean(values: Float[Tensor, " member *rest"]) -> Float[Tensor, "*rest"]:
    """The mean over members.

    Example:
        >>> import torch, funcensemble as fe
        >>> fe.reduce.mean(torch.tensor([[1.0, 2.0], [3.0, 6.0]])).tolist()
        [2.0, 4.0]
    """
    return _check("mean", values, floating=True).mean(dim=0)


def _check_correction(where: str, correction: object, num_members: int) -> int | float:
    """``correction`` checked, a NumPy number taken as Python's (as torch takes it)."""
    if isinstance(correction, numbers.Integral) and not isinstance(correction, bool):
        correction = int(correction)
    elif isinstance(correction, numbers.Real) and not isinstance(correction, bool):
        correction = float(correction)
    if isinstance(correction, bool) or not isinstance(correction, (int, float)):
        raise TypeError(
            f"{where}: correction must be an int or a float (expected e.g. 1, got "
            f"{type(correction).__name__}). Pass 0 for the population, 1 for the sample "
            "variance."
        )
    if not correction >= 0:
        raise ValueError(
            f"{where}: correction must be >= 0 (expected 0 or more, got {correction!r}). Pass "
            "0 for the population, 1 for the sample variance."
        )
    if num_members - correction <= 0:
        raise ValueError(
            f"{where}: with correction={correction!r} the spread of {num_members} member(s) "
            "divides by N - correction <= 0, so it is undefined. Pass correction=0 for the "
            "population (biased) estimate, or use more members."
        )
    return correction


def var(
    values: Float[Tensor, " member *rest"], *, correction: int | float = 1
) -> Float[Tensor, "*rest"]:
    """The variance over members, ``sum((x_i - mean)**2) / (N - correction)``.

    As in ``torch.var``, ``correction=1`` (the default) gives the unbiased sample
    variance: the usual choice when the members are draws from a distribution of
    models. It needs at least two members; a single member raises rather than
    returning NaN. ``correction=0`` gives the population variance (0 for one member):
    the ``epistemic`` part of [`gaussian_mixture`][funcensemble.reduce.gaussian_mixture],
    which divides by N.

    Args:
        values: Stacked outputs, member axis first.
        correction: Subtracted from N in the denominator.

    Raises:
        ValueError: ``N - correction <= 0`` or a negative ``correction``.

    Example:
        >>> import torch, funcensemble as fe
        >>> x = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
        >>> fe.reduce.var(x).tolist(), fe.reduce.var(x, correction=0).tolist()
        ([2.0, 0.0], [1.0, 0.0])
    """
    values = _check("var", values, floating=True)
    correction = _check_correction("var", correction, values.shape[0])
    return torch.var(values, dim=0, correction=correction)


def std(
    values: Float[Tensor, " member *rest"], *, correction: int | float = 1
) -> Float[Tensor, "*rest"]:
    """The standard deviation over members: the square root of [`var`][funcensemble.reduce.var].

    For a regression ensemble this is its disagreement (epistemic uncertainty); with
    ``correction=0`` it is the square root of
    [`gaussian_mixture`][funcensemble.reduce.gaussian_mixture]'s ``epistemic``. Where
    all members agree exactly its gradient is 0, not the NaN of ``torch.std``; a NaN or
    inf among the values gives NaN, as ``torch.std`` does.

    Args:
        values: Stacked outputs, member axis first.
        correction: Subtracted from N in the denominator, as in ``torch.std``.

    Raises:
        ValueError: ``N - correction <= 0`` or a negative ``correction``.

    Example:
        >>> import torch, funcensemble as fe
        >>> preds = torch.tensor([[1.0, 5.0], [3.0, 5.0]])  # 2 members, 2 inputs
        >>> fe.reduce.std(preds, correction=0).tolist()
        [1.0, 0.0]
    """
    values = _check("std", values, floating=True)
    correction = _check_correction("std", correction, values.shape[0])
    variance = torch.var(values, dim=0, correction=correction)
    # sqrt has an infinite slope at 0; route zero variances around it so that agreeing
    # members get a zero gradient instead of 0 * inf = NaN. Only exact zeros: a NaN
    # variance (a NaN or inf among the values) stays NaN, as torch.std gives.
    zero = variance == 0
    return torch.where(zero, 0, torch.where(zero, 1, variance).sqrt())


def min(values: Real[Tensor, " member *rest"]) -> Real[Tensor, "*rest"]:
    """The elementwise minimum over members (values only).

    Ties share the gradient evenly. For the index of the minimizing member use
    ``values.argmin(dim=0)``.

    Example:
        >>> import torch, funcensemble as fe
        >>> fe.reduce.min(torch.tensor([[1.0, 7.0], [3.0, 2.0]])).tolist()
        [1.0, 2.0]
    """
    return _check("min", values, floating=False).amin(dim=0)


def max(values: Real[Tensor, " member *rest"]) -> Real[Tensor, "*rest"]:
    """The elementwise maximum over members (values only).

    Ties share the gradient evenly. For the index of the maximizing member use
    ``values.argmax(dim=0)``.

    Example:
        >>> import torch, funcensemble as fe
        >>> fe.reduce.max(torch.tensor([[1.0, 7.0], [3.0, 2.0]])).tolist()
        [3.0, 7.0]
    """
    return _check("max", values, floating=False).amax(dim=0)


def check_subset_options(
    where: str,
    name: str,
    values: Tensor,
    n: int,
    k: object,
    generator: object,
    per_sample: object,
) -> int:
    """Validate ``subset_min``'s options (shared with the distributed variant); ``k``
    as an ``int`` (a NumPy integer, a count read from an array, is one too)."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(
            f"{where}: k must be an int (expected a member count, got {type(k).__name__}). "
            f"Pass k as an int with 1 <= k <= {n}."
        )
    if not 1 <= k <= n:
        raise ValueError(
            f"{where}: k must satisfy 1 <= k <= N = {n}, the member count (expected 1 to {n}, "
            f"got {k}). Pick k among the {n} members."
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{where}: generator must be a torch.Generator or None (expected one of those, got "
            f"{type(generator).__name__}). Pass torch.Generator().manual_seed(...) or None."
        )
    boolean(where, "per_sample", per_sample)
    if per_sample and values.dim() < 2:
        raise ValueError(
            f"{where}: per_sample=True draws one subset per index of dim 1, but {name} has "
            f"shape {tuple(values.shape)} with no dim after the member axis."
        )
    return int(k)


def draw_subset(
    n: int, k: int, batch: int | None, generator: torch.Generator | None, device: torch.device
) -> Int[Tensor, " k"] | Int[Tensor, "batch k"]:
    """``subset_min``'s draw (also ``fe.distributed.subset_min``'s): ``k`` distinct members
    of ``n``, ``[k]``, or with a ``batch`` size one subset per index, ``[batch, k]``."""
    if batch is None:
        return torch.randperm(n, generator=generator, device=device)[:k]
    # Sorting i.i.d. uniform keys gives every row its own uniform random permutation.
    keys = torch.rand(batch, n, generator=generator, device=device, dtype=torch.float64)
    return keys.argsort(dim=1)[:, :k]


def subset_min(
    values: Real[Tensor, " member *rest"],
    k: int,
    *,
    generator: torch.Generator | None = None,
    per_sample: bool = False,
) -> Real[Tensor, "*rest"]:
    """The minimum over a random subset of ``k`` distinct members (REDQ's target).

    Each subset is drawn uniformly among all sets of ``k`` distinct members. The
    gradient flows only to the selected members (to the minimizing one of each
    element; members that tie for the minimum share it evenly, as ``torch.amin``'s
    gradient does, where ``.min(dim=0).values`` gives it all to one). The draw
    depends only on N, ``k``, the size of dim 1 (when ``per_sample``) and the
    generator's state, so the same seed selects the same members whatever the
    trailing shape.

    Args:
        values: Stacked outputs, member axis first (e.g. target Q-values ``[N, batch]``).
        k: How many members to take the minimum over, ``1 <= k <= N``.
        generator: Draw the subset from this generator (on its own device); ``None``
            uses torch's default generator for the device of ``values``.
        per_sample: ``False``: one subset shared by every element. ``True``: an
            independent subset for each index of dim 1 (the first dim after the
            member axis, usually the batch).

    Raises:
        ValueError: ``k`` out of range, or ``per_sample`` with no dim after the
            member axis.
        TypeError: A non-int ``k``, a ``generator`` that is not a ``torch.Generator``,
            or a non-bool ``per_sample``.

    Example:
        >>> import torch, funcensemble as fe
        >>> q = torch.tensor([[3.0, 3.0], [1.0, 1.0], [2.0, 2.0]])  # 3 members, batch 2
        >>> g = torch.Generator().manual_seed(0)
        >>> fe.reduce.subset_min(q, 2, generator=g).tolist() in ([1.0, 1.0], [2.0, 2.0])
        True
        >>> fe.reduce.subset_min(q, 3).tolist()  # k = N: the plain minimum
        [1.0, 1.0]
    """
    where = "subset_min"
    values = _check(where, values, floating=False)
    n = values.shape[0]
    k = check_subset_options(where, "values", values, n, k, generator, per_sample)

    device = values.device if generator is None else generator.device
    if not per_sample:
        chosen = draw_subset(n, k, None, generator, device)
        return values.index_select(0, chosen.to(values.device)).amin(dim=0)
    batch = values.shape[1]
    chosen = draw_subset(n, k, batch, generator, device).T.to(values.device)  # [k, batch]
    chosen = chosen.reshape(k, batch, *[1] * (values.dim() - 2)).expand(k, *values.shape[1:])
    return values.gather(0, chosen).amin(dim=0)


def _log_probs(where: str, logits: object) -> Tensor:
    logits = _check(where, logits, floating=True, min_dims=2)
    # A masked class (-inf logit) gets the most negative finite log-probability: its
    # probability is still exactly 0, but every log stays finite, so no 0 * inf = NaN
    # reaches the values or the gradients. The floor goes on the log-probabilities: on
    # the logits, log_softmax's subtraction of the row's maximum would overflow it back
    # to -inf (float16 logits of 16 and more did).
    # A row with every class masked has no distribution: NaN, as softmax gives it
    # (floored, it would pass for a uniform one).
    empty = torch.isneginf(logits).all(dim=-1, keepdim=True)
    log_probs = torch.log_softmax(logits, dim=-1).clamp(min=torch.finfo(logits.dtype).min)
    return log_probs.masked_fill(empty, math.nan)


def _average(log_probs: Tensor) -> Tensor:
    # log(mean_i p_i) in log space: stable where some p_i underflow to 0.
    return torch.logsumexp(log_probs, dim=0) - math.log(log_probs.shape[0])


def _entropy(log_probs: Tensor) -> Tensor:
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def mean_log_probs(
    logits: Float[Tensor, "member *batch classes"],
) -> Float[Tensor, "*batch classes"]:
    """The log of the ensemble's predictive distribution, ``log(mean_i softmax(logits_i))``.

    This averages probabilities, not logits, and is computed in log space
    (``logsumexp(log_softmax(logits), dim=0) - log N``), so it stays finite and exact
    for logits of any size. A logit of ``-inf`` masks its class: its probability is
    exactly 0, and its log here is the dtype's most negative finite value (where
    ``softmax(...).mean(0).log()`` gives ``-inf``), so no ``0 * inf`` turns a value or
    a gradient into NaN. A member whose every class is masked gives NaN, as
    ``softmax`` does (here and in the entropies).

    Args:
        logits: Stacked classifier outputs ``[N, ..., C]``, classes last.

    Example:
        >>> import torch, funcensemble as fe
        >>> logits = torch.tensor([[[1e4, 0.0]], [[0.0, 1e4]]])  # 2 members, 1 input
        >>> fe.reduce.mean_log_probs(logits).exp().tolist()
        [[0.5, 0.5]]
    """
    return _average(_log_probs("mean_log_probs", logits))


def mean_probs(
    logits: Float[Tensor, "member *batch classes"],
) -> Float[Tensor, "*batch classes"]:
    """The ensemble's predictive distribution, ``mean_i softmax(logits_i)``.

    The exponential of [`mean_log_probs`][funcensemble.reduce.mean_log_probs].

    Args:
        logits: Stacked classifier outputs ``[N, ..., C]``, classes last.

    Example:
        >>> import torch, funcensemble as fe
        >>> p = fe.reduce.mean_probs(torch.randn(5, 8, 3))
        >>> p.shape, torch.allclose(p.sum(-1), torch.ones(8))
        (torch.Size([8, 3]), True)
    """
    return _average(_log_probs("mean_probs", logits)).exp()


def predictive_entropy(
    logits: Float[Tensor, "member *batch classes"],
) -> Float[Tensor, "*batch"]:
    """The entropy of the mean prediction, ``H[mean_i p_i]`` in nats (total uncertainty).

    Args:
        logits: Stacked classifier outputs ``[N, ..., C]``, classes last.

    Example:
        >>> import math, torch, funcensemble as fe
        >>> logits = torch.tensor([[[1e4, 0.0]], [[0.0, 1e4]]])  # confident, opposed
        >>> math.isclose(fe.reduce.predictive_entropy(logits).item(), math.log(2), rel_tol=1e-6)
        True
    """
    return _entropy(_average(_log_probs("predictive_entropy", logits)))


def expected_entropy(
    logits: Float[Tensor, "member *batch classes"],
) -> Float[Tensor, "*batch"]:
    """The members' mean entropy, ``mean_i H[p_i]`` in nats (aleatoric uncertainty).

    Args:
        logits: Stacked classifier outputs ``[N, ..., C]``, classes last.

    Example:
        >>> import torch, funcensemble as fe
        >>> logits = torch.tensor([[[1e4, 0.0]], [[0.0, 1e4]]])  # each member is certain
        >>> fe.reduce.expected_entropy(logits).tolist()
        [0.0]
    """
    return _entropy(_log_probs("expected_entropy", logits)).mean(dim=0)


def mutual_information(
    logits: Float[Tensor, "member *batch classes"],
) -> Float[Tensor, "*batch"]:
    """Predictive minus expected entropy, in nats: the epistemic uncertainty (BALD).

    Computed as the equal quantity ``mean_i KL(p_i || mean_j p_j)``, and clamped at 0
    against rounding. In float32 its absolute error is about 1e-7 for logits of order 1
    (under 5.3e-7 with 10 classes, tested), and more for larger logits, whose
    log-probabilities round more coarsely, as for the difference of the two entropies:
    where the members nearly agree that is a large relative error (compute in float64
    there). It is exactly 0 for one member.

    Args:
        logits: Stacked classifier outputs ``[N, ..., C]``, classes last.

    Example:
        >>> import math, torch, funcensemble as fe
        >>> logits = torch.tensor([[[1e4, 0.0]], [[0.0, 1e4]]])  # confident, opposed
        >>> math.isclose(fe.reduce.mutual_information(logits).item(), math.log(2), rel_tol=1e-6)
        True
    """
    log_probs = _log_probs("mutual_information", logits)
    divergence = (log_probs.exp() * (log_probs - _average(log_probs))).sum(dim=-1)
    return divergence.mean(dim=0).clamp(min=0)


def disagreement(
    logits: Float[Tensor, "member *batch classes"],
) -> Float[Tensor, "*batch"]:
    """The fraction of members whose predicted class differs from the ensemble's.

    Member i predicts ``argmax_c logits_i``; the ensemble predicts ``argmax_c`` of
    [`mean_probs`][funcensemble.reduce.mean_probs] (the averaged probabilities, not a
    majority vote). Ties between the computed values go to the lowest class index; the
    averaged probabilities are computed in log space and rounded, so classes that tie
    exactly in real numbers may come out an ulp apart there. The result lies in
    ``[0, 1]``: 1 where the averaged probabilities pick a class no member votes for
    (member votes 0 and 2, ensemble class 1). It has the dtype of ``logits`` and,
    being piecewise constant, carries no gradient. For a regression ensemble,
    measure disagreement with [`std`][funcensemble.reduce.std].

    Args:
        logits: Stacked classifier outputs ``[N, ..., C]``, classes last.

    Example:
        >>> import torch, funcensemble as fe
        >>> logits = torch.tensor([[[2.0, 0.0]], [[3.0, 0.0]], [[0.0, 1.0]]])
        >>> (3 * fe.reduce.disagreement(logits)).tolist()  # 1 of 3 members votes class 1
        [1.0]
    """
    log_probs = _log_probs("disagreement", logits)
    if log_probs.shape[-1] == 0:
        raise ValueError(
            "disagreement: the logits have no classes (expected [N, ..., C] with C >= 1, "
            f"got shape {tuple(log_probs.shape)}): there is no vote to compare, as the "
            "loop's argmax refuses. Pass the classifier's logits, classes last."
        )
    ensemble = _average(log_probs).argmax(dim=-1)
    # Each member's vote from its logits themselves: log_softmax may round two logits
    # a few ulps apart into a tie, which would go to the lower class.
    votes = logits.argmax(dim=-1)  # type: ignore[union-attr]
    return (votes != ensemble).to(log_probs.dtype).mean(dim=0)
