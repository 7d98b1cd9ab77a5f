"""Bootstrap index sets and the per-member DataLoader sampler."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import funcensemble as fe
from tests.helpers import runtime_typecheck_off


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_bootstrap_is_reproducible_and_per_member():
    a = fe.bootstrap_indices(6, 50, generator=gen())
    b = fe.bootstrap_indices(6, 50, generator=gen())
    assert a.shape == (6, 50) and a.dtype == torch.int64
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1])
    assert int(a.min()) >= 0 and int(a.max()) < 50
    # Drawn with replacement: a bootstrap sample repeats items (about 63% unique).
    unique = torch.tensor([len(set(row.tolist())) for row in a], dtype=torch.float64)
    assert 0.5 < float(unique.mean()) / 50 < 0.75


def test_without_replacement_has_no_repeats():
    idx = fe.bootstrap_indices(4, 20, sample_size=10, replace=False, generator=gen())
    assert idx.shape == (4, 10)
    assert all(len(set(row.tolist())) == 10 for row in idx)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"num_members": 0, "num_samples": 5},
            r"num_members must be a positive int \(expected an int >= 1, got 0",
        ),
        (
            {"num_members": 2, "num_samples": -1},
            r"num_samples must be a positive int \(expected an int >= 1, got -1",
        ),
        (
            {"num_members": 2, "num_samples": 5, "sample_size": 6, "replace": False},
            "sample_size 6 exceeds num_samples 5",
        ),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fe.bootstrap_indices(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"num_members": 3.0}, {"num_samples": "5"}, {"sample_size": 2.5}]
)
def test_counts_of_the_wrong_type(kwargs):
    args = {"num_members": 2, "num_samples": 5, **kwargs}
    name = next(iter(kwargs))
    with (
        runtime_typecheck_off(),
        pytest.raises(
            TypeError, match=rf"{name} must be a positive int \(expected an int >= 1, got"
        ),
    ):
        fe.bootstrap_indices(**args)


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_gives_each_member_its_own_sample(drop_last):
    n, size, batch = 3, 40, 16
    data = TensorDataset(torch.arange(size).float().unsqueeze(1))
    sampler = fe.BaggingSampler(n, size, batch, drop_last=drop_last, generator=gen(1))
    batches = [x.view(n, -1) for (x,) in DataLoader(data, batch_sampler=sampler)]
    assert len(batches) == len(sampler) == (2 if drop_last else 3)
    seen = torch.cat(batches, dim=1).long()
    expected = sampler.indices if not drop_last else sampler.indices[:, : 2 * batch]
    for i in range(n):
        if drop_last:
            # The epoch's first two batches are a shuffled part of member i's sample.
            assert set(seen[i].tolist()) <= set(sampler.indices[i].tolist())
        else:
            # A full epoch visits member i's whole bootstrap sample, in a new order.
            assert sorted(seen[i].tolist()) == sorted(expected[i].tolist())


def test_sampler_batches_train_members_on_their_own_data():
    n = 2
    fmodel, params, buffers = fe.stack([torch.nn.Linear(1, 1) for _ in range(n)])
    data = TensorDataset(torch.randn(12, 1))
    sampler = fe.BaggingSampler(n, 12, 4, generator=gen(2))
    (x,) = next(iter(DataLoader(data, batch_sampler=sampler)))
    out = fe.vmap(fmodel, in_dims=0)(params, buffers, x.view(n, 4, 1))
    assert out.shape == (n, 4, 1)


def test_the_sampler_names_itself_in_its_errors():
    """Its checks ran in bootstrap_indices, whose name the messages gave."""
    with pytest.raises(ValueError, match=r"^BaggingSampler: num_members must be a positive int"):
        fe.BaggingSampler(0, 10, batch_size=2)
    with pytest.raises(ValueError, match=r"^BaggingSampler: sample_size 11 exceeds"):
        fe.BaggingSampler(2, 10, batch_size=2, sample_size=11, replace=False)


def test_random_orders_come_from_keys_fine_enough_not_to_tie():
    """Subsets and the per-epoch shuffle sorted float32 keys, which take 2**24 values:
    at 200,000 items about 1,200 keys tied, and argsort broke the ties by position, not
    at random. Float64 keys (2**53 values) do not tie at any dataset size in memory."""
    n = 200_000
    keys = torch.rand(2, n, generator=gen(3), dtype=torch.float64)
    assert keys.unique().numel() == 2 * n
    subset = fe.bootstrap_indices(2, n, sample_size=1000, replace=False, generator=gen(3))
    assert torch.equal(subset, keys.argsort(dim=1)[:, :1000])
    sampler = fe.BaggingSampler(2, n, batch_size=n, replace=False, generator=gen(3))
    order = torch.rand(2, n, generator=sampler.generator, dtype=torch.float64).argsort(dim=1)
    sampler.generator.manual_seed(3)
    torch.rand(2, n, generator=sampler.generator, dtype=torch.float64)  # the index sets' draw
    (batch,) = list(sampler)
    assert batch == sampler.indices.gather(1, order).flatten().tolist()
