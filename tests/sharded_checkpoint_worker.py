"""One rank of test_sharded_checkpoint.py's two-rank test (run as a script, not collected).

``python sharded_checkpoint_worker.py DIR`` with MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE=2 set: both ranks save 5 members (3 + 2) to ``DIR``, rank 0 flips one bit in
the middle of rank 1's data file, and both load. Rank 1 reads that file and rank 0 does
not; each prints ``loaded`` or ``ERROR <message>``. Then both save two intact
checkpoints beside it (steps 3 and 6) and each rank loads another one (as a stale
directory listing on one machine would make them), printing ``loaded apart`` or
``APART <message>``. Last, each rank saves to a path of its own, printing ``saved split``
or ``SPLIT <message> metadata=<whether its path holds a .metadata>``.
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import funcensemble as fe


def main() -> None:
    path = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    shard = fe.distributed.MemberShard(5)
    ens = fe.Ensemble.from_factory(lambda: torch.nn.Linear(4, 2), num_members=5, seed=0)
    params = {k: v.detach()[shard.members].clone() for k, v in ens.stacked_params().items()}
    fe.distributed.save(path, {"params": params, "step": 3}, shard)
    dist.barrier()
    if int(os.environ["RANK"]) == 0:
        data = bytearray((path / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 1
        (path / "__1_0.distcp").write_bytes(data)
    dist.barrier()
    template = {"params": {k: torch.zeros_like(v) for k, v in params.items()}, "step": 0}
    try:
        fe.distributed.load(path, template, shard)
        print("loaded", flush=True)
    except ValueError as error:
        print(f"ERROR {error}", flush=True)
    for step in (3, 6):
        saved = {k: v + step for k, v in params.items()}
        fe.distributed.save(path.parent / f"step-{step}", {"params": saved, "step": step}, shard)
    mine = path.parent / ("step-6" if int(os.environ["RANK"]) == 0 else "step-3")
    try:
        fe.distributed.load(mine, template, shard)
        print("loaded apart", flush=True)
    except ValueError as error:
        print(f"APART {error}", flush=True)
    split = path.parent / f"step-9-rank{os.environ['RANK']}"
    try:
        fe.distributed.save(split, {"params": params, "step": 9}, shard)
        print("saved split", flush=True)
    except fe.distributed.DistributedError as error:
        print(f"SPLIT {error} metadata={(split / '.metadata').exists()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
