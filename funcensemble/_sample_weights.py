"""Per-member sample weights in a shared batch: bootstrap masks and the weighted mean."""

import numbers
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ._bagging import _positive_int, bootstrap_indices

Distribution = Literal["bernoulli", "poisson", "multinomial"]
Normalize = Literal["weights", "samples"]


def bootstrap_masks(
    num_members: int,
    num_samples: int,
    *,
    distribution: Distribution = "bernoulli",
    p: float | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Float[Tensor, "member sample"]:
    """Draw one weight per member and sample, as Bootstrapped DQN's masks.

    Row i weights member i's loss over a batch (or a dataset) that all members share;
    pass it with ``in_dims=0`` and reduce each member's per-sample losses with
    [`weighted_mean`][funcensemble.weighted_mean]. Every entry is drawn independently:

    - ``"bernoulli"``: 1 with probability ``p`` (0.5 if not given), else 0: each member
      sees about a fraction ``p`` of the samples (Osband et al., 2016).
    - ``"poisson"``: a Poisson(1) count, the online ("Poisson") bootstrap: it
      approximates the counts of a resample with replacement.
    - ``"multinomial"``: the exact bootstrap of a fixed dataset: row i counts how often
      each sample appears in member i's row of
      [`bootstrap_indices`][funcensemble.bootstrap_indices]``(num_members,
      num_samples, generator=generator)``, so its weighted mean over the dataset is
      the plain mean over that resample.

    Args:
        num_members: N, the number of members.
        num_samples: The batch (or dataset) size.
        distribution: Which weights to draw.
        p: ``"bernoulli"`` only: the probability of keeping a sample, in ``(0, 1]``.
        dtype: A floating-point dtype; defaults to ``torch.get_default_dtype()``.
        generator: The random generator to draw from (or the global generator).

    Returns:
        A ``[N, num_samples]`` tensor of non-negative whole numbers (0/1 for
        ``"bernoulli"``).

    Raises:
        TypeError: A count that is not an int, a ``p`` that is not a number, or a
            ``dtype`` that is not floating point.
        ValueError: A count below 1, an unknown ``distribution``, a ``p`` outside
            ``(0, 1]``, or a ``p`` given for another distribution.

    Example:
        >>> import torch, funcensemble as fe
        >>> g = torch.Generator().manual_seed(0)
        >>> masks = fe.bootstrap_masks(4, 32, p=0.5, generator=g)  # Bootstrapped DQN
        >>> masks.shape, set(masks.unique().tolist()) <= {0.0, 1.0}
        (torch.Size([4, 32]), True)
        >>> counts = fe.bootstrap_masks(4, 32, distribution="multinomial", generator=g)
        >>> counts.sum(dim=1).tolist()  # each member resamples 32 items
        [32.0, 32.0, 32.0, 32.0]
    """
    where = "bootstrap_masks"
    _positive_int(where, "num_members", num_members)
    _positive_int(where, "num_samples", num_samples)
    if distribution not in ("bernoulli", "poisson", "multinomial"):
        raise ValueError(
            f"{where}: unknown distribution (expected 'bernoulli', 'poisson' or "
            f"'multinomial', got {distribution!r}). Pass one of those three."
        )
    if p is not None and distribution != "bernoulli":
        raise ValueError(
            f"{where}: p is the keep probability of the 'bernoulli' masks; "
            f"distribution={distribution!r} takes no p. Leave p out."
        )
    if p is None:
        p = 0.5
    if isinstance(p, numbers.Real) and not isinstance(p, bool):
        p = float(p)  # (a NumPy number too)
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(
            f"{where}: p must be a float in (0, 1] (expected a float, got {type(p).__name__}). "
            "Pass p as a float, e.g. 0.5."
        )
    if not 0.0 < p <= 1.0:
        raise ValueError(
            f"{where}: p must lie in (0, 1] (expected 0 < p <= 1, got {p!r}). Pass a "
            "probability above 0, at most 1."
        )
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"{where}: dtype must be a floating-point torch.dtype (expected e.g. "
            f"torch.float32, got {dtype!r}). Pass a floating-point dtype."
        )
    shape = (num_members, num_samples)
    if distribution == "bernoulli":
        return (torch.rand(shape, generator=generator, dtype=torch.float64) < p).to(dtype)
    if distribution == "poisson":
        rate = torch.ones(shape, dtype=torch.float64)
        return torch.poisson(rate, generator=generator).to(dtype)
    idx = bootstrap_indices(num_members, num_samples, generator=generator)
    counts = torch.zeros(shape, dtype=dtype)
    return counts.scatter_add_(1, idx, torch.ones(shape, dtype=dtype))


def _reduced_dims(where: str, dim: object, ndim: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) and not isinstance(dim, bool) else dim
    if not isinstance(dims, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in dims
    ):
        raise TypeError(
            f"{where}: dim must be None, an int or a tuple of ints (expected e.g. -1 or (1, 2), "
            f"got {dim!r}). Name the dimensions to reduce over."
        )
    # As torch's reductions do, a 0-dim tensor takes dim 0 or -1 (it counts as 1-dim).
    rank = max(ndim, 1)
    out = []
    for d in dims:
        if not -rank <= d < rank:
            raise ValueError(
                f"{where}: dim {d} is out of range for values with {ndim} dimension(s) "
                f"(expected a dim from {-rank} to {rank - 1}). Name dimensions of values."
            )
        out.append(d % rank)
    if not out:
        raise ValueError(f"{where}: dim is an empty tuple; pass None to reduce every dim.")
    if len(set(out)) != len(out):
        raise ValueError(f"{where}: dim {dim!r} names a dimension twice. Name each dimension once.")
    return tuple(out)


