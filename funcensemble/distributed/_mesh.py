"""The device mesh under ``MemberShard``: a ``"member"`` axis, and optionally ``"data"``.

Members are split over the ``"member"`` axis of a ``torch.distributed`` ``DeviceMesh``;
a second axis, ``"data"``, holds replicas of the same members, each fed its part of
every batch (data parallelism within each member). Without a mesh from the user, a
one-dimensional ``("member",)`` mesh is built over the process group.

A rank's rows of a member-stacked tensor are handed to ``torch.distributed.checkpoint``
as a DTensor on this mesh, ``Shard(0)`` over ``"member"`` (and ``Replicate()`` over
``"data"``), so that DCP's default planners place them in the global ``[N, ...]``
tensor and write one copy per member. DTensor's own ``Shard(0)`` splits like
``torch.chunk`` (5 members on 4 ranks: 2, 2, 1, 0); our split never leaves a rank
empty (2, 1, 1, 1), so the DTensor's local tensor is torch's ``LocalShardsWrapper``,
which tells DCP each rank's actual offset (as torchrec does for its uneven shards).
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._torch_compat import local_shards_wrapper

MEMBER, DATA = "member", "data"
_NAMES = ((MEMBER,), (MEMBER, DATA))


@dataclass(frozen=True)
class Axes:
    """A rank's place on the mesh: its member group (``rank`` of ``size``) and data group."""

    mesh: Any  # DeviceMesh, or None without torch.distributed
    member_group: Any
    member_rank: int
    member_size: int
    data_group: Any
    data_rank: int
    data_size: int


def _device_type(group: Any) -> str:
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def default_mesh(group: Any) -> Any:
    """A one-dimensional ``("member",)`` mesh over ``group`` (the default group if None)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    device_type = _device_type(group)
    if group is None:
        return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=(MEMBER,))
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(MEMBER,))


def mesh_axes(where: str, mesh: Any) -> Axes:
    """Check a user's mesh and say where this rank lies on it."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{where}: mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(mesh).__name__}. Build it with init_device_mesh(device_type, (M, D), "
            'mesh_dim_names=("member", "data")).'
        )
    names = tuple(mesh.mesh_dim_names or ())
    if names not in _NAMES:
        raise ValueError(
            f"{where}: the mesh's dimensions are named {names or 'nothing'} (expected "
            f'("member",) or ("member", "data"), got {names or "nothing"}). Pass '
            "mesh_dim_names to init_device_mesh."
        )
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(
            f"{where}: the mesh spans {mesh.size()} ranks, but the process group has "
            f"{world}. Build the mesh over all ranks, e.g. with (M, D) such that "
            f"M * D = {world}."
        )
    if len(names) == 1:
        data_group, data_rank, data_size = None, 0, 1
    else:
        data_group = mesh.get_group(DATA)
        data_rank, data_size = mesh.get_local_rank(DATA), mesh.size(1)
    return Axes(
        mesh=mesh,
        member_group=mesh.get_group(MEMBER),
        member_rank=mesh.get_local_rank(MEMBER),
        member_size=mesh.size(0),
        data_group=data_group,
        data_rank=data_rank,
        data_size=data_size,
    )


def member_dtensor(where: str, rows: Tensor, start: int, num_members: int, mesh: Any) -> Tensor:
    """This rank's ``rows`` (members ``start:start + n``) as a DTensor of ``[N, ...]``.

    ``Shard(0)`` over ``"member"``, ``Replicate()`` over ``"data"``: DCP writes each
    member's rows once (from the lowest rank that holds them) and reads them on any
    mesh. It is a view for checkpoints, not for computing.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    wrapper_type = local_shards_wrapper()
    if wrapper_type is None:
        raise RuntimeError(
            f"{where}: sharded checkpoints on several ranks need DTensor's "
            f"LocalShardsWrapper, which torch {torch.__version__} lacks. Use torch 2.6 or "
            "later."
        )
    rows = rows.detach()
    wrapper = wrapper_type([rows], [(start,) + (0,) * (rows.dim() - 1)])
    shape = torch.Size((num_members, *rows.shape[1:]))
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        wrapper, mesh, placements, run_check=False, shape=shape, stride=stride
    )
