"""Scaling out: an ensemble's members spread over devices, processes and machines.

Members are split: each device or rank holds a contiguous slice of the members (sizes
from [`member_slices`][funcensemble.distributed.member_slices]) and runs it as one
vectorized call. Across processes the ranks form a ``DeviceMesh`` whose ``"member"``
axis splits the members and whose optional ``"data"`` axis splits each member's batch
([`average_gradients`][funcensemble.distributed.average_gradients]).

- One process, several devices:
  [`ShardedEnsemble`][funcensemble.distributed.ShardedEnsemble].
- Several processes or machines, through ``torch.distributed``:
  [`init_process_group`][funcensemble.distributed.init_process_group], each rank's
  [`MemberShard`][funcensemble.distributed.MemberShard], collectives over all members
  ([`all_gather`][funcensemble.distributed.all_gather],
  [`mean`][funcensemble.distributed.mean], ...), inference of all members in one
  call ([`predict`][funcensemble.distributed.predict]) and sharded checkpoints
  ([`save`][funcensemble.distributed.save], [`load`][funcensemble.distributed.load])
  through ``torch.distributed.checkpoint``. A failure that involves another rank
  raises a [`DistributedError`][funcensemble.distributed.DistributedError] naming this
  rank, what it waited for and how long.
"""

from ._collectives import all_gather as all_gather
from ._collectives import broadcast as broadcast
from ._collectives import max as max
from ._collectives import mean as mean
from ._collectives import min as min
from ._collectives import std as std
from ._collectives import subset_min as subset_min
from ._collectives import var as var
from ._data_parallel import average_gradients as average_gradients
from ._errors import DistributedError as DistributedError
from ._inference import predict as predict
from ._init_mesh import init_mesh as init_mesh
from ._member_shard import MemberShard as MemberShard
from ._member_shard import init_process_group as init_process_group
from ._per_shard import PerShard as PerShard
from ._sharded_checkpoint import load as load
from ._sharded_checkpoint import save as save
from ._sharded_ensemble import ShardedEnsemble as ShardedEnsemble
from ._slices import member_slices as member_slices
from ._uncertainty import expected_entropy as expected_entropy
from ._uncertainty import mean_log_probs as mean_log_probs
from ._uncertainty import mean_probs as mean_probs
from ._uncertainty import mutual_information as mutual_information
from ._uncertainty import predictive_entropy as predictive_entropy

__all__ = [
    "DistributedError",
    "MemberShard",
    "PerShard",
    "ShardedEnsemble",
    "all_gather",
    "average_gradients",
    "broadcast",
    "expected_entropy",
    "init_mesh",
    "init_process_group",
    "load",
    "max",
    "mean",
    "mean_log_probs",
    "mean_probs",
    "member_slices",
    "min",
    "mutual_information",
    "predict",
    "predictive_entropy",
    "save",
    "std",
    "subset_min",
    "var",
]