def weighted_mean(
    values: Float[Tensor, "*sample"],
    weights: Float[Tensor, "*sample"],
    *,
    dim: int | tuple[int, ...] | None = None,
    normalize: Normalize = "weights",
) -> Float[Tensor, "*rest"]:
    """The weighted mean of per-sample losses: one member's loss under its own weights.

    With ``normalize="weights"`` it is ``sum(w * values) / sum(w)`` over ``dim``, the
    mean over the samples the member keeps, each counted ``w`` times. A member whose
    weights sum to 0 (its mask dropped every sample of this batch) gets a loss of
    exactly 0 and a gradient of exactly 0, never the NaN of ``0 / 0``: its optimizer
    still steps with that zero gradient, as ``torch.optim`` does for a module whose
    loss is a zero constant (Adam's moments decay and its step count advances). To
    leave such a member out of a step instead, draw masks that give it samples.

    With ``normalize="samples"`` it is ``sum(w * values) / n`` with ``n`` the number of
    entries reduced, whatever the mask (what ``(mask * loss).mean()`` computes): a
    member that keeps fewer samples gets a smaller loss and gradient.

    A sample of weight 0 is left out of the value entirely, even if its loss is inf or
    NaN. Weights are used as given (negative ones included, as the loop's formula
    would), except that weights summing to exactly 0 give 0, whatever their signs,
    as an empty mask does: no value check runs, so that nothing syncs the device in
    a training step.

    Gradients are the formula's, at a weight of 0 too: a weight's gradient is its
    sample's value over the divisor (less ``result / sum(w)`` for ``"weights"``), the
    signal that weights learned from 0 need. Besides the empty member above, one
    exception: a sample of weight 0 whose loss is inf or NaN counts as a loss of 0,
    so its weight's gradient is 0 (``-result / sum(w)`` for ``"weights"``) where the
    formula's would be inf or NaN; its value's gradient is 0, as the formula's.

    Inside a one-member ``loss_fn`` (functional face) leave ``dim=None`` to reduce
    all of the member's samples; on stacked ``[N, batch]`` losses (module face) pass
    ``dim=1`` to get one loss per member.

    Args:
        values: Per-sample losses (``reduction="none"``).
        weights: One weight per entry of ``values`` (usually ``>= 0``), same shape.
        dim: The dims to reduce; ``None`` reduces all of them.
        normalize: ``"weights"`` divides by the sum of the weights, ``"samples"`` by
            the number of entries.

    Returns:
        ``values`` reduced over ``dim``.

    Raises:
        TypeError: A tensor argument that is not a floating-point tensor, or a ``dim``
            that is not an int or a tuple of ints.
        ValueError: Shapes that differ, a ``dim`` out of range, or an unknown
            ``normalize``.

    Example:
        >>> import torch, funcensemble as fe
        >>> losses = torch.tensor([[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]])  # [member, batch]
        >>> masks = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
        >>> fe.weighted_mean(losses, masks, dim=1).tolist()  # member 1 kept nothing
        [2.0, 0.0]
        >>> (3 * fe.weighted_mean(losses, masks, dim=1, normalize="samples")).tolist()
        [4.0, 0.0]
    """
    where = "weighted_mean"
    for name, t in (("values", values), ("weights", weights)):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"{where}: {name} must be a tensor (expected a floating-point tensor, got "
                f"{type(t).__name__}). Convert it with torch.as_tensor."
            )
        if not t.is_floating_point():
            fix = (
                ".to(values.dtype)"
                if name == "weights"
                else "a float dtype (.double(), or the loss's dtype)"
                + (
                    "; a complex loss has no order: reduce it to a real one first"
                    if t.is_complex()
                    else ""
                )
            )
            raise TypeError(
                f"{where}: {name} must be a floating-point tensor (expected a floating-point "
                f"dtype, got dtype {t.dtype}). Convert it with {fix}."
            )
    if values.shape != weights.shape:
        raise ValueError(
            f"{where}: weights must have the shape of values, one weight per sample (expected "
            f"{tuple(values.shape)}, got weights {tuple(weights.shape)} and values "
            f"{tuple(values.shape)}). Reduce the "
            "loss to one value per sample first (e.g. .mean(-1)), or expand the weights."
        )
    if normalize not in ("weights", "samples"):
        raise ValueError(
            f"{where}: normalize must be 'weights' or 'samples' (expected one of those, got "
            f"{normalize!r}). Pass normalize='weights' or normalize='samples'."
        )
    dims = _reduced_dims(where, dim, values.dim())
    # Zero a value that is not finite where its weight is 0, so that 0 * inf does not
    # make the sum NaN; mask the value, not the product, so that d/dweights stays the
    # formula's (the value itself), also at a weight of 0.
    weighted = weights * torch.where((weights != 0) | values.isfinite(), values, 0)
    if normalize == "samples":
        # .mean itself, as (mask * loss).mean() runs it: in half precision it sums in
        # float32 (a float16 sum of 10,000 tens is inf) and rounds once.
        return weighted.mean(dim=dims)
    total = weighted.sum(dim=dims)
    weight = weights.sum(dim=dims)
    empty = weight == 0
    # Route an empty member around the division, so that neither its value nor its
    # gradient (which 0 / 0 would make NaN) depends on the other branch.
    return torch.where(empty, 0, total / torch.where(empty, 1, weight))
