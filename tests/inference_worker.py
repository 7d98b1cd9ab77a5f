"""One rank of test_inference.py's three-rank run (run as a script, not collected).

``python inference_worker.py OUTDIR`` with the launcher's environment (3 ranks). In one
launch it runs ``fe.distributed.predict`` with every reduction

- on the default one-dimensional mesh, 7 members split 3 + 2 + 2, the batch broadcast
  from rank 0 (the other ranks pass empty tensors), in float64 and float32;
- on a ``(1, 3)`` ``("member", "data")`` mesh: every rank holds all 7 members and runs a
  third of the batch, the reduced parts gathered along ``"data"``; and reductions given
  as functions that keep the member axis (``all_gather``) or return a dict, on a batch
  whose third is N samples (each replica's ``[N, B/3]`` looks batch first);

and writes each rank's results to OUTDIR. ``make_member``, ``batch`` and ``reductions``
are also what the test uses for the single-process reference.
"""

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

import funcensemble as fe

NUM_MEMBERS = 7  # uneven on 3 ranks: 3 + 2 + 2
BATCH, FEATURES, CLASSES = 12, 5, 4
NAMES = (
    "mean",
    "var",
    "std",
    "min",
    "max",
    "mean_probs",
    "mean_log_probs",
    "predictive_entropy",
    "expected_entropy",
    "mutual_information",
)
EXACT = ("min", "max", "subset_min", "subset_min_per_sample")
DTYPES = (torch.float64, torch.float32)


def make_member() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def batch(dtype: torch.dtype) -> Tensor:
    """Inputs whose outputs sit far from 0, so that a one-pass variance would show."""
    g = torch.Generator().manual_seed(1)
    return (3 * torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)).to(dtype)


def reductions(reduce: Any) -> dict[str, Any]:
    """The named reductions plus subset_min with fixed generators, for ``fe.reduce``
    (``reduce(x)``) or ``fe.distributed`` (``reduce(x, shard)``)."""

    def subset(per_sample: bool) -> Any:
        def fn(*args: Any) -> Tensor:
            g = torch.Generator().manual_seed(3)
            return reduce.subset_min(*args, 3, generator=g, per_sample=per_sample)

        return fn

    out = {name: getattr(reduce, name) for name in NAMES}
    return {**out, "subset_min": subset(False), "subset_min_per_sample": subset(True)}


def custom_batch() -> Tensor:
    """``3 * NUM_MEMBERS`` samples: each of 3 data replicas runs N of them."""
    g = torch.Generator().manual_seed(4)
    return torch.randn(3 * NUM_MEMBERS, FEATURES, generator=g, dtype=torch.float64)


def extremes(local: Tensor, shard: fe.distributed.MemberShard) -> dict[str, Tensor]:
    """A reduction returning a pytree."""
    return {"min": fe.distributed.min(local, shard), "max": fe.distributed.max(local, shard)}


def with_nans() -> Tensor:
    """Outputs ``[N, 8]`` with NaNs in members of every rank, in different columns."""
    values = torch.randn(NUM_MEMBERS, 8, generator=torch.Generator().manual_seed(2))
    for member, column in ((0, 0), (4, 1), (6, 2), (1, 3), (5, 3)):
        values[member, column] = float("nan")
    return values


def members(shard: fe.distributed.MemberShard, dtype: torch.dtype) -> fe.Ensemble:
    ens = shard.from_factory(make_member, seed=0).to(dtype)
    # Outputs far from 0 next to their spread: the variance's two passes matter.
    with torch.no_grad():
        ens.stacked[2].bias.add_(50.0)
    return ens


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for dtype in DTYPES:
        shard = fe.distributed.MemberShard(NUM_MEMBERS)
        x = batch(dtype) if rank == 0 else torch.empty(BATCH, FEATURES, dtype=dtype)
        got = fe.distributed.predict(
            members(shard, dtype), shard, x, reductions=reductions(fe.distributed), src=0
        )
        results[f"member {dtype}"] = got
    # NaN outputs: the selecting reductions must keep them as torch.amin does.
    shard = fe.distributed.MemberShard(NUM_MEMBERS)
    values = with_nans()[shard.members]
    results["nan"] = {
        name: fn(values, shard) for name, fn in reductions(fe.distributed).items() if name in EXACT
    }
    mesh = init_device_mesh("cpu", (1, 3), mesh_dim_names=("member", "data"))
    shard = fe.distributed.MemberShard(NUM_MEMBERS, mesh=mesh)
    results["data"] = {"data_rank": shard.data_rank}
    results["data float64"] = fe.distributed.predict(
        members(shard, torch.float64),
        shard,
        batch(torch.float64),
        reductions=reductions(fe.distributed),
    )
    results["custom"] = fe.distributed.predict(
        members(shard, torch.float64),
        shard,
        custom_batch(),
        reductions={"all": fe.distributed.all_gather, "extremes": extremes},
    )
    # A pytree output with a leaf without a batch axis: kept where every replica holds
    # the same (a review found it refused), refused where it came from the replica's
    # part of the batch (one process would compute it from the whole batch).
    ens = members(shard, torch.float64)

    def with_weights(x: Tensor) -> tuple[Tensor, Tensor]:
        return ens(x), ens.stacked[0].weight.sum(dim=(1, 2))

    def with_batch_means(x: Tensor) -> tuple[Tensor, Tensor]:
        out = ens(x)
        return out, out.mean(dim=(1, 2))

    first = {"first": lambda out, s: fe.distributed.mean(out[0], s)}
    results["aux"] = fe.distributed.predict(with_weights, shard, custom_batch(), reductions=first)
    try:
        fe.distributed.predict(with_batch_means, shard, custom_batch(), reductions=first)
        results["batch aux"] = None
    except ValueError as error:
        results["batch aux"] = str(error)
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
