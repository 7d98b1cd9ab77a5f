"""Per-member data: bootstrap (bagging) index sets and a DataLoader sampler for them."""

from collections.abc import Iterator

import torch
from jaxtyping import Int
from torch import Tensor
from torch.utils.data import Sampler

from ._messages import boolean
from ._messages import positive_int as _positive_int


def bootstrap_indices(
    num_members: int,
    num_samples: int,
    *,
    sample_size: int | None = None,
    replace: bool = True,
    generator: torch.Generator | None = None,
) -> Int[Tensor, "member sample"]:
    """Draw one index set per member over a dataset of ``num_samples`` items.

    With ``replace=True`` (bagging) each member draws ``sample_size`` indices with
    replacement; with ``replace=False`` each member gets a random subset without
    repeats. Draws come from ``generator`` (or the global generator), so they are
    reproducible.

    Args:
        num_members: N, the number of members.
        num_samples: The dataset size; indices lie in ``[0, num_samples)``.
        sample_size: Indices per member; defaults to ``num_samples``.
        replace: Draw with replacement (bootstrap) or without (subsampling).
        generator: The random generator to draw from.

    Returns:
        An int64 tensor ``[N, sample_size]``: row i is member i's sample.

    Raises:
        TypeError: A count (``num_members``, ``num_samples``, ``sample_size``) that is
            not an int.
        ValueError: A count below 1, or without replacement a ``sample_size`` above
            ``num_samples``.

    Example:
        >>> import torch, funcensemble as fe
        >>> g = torch.Generator().manual_seed(0)
        >>> idx = fe.bootstrap_indices(5, 100, generator=g)
        >>> idx.shape, bool((idx < 100).all())
        (torch.Size([5, 100]), True)
    """
    return _indices("bootstrap_indices", num_members, num_samples, sample_size, replace, generator)


def _indices(
    where: str,
    num_members: int,
    num_samples: int,
    sample_size: int | None,
    replace: bool,
    generator: torch.Generator | None,
) -> Tensor:
    boolean(where, "replace", replace)
    _positive_int(where, "num_members", num_members)
    _positive_int(where, "num_samples", num_samples)
    size = num_samples if sample_size is None else sample_size
    _positive_int(where, "sample_size", size)
    if not replace and size > num_samples:
        raise ValueError(
            f"{where}: sample_size {size} exceeds num_samples {num_samples}; without "
            "replacement a member cannot draw more items than the dataset has."
        )
    if replace:
        return torch.randint(num_samples, (num_members, size), generator=generator)
    return _random_order(num_members, num_samples, generator)[:, :size]


def _random_order(rows: int, size: int, generator: torch.Generator | None) -> Tensor:
    """A uniformly random permutation of ``range(size)`` per row: float64 keys sorted
    (float32 has 2**24 values only, so large datasets would tie keys, which argsort
    breaks by position, not at random)."""
    keys = torch.rand(rows, size, generator=generator, dtype=torch.float64)
    return keys.argsort(dim=1)


class BaggingSampler(Sampler[list[int]]):
    """A DataLoader batch sampler that gives every member its own bootstrap sample.

    Each member owns a fixed index set (from [`bootstrap_indices`][funcensemble.bootstrap_indices]),
    reshuffled every epoch. Batch j holds ``batch_size`` items of each member's
    j-th chunk, member-major, so a collated batch of ``N * batch_size`` items is
    reshaped to ``[N, batch_size, ...]`` and passed with ``in_dims=0``.

    Args:
        num_members: N.
        num_samples: The dataset size.
        batch_size: Items per member per batch.
        sample_size: Items in each member's bootstrap set; defaults to ``num_samples``.
        replace: Bootstrap with replacement (bagging) or subsample without.
        drop_last: Drop a last, smaller batch.
        generator: Source of all randomness (index sets and shuffles).

    Example:
        >>> import torch, funcensemble as fe
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> data = TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
        >>> sampler = fe.BaggingSampler(4, len(data), batch_size=16,
        ...                             generator=torch.Generator().manual_seed(0))
        >>> x, y = next(iter(DataLoader(data, batch_sampler=sampler)))
        >>> x.view(4, 16, 3).shape  # one batch per member: use in_dims=0
        torch.Size([4, 16, 3])
    """

    def __init__(
        self,
        num_members: int,
        num_samples: int,
        batch_size: int,
        *,
        sample_size: int | None = None,
        replace: bool = True,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        self.batch_size = _positive_int("BaggingSampler", "batch_size", batch_size)
        boolean("BaggingSampler", "drop_last", drop_last)
        boolean("BaggingSampler", "replace", replace)
        self.generator = generator
        self.drop_last = drop_last
        self.indices = _indices(
            "BaggingSampler", num_members, num_samples, sample_size, replace, generator
        )

    @property
    def num_members(self) -> int:
        return self.indices.shape[0]

    def __len__(self) -> int:
        size = self.indices.shape[1]
        return size // self.batch_size if self.drop_last else -(-size // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        n, size = self.indices.shape
        order = _random_order(n, size, self.generator)
        shuffled = self.indices.gather(1, order)
        for j in range(len(self)):
            chunk = shuffled[:, j * self.batch_size : (j + 1) * self.batch_size]
            yield chunk.reshape(-1).tolist()
