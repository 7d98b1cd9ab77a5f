"""A ``("member", "data")`` device mesh whose groups keep the process group's timeout."""

import inspect
from typing import Any

import torch.distributed as dist

from .._messages import positive_int
from ._errors import group_timeout
from ._mesh import DATA, MEMBER, _device_type


def init_mesh(members: int, data: int = 1) -> Any:
    """A ``DeviceMesh`` of ``members`` member ranks by ``data`` data replicas, over every
    rank of the default process group, for ``MemberShard(N, mesh=...)``.

    ``torch.distributed.device_mesh.init_device_mesh`` gives a two-dimensional mesh's
    groups torch's default timeout (30 minutes), whatever timeout the process group
    was started with; here each group keeps that timeout (a minute from
    [`init_process_group`][funcensemble.distributed.init_process_group]), so a rank
    that stops answering is noticed as soon on a 2-D mesh as on one axis (torch 2.7
    and later; before, torch's default).

    Args:
        members: Ranks along ``"member"``, each holding its own share of the members.
        data: Ranks along ``"data"``, each holding the same members and its part of
            every batch. ``members * data`` must be the world size.

    Returns:
        The ``DeviceMesh``, on CUDA under NCCL and on the CPU under gloo.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
        ValueError: ``members * data`` is not the world size.

    Example:
        >>> import funcensemble as fe
        >>> # under torchrun --nproc-per-node 4:
        >>> # fe.distributed.init_process_group()
        >>> # shard = fe.distributed.MemberShard(8, mesh=fe.distributed.init_mesh(2, 2))
    """
    where = "init_mesh"
    members = positive_int(where, "members", members)
    data = positive_int(where, "data", data)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{where}: torch.distributed is not initialized (expected a process group "
            "to lay out, got none). Call fe.distributed.init_process_group() first."
        )
    world = dist.get_world_size()
    if members * data != world:
        raise ValueError(
            f"{where}: {members} member ranks by {data} data replicas make "
            f"{members * data} ranks (expected the world size, {world}, got "
            f"{members * data}). Pass members and data whose product is {world}."
        )
    from torch.distributed.device_mesh import init_device_mesh

    device_type = _device_type(None)
    backend = dist.get_backend()
    timeout = group_timeout(None)
    override: dict[int | str, Any] | None = None
    if timeout is not None and backend in ("gloo", "nccl"):
        options = (
            dist.ProcessGroupGloo._Options()
            if backend == "gloo"
            else dist.ProcessGroupNCCL.Options()
        )
        options._timeout = timeout
        override = {MEMBER: (backend, options), DATA: (backend, options)}
    if override is None or "backend_override" not in inspect.signature(init_device_mesh).parameters:
        # (torch before 2.7 takes no backend options here: its groups' default timeout.)
        return init_device_mesh(device_type, (members, data), mesh_dim_names=(MEMBER, DATA))
    return init_device_mesh(
        device_type, (members, data), mesh_dim_names=(MEMBER, DATA), backend_override=override
    )
