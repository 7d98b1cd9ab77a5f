"""The equal-weight mixture of the members' Gaussian predictions (regression deep ensembles)."""

from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from . import _torch_compat
from ._reduce import _check


class GaussianMixture(NamedTuple):
    """The moments of an ensemble's Gaussian mixture, returned by
    [`gaussian_mixture`][funcensemble.reduce.gaussian_mixture].

    Attributes:
        mean: The mixture's mean, the members' mean of means.
        var: The mixture's total variance, ``aleatoric + epistemic``.
        aleatoric: The members' mean of variances: the noise each member expects.
        epistemic: The variance of the members' means (over N, not N - 1): their
            disagreement. It is [`fe.reduce.var`][funcensemble.reduce.var] of the means
            with ``correction=0``; ``fe.reduce.var``'s default, ``correction=1``, gives
            ``N / (N - 1)`` times it.

    Example:
        >>> import torch, funcensemble as fe
        >>> means = torch.tensor([[0.0], [2.0]])  # 2 members, 1 output
        >>> mix = fe.reduce.gaussian_mixture(means, torch.ones(2, 1))
        >>> mix.mean.tolist(), mix.var.tolist(), mix.aleatoric.tolist(), mix.epistemic.tolist()
        ([1.0], [2.0], [1.0], [1.0])
        >>> fe.reduce.var(means, correction=0).tolist(), fe.reduce.var(means).tolist()
        ([1.0], [2.0])
    """

    mean: Float[Tensor, "*batch"]
    var: Float[Tensor, "*batch"]
    aleatoric: Float[Tensor, "*batch"]
    epistemic: Float[Tensor, "*batch"]


def gaussian_mixture(
    mean: Float[Tensor, " member *batch"], var: Float[Tensor, " member *batch"]
) -> GaussianMixture:
    """Combine the members' predicted means and variances into one Gaussian mixture.

    For a regression deep ensemble (Lakshminarayanan et al., 2017) where member i
    predicts ``N(mean_i, var_i)``, the uniform mixture has mean ``mean_i`` averaged over
    the members and, by the law of total variance, the variance
    ``mean_i(var_i) + mean_i(mean_i**2) - mean**2``: the average noise the members
    expect (aleatoric) plus the spread of their means (epistemic, the population
    variance over the N members, ``correction=0``). One member gives an epistemic
    part of 0. The epistemic part is computed in float64 whatever the inputs' dtype
    (float32 on MPS) and rounded back, so that members that nearly agree (a spread of
    1e-3 around 1e4 in float32) keep its relative precision. Gradients flow to
    ``mean`` and ``var``.

    Args:
        mean: The members' predicted means, member axis first.
        var: The members' predicted variances (not standard deviations), the same
            shape, all ``>= 0``.

    Returns:
        A [`GaussianMixture`][funcensemble.reduce.GaussianMixture]
        ``(mean, var, aleatoric, epistemic)``, each shaped like one member's
        prediction.

    Raises:
        TypeError: An argument that is not a floating-point tensor, or ``mean`` and
            ``var`` of different dtypes.
        ValueError: Shapes that differ, no member axis or an empty one, or a negative
            variance (checked when called outside ``torch.compile`` and ``torch.func``
            transforms, where values can be read).

    Example:
        >>> import torch, funcensemble as fe
        >>> means = torch.tensor([[1.0, 0.0], [3.0, 0.0]])  # 2 members, 2 inputs
        >>> variances = torch.tensor([[0.5, 1.0], [1.5, 1.0]])
        >>> mix = fe.reduce.gaussian_mixture(means, variances)
        >>> mix.mean.tolist(), mix.aleatoric.tolist(), mix.epistemic.tolist()
        ([2.0, 0.0], [1.0, 1.0], [1.0, 0.0])
        >>> torch.equal(mix.var, mix.aleatoric + mix.epistemic)
        True
    """
    where = "gaussian_mixture"
    mean = _check(where, mean, floating=True)
    var = _check(where, var, floating=True)
    if mean.shape != var.shape:
        raise ValueError(
            f"{where}: mean and var must have the same shape (expected one variance per "
            f"predicted mean, got mean {tuple(mean.shape)} and var {tuple(var.shape)}). "
            "Give each member's variance for every output it predicts, e.g. a variance "
            "head as wide as the mean head."
        )
    if mean.dtype != var.dtype:
        raise TypeError(
            f"{where}: mean and var must have one dtype (expected the same floating-point "
            f"dtype, got mean {mean.dtype} and var {var.dtype}): the mixture's variance "
            "adds parts computed in each, and would hold the narrower one's precision "
            "in the wider dtype. Convert one, e.g. var.to(mean.dtype)."
        )
    if not (torch.compiler.is_compiling() or _torch_compat.inside_transform()):
        negative = var < 0
        if bool(negative.any()):
            at = tuple(int(i) for i in negative.nonzero()[0])
            index = f", index {at[1:]}" if len(at) > 1 else ""
            raise ValueError(
                f"{where}: var must be >= 0 everywhere (variances, not log-variances), got "
                f"{var[at].item()} at member {at[0]}{index}. Map a network's raw output to a "
                "variance first, e.g. with F.softplus(raw) + 1e-6."
            )
    center = mean.mean(dim=0)
    aleatoric = var.mean(dim=0)
    # torch.var in float64 (MPS has none): a spread taken around a mean rounded to
    # float32 loses all its digits when the members nearly agree (a spread of 1e-3
    # around 1e4), and float16's squared deviations overflow before their mean does.
    wide = torch.float32 if mean.device.type == "mps" else torch.float64
    epistemic = torch.var(mean.to(wide), dim=0, correction=0).to(mean.dtype)
    return GaussianMixture(center, aleatoric + epistemic, aleatoric, epistemic)
