"""Inference across ranks: ``fe.distributed.predict`` and the entropy family of reductions.

The three-rank run (``inference_worker.py``) computes every reduction of 7 members
split 3 + 2 + 2, and on a ``(1, 3)`` members × data mesh; each must equal the
single-process ``fe.reduce`` result on all members' outputs: bit for bit for the
reductions that select (min, max, subset_min), to a stated tolerance for those that add
in another order across ranks.
"""

from pathlib import Path

import inference_worker as worker
import pytest
import torch
from helpers import runtime_typecheck_off
from test_distributed import check_all_succeeded, fake_shard, launch

import funcensemble as fe
from funcensemble.distributed import MemberShard

WORKER = Path(worker.__file__)
# Largest difference allowed from the one-process result, for the reductions that add
# (outputs around 50, entropies around 1).
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def _reference(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    ens = worker.members(MemberShard(worker.NUM_MEMBERS), dtype)
    with torch.no_grad():
        outputs = ens(worker.batch(dtype))
    return {name: fn(outputs) for name, fn in worker.reductions(fe.reduce).items()}


# --- one process -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", worker.DTYPES, ids=str)
def test_one_rank_is_fe_reduce_bit_for_bit(dtype):
    shard = MemberShard(worker.NUM_MEMBERS)
    got = fe.distributed.predict(
        worker.members(shard, dtype),
        shard,
        worker.batch(dtype),
        reductions=worker.reductions(fe.distributed),
    )
    want = _reference(dtype)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def _simulate(monkeypatch, world: int, fn):
    """``fn(rank)`` on ``world`` threads, as ranks whose all-reduces meet in this process
    (in rank order); returns each rank's result."""
    import threading

    from funcensemble.distributed import _uncertainty

    barrier, slots = threading.Barrier(world), [None] * world
    ops = {"SUM": lambda ts: sum(ts[1:], ts[0]), "MAX": lambda ts: torch.stack(ts).amax(0)}

    def all_reduce(where, shard, t, op):
        slots[shard.rank] = t.clone()
        barrier.wait()
        out = ops[str(op).rsplit(".", 1)[-1]](slots)
        barrier.wait()
        return out

    monkeypatch.setattr(_uncertainty, "_all_reduce", all_reduce)
    results = [None] * world

    def run(rank):
        results[rank] = fn(rank)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("world", [2, 3, 7])
def test_the_split_logsumexp_stays_finite_and_close(monkeypatch, world):
    # Huge, opposed and masked logits: the split logsumexp must stay finite and exact.
    logits = torch.randn(7, 6, 5, dtype=torch.float64) * 30
    logits[0, 0] = torch.tensor([1e4, 0, 0, 0, -1e4])
    logits[:, 1, 2] = float("-inf")
    d = fe.distributed

    def on_rank(rank):
        shard = fake_shard(7, rank, world)
        mine = logits[shard.members]
        return {
            name: getattr(d, name)(mine, shard)
            for name in ("mean_log_probs", "predictive_entropy", "mutual_information")
        } | {"expected_entropy": d.expected_entropy(mine, shard)}

    for got in _simulate(monkeypatch, world, on_rank):
        for name, value in got.items():
            want = getattr(fe.reduce, name)(logits)
            assert value.isfinite().all(), name
            torch.testing.assert_close(value, want, rtol=0, atol=1e-12)


def test_predict_checks_its_arguments():
    shard = MemberShard(3)
    ens = shard.from_factory(lambda: torch.nn.Linear(2, 3))
    x = torch.randn(4, 2)
    predict = fe.distributed.predict
    with pytest.raises(
        ValueError,
        match=r"unknown reduction 'median' \(expected one of \[.*\], got 'median'\)\. Pick",
    ):
        predict(ens, shard, x, reductions=["mean", "median"])
    with pytest.raises(
        ValueError, match=r"reductions is empty \(expected at least one reduction, got none\)"
    ):
        predict(ens, shard, x, reductions=[])
    with runtime_typecheck_off():
        with pytest.raises(
            TypeError, match=r"shard is not a MemberShard \(expected a fe\.distributed\.MemberShard"
        ):
            predict(ens, 3, x)
        with pytest.raises(
            TypeError,
            match=r"model must be callable \(expected a function of the inputs, got Tensor\)",
        ):
            predict(x, shard, x)
        with pytest.raises(TypeError, match=r"map names \(str\) to functions"):
            predict(ens, shard, x, reductions={"m": 3})
        with pytest.raises(TypeError, match="reductions must be a sequence of names"):
            predict(ens, shard, x, reductions=3)
    with pytest.raises(
        ValueError,
        match=r"predict: the model's output has leading size 4, but rank 0 holds 3 members",
    ):
        predict(lambda x: x, shard, x)
    with pytest.raises(
        ValueError, match=r"predict: the model's output has leading size 2, but rank 0"
    ):
        predict(fe.Ensemble([torch.nn.Linear(2, 3) for _ in range(2)]), shard, x)
    with pytest.raises(
        ValueError, match=r"predict: the model's output has leading size no member axis"
    ):
        predict(lambda x: x.sum(), shard, x)
    with pytest.raises(
        ValueError,
        match=r"src must be a rank in 0\.\.0 \(expected an int rank of the group, got 1\)",
    ):
        predict(ens, shard, x, src=1)
    # A single name, and a mapping to any reduction function.
    with torch.no_grad():  # predict's own mode: autograd on may round differently
        outputs = ens(x)
    assert torch.equal(predict(ens, shard, x, reductions="max")["max"], outputs.amax(0))
    got = predict(ens, shard, x, reductions={"spread": fe.distributed.var})
    assert torch.equal(got["spread"], fe.reduce.var(outputs))


def test_predict_splits_the_batch_over_data_replicas():
    shard = MemberShard(3)
    shard.data_rank, shard.data_size = 1, 2  # replica 1 of 2, as on a (M, 2) mesh
    seen = []

    def model(x, y):
        seen.append((x.clone(), y))
        raise RuntimeError("stop here")

    x = torch.arange(8.0)[:, None]
    with pytest.raises(RuntimeError, match="stop here"):
        fe.distributed.predict(model, shard, x, "label")
    assert torch.equal(seen[0][0], x[4:]) and seen[0][1] == "label"
    with pytest.raises(ValueError, match=r"got leading sizes \[6, 8\]"):
        fe.distributed.predict(model, shard, x, torch.zeros(6))
    with pytest.raises(ValueError, match="cannot be split into 2 equal parts"):
        fe.distributed.predict(model, shard, torch.zeros(7, 1))
    # A function as a reduction runs on the whole batch's outputs, joined along dim 1.
    with pytest.raises(
        ValueError,
        match=r"^predict: the model's output has shape \(3, 1\) on this data replica's 4 "
        r"samples \(expected this rank's members, then the batch: \(3, 4, \.\.\.\)\)",
    ):
        fe.distributed.predict(
            lambda x: torch.zeros(3, 1), shard, x, reductions={"all": fe.distributed.all_gather}
        )


@pytest.mark.parametrize(("rank", "world"), [(0, 3), (2, 3)])
def test_entropy_reductions_check_the_member_axis(rank, world):
    shard = fake_shard(7, rank, world)
    with pytest.raises(ValueError, match=rf"leading size 7, but rank {rank} holds"):
        fe.distributed.mutual_information(torch.zeros(7, 2, 3), shard)
    with (
        runtime_typecheck_off(),
        pytest.raises(
            ValueError,
            match=r"values has too few dimensions \(expected a tensor of shape \[N, \.\.\., C\]",
        ),
    ):
        fe.distributed.expected_entropy(torch.zeros(shard.size), shard)


# --- three ranks ---------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow  # three ranks start up on two shared cores
def test_three_ranks_reduce_as_one_process(tmp_path):
    ranks = launch(3, [str(tmp_path)], tmp_path, script=WORKER)
    check_all_succeeded(ranks)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    worst: dict[str, float] = {}
    for dtype in worker.DTYPES:
        want = _reference(dtype)
        for result in results:
            got = result[f"member {dtype}"]
            assert got.keys() == want.keys()
            for name, value in want.items():
                assert got[name].dtype == value.dtype and got[name].shape == value.shape
                if name in worker.EXACT:
                    assert torch.equal(got[name], value), name
                    continue
                error = (got[name] - value).abs().max().item()
                worst[f"{name} {dtype}"] = max(worst.get(f"{name} {dtype}", 0.0), error)
                assert error <= TOL[dtype], (name, dtype, error)
        # Every rank returns the same values.
        for result in results[1:]:
            for name, value in result[f"member {dtype}"].items():
                assert torch.equal(value, results[0][f"member {dtype}"][name]), name
    nans = worker.with_nans()
    for name, fn in worker.reductions(fe.reduce).items():
        if name in worker.EXACT:
            want_nan = fn(nans)
            assert want_nan.isnan().any(), name
            for result in results:
                torch.testing.assert_close(
                    result["nan"][name], want_nan, rtol=0, atol=0, equal_nan=True
                )
    want = _reference(torch.float64)
    assert sorted(r["data"]["data_rank"] for r in results) == [0, 1, 2]
    # subset_min_per_sample is a function, not a named reduction: it runs on the whole
    # batch's outputs (gathered along "data"), so it makes one process's draw.
    for result in results:  # (1, 3): all members, a third of the batch each, joined
        for name, value in want.items():
            # Not bit for bit even where nothing is added across ranks: the members'
            # matrix products on a third of the batch may round otherwise.
            torch.testing.assert_close(result["data float64"][name], value, rtol=0, atol=1e-12)
    # Functions that keep the member axis, or return a dict: each replica's [N, B/3]
    # all_gather was joined as if batch first, [3 N, B/3] (garbled, no error), and the
    # dict raised AttributeError. Now what each returns on the whole batch.
    ens = worker.members(MemberShard(worker.NUM_MEMBERS), torch.float64)
    with torch.no_grad():
        outputs = ens(worker.custom_batch())
    for result in results:
        got = result["custom"]
        assert got["all"].shape == outputs.shape == (7, 21, worker.CLASSES)
        torch.testing.assert_close(got["all"], outputs, rtol=0, atol=1e-12)
        for name in ("min", "max"):
            want_extreme = getattr(fe.reduce, name)(outputs)
            torch.testing.assert_close(got["extremes"][name], want_extreme, rtol=0, atol=1e-12)
        torch.testing.assert_close(result["aux"]["first"], outputs.mean(0), rtol=0, atol=1e-12)
        assert (
            "leaf `[1]` has shape (7,), no batch axis after the members, and differs"
            in (result["batch aux"])
        )
    print(f"largest difference from the one-process fe.reduce: {worst}")
