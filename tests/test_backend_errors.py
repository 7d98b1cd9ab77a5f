"""An NCCL failure (``torch.distributed.DistBackendError``) surfaces as a
``fe.distributed.DistributedError`` naming the rank and the operation, in one process:
the collectives are replaced by functions that raise what ProcessGroupNCCL raises."""

import re

import pytest
import torch
import torch.distributed as dist
from test_distributed import fake_shard

import funcensemble as fe
from funcensemble.distributed import _gather
from funcensemble.distributed._backend_errors import backend_hint

WATCHDOG = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
    "OpType=ALLREDUCE, NumelIn=6, NumelOut=6, Timeout(ms)=60000) ran for 60012 "
    "milliseconds before timing out.\nException raised from checkTimeout at "
    "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:632 (most recent call "
    "first):\nframe #0: c10::Error::Error(...)"
)
ABORTED = "NCCL communicator was aborted on rank 1."


def _raise(message):
    def collective(*args, **kwargs):
        raise dist.DistBackendError(message)

    return collective


def _gather_own_layout(out, mine, group=None):
    """A layout exchange in which every rank passed this rank's layout."""
    out.copy_(mine.repeat(out.numel() // mine.numel()))


def _check(error, where, cause_start):
    assert isinstance(error, fe.distributed.DistributedError)
    assert isinstance(error.__cause__, dist.DistBackendError)
    assert (error.rank, error.world_size, error.operation) == (0, 3, where)
    text = str(error)
    assert text.startswith(f"{where}: rank 0 of 3 failed while waiting for the other ranks")
    assert "TORCH_NCCL_BLOCKING_WAIT=1" in text and "NCCL_DEBUG=WARN" in text
    assert f"Cause: DistBackendError: {cause_start}" in text
    assert "Exception raised from" not in text  # no C++ trace


@pytest.mark.parametrize("message", [WATCHDOG, ABORTED], ids=["watchdog", "aborted"])
def test_a_failed_nccl_reduction_is_a_distributed_error(monkeypatch, message):
    shard = fake_shard(7, 0, 3)
    local = torch.randn(shard.size, 2, 4, dtype=torch.float64)
    monkeypatch.setattr(dist, "all_gather_single", _gather_own_layout, raising=False)
    monkeypatch.setattr(dist, "all_reduce", _raise(message))
    d = fe.distributed
    for name in ("mean", "var", "mutual_information", "expected_entropy"):
        with pytest.raises(d.DistributedError) as info:
            getattr(d, name)(local, shard)
        _check(info.value, name, message.split("\n")[0][:40])
    with pytest.raises(d.DistributedError) as info:
        d.predict(lambda x: local, shard, torch.zeros(2), reductions=["mean"])
    _check(info.value, "mean", message[:40])


def test_a_failed_nccl_exchange_of_layouts_is_a_distributed_error(monkeypatch):
    shard = fake_shard(7, 0, 3)
    monkeypatch.setattr(dist, "all_gather_single", _raise(WATCHDOG), raising=False)
    with pytest.raises(fe.distributed.DistributedError) as info:
        fe.distributed.max(torch.randn(shard.size, 4), shard)
    _check(info.value, "max", "[Rank 0] Watchdog caught collective operation timeout")


def _replicas_agree(out, mine, group=None):
    """The replicas' tree digests (and refusal flags), as a replica that agrees with this
    one sends them."""
    out.copy_(mine.repeat(out.numel() // mine.numel()))


def test_a_failed_nccl_gradient_average_is_a_distributed_error(monkeypatch):
    shard = fe.distributed.MemberShard(3)
    shard.data_rank, shard.data_size = 0, 2  # replica 0 of 2
    monkeypatch.setattr(_gather, "all_gather_single", _replicas_agree)
    monkeypatch.setattr(dist, "all_reduce", _raise(ABORTED))
    with pytest.raises(fe.distributed.DistributedError) as info:
        fe.distributed.average_gradients({"w": torch.ones(3, 2)}, shard)
    assert re.match(r"average_gradients: rank 0 of 2 failed while averaging", str(info.value))
    assert "TORCH_NCCL_BLOCKING_WAIT=1" in str(info.value)
    assert isinstance(info.value.__cause__, dist.DistBackendError)


def test_a_failed_nccl_check_of_the_replicas_trees_is_a_distributed_error(monkeypatch):
    shard = fe.distributed.MemberShard(3)
    shard.data_rank, shard.data_size = 0, 2
    monkeypatch.setattr(_gather, "all_gather_single", _raise(ABORTED))
    with pytest.raises(fe.distributed.DistributedError) as info:
        fe.distributed.average_gradients({"w": torch.ones(3, 2)}, shard)
    assert re.match(
        r"average_gradients: rank 0 of 2 failed while checking the trees of 2 data replicas",
        str(info.value),
    )
    assert isinstance(info.value.__cause__, dist.DistBackendError)


def test_only_backend_failures_get_the_nccl_advice():
    assert backend_hint(dist.DistBackendError("x")).startswith(" The communication backend")
    assert backend_hint(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp")) != ""
    assert backend_hint(RuntimeError("Connection closed by peer")) == ""
    assert backend_hint(None) == ""
