"""Several processes: starting ``torch.distributed`` and each rank's slice of the members.

Members are independent, so training needs no communication: rank r owns a contiguous
slice of the members (``member_slices``) and steps it on its own. Communication is only
for looking at all members at once (``_collectives``) and for checkpoints
(``_sharded_checkpoint``). Without an initialized process group everything here runs
as one rank holding all members, so the same script runs with or without ``torchrun``.
"""

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _tree
from .._core.ensemble import Ensemble
from .._core.seeding import member_seed, seeded_cpu_rng
from .._core.vmap import Randomness
from .._types import StackedTree
from ._agreement import agree, describe_ensemble, describe_optimizer, describe_state
from ._rendezvous import join
from ._slices import _count, member_slices, narrow_members, slice_size

_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def _launched_world_size() -> int:
    """The world size a launcher such as ``torchrun`` announced, 1 if none."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def rank_and_world(where: str, group: Any = None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"{where}: this process is not a member of the given group.")
        return rank, dist.get_world_size(group)
    if group is not None:
        raise RuntimeError(
            f"{where}: a process group was given but torch.distributed is not initialized."
        )
    world = _launched_world_size()
    if world > 1:
        raise RuntimeError(
            f"{where}: this process was launched as one of {world} ranks (WORLD_SIZE="
            f"{world}) but torch.distributed is not initialized, so every rank would act "
            "alone on all members. Call fe.distributed.init_process_group() first."
        )
    return 0, 1


def init_process_group(
    backend: str | None = None, *, timeout: timedelta = timedelta(seconds=60)
) -> torch.device:
    """Start ``torch.distributed`` from ``torchrun``'s environment, with a short timeout.

    Reads the launcher's ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and
    ``WORLD_SIZE`` (as ``env://`` does), picks the backend, binds each rank to its GPU,
    and sets a timeout of a minute rather than torch's default of ten or thirty, so
    that a rank that stops answering makes the others fail with an error instead of
    hanging. (A rank that crashes is noticed sooner: its connections close.)

    The rendezvous keeps to ``timeout`` as a whole: each rank waits for rank 0's store
    server, announces itself and waits for all the others, and a rank that never
    joins makes every other rank raise a
    [`DistributedError`][funcensemble.distributed.DistributedError] naming it once
    ``timeout`` has passed (torch's own rendezvous overruns it, up to twice over, and
    names no rank). Collectives, checkpoints and set-up checks then wait at most
    ``timeout`` each. Call ``torch.distributed.destroy_process_group()`` at the end.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; ``None`` picks NCCL where CUDA is available
            and gloo otherwise.
        timeout: How long any rank waits for the others.

    Returns:
        This rank's device: ``cuda:LOCAL_RANK`` with NCCL (also made the current CUDA
        device), else the CPU.

    Raises:
        DistributedError: A rank did not join within ``timeout`` (the message says
            which), or the process group could not be built.
        RuntimeError: The process group is already initialized, or the launcher's
            environment variables are missing (run the script with ``torchrun``).
        ValueError: A timeout that is not positive, NCCL without CUDA, or a malformed
            ``RANK``, ``WORLD_SIZE`` or ``MASTER_PORT``.
        TypeError: A timeout that is not a ``timedelta``.

    Example:
        In a script started by ``torchrun``: ``device = fe.distributed.init_process_group()``.
        The timeout is checked before anything starts:

        >>> import datetime, funcensemble as fe
        >>> try:
        ...     fe.distributed.init_process_group(timeout=datetime.timedelta(0))
        ... except ValueError as error:
        ...     print(error)
        init_process_group: timeout must be positive, got 0:00:00.
    """
    where = "init_process_group"
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"{where}: timeout must be a datetime.timedelta, got {type(timeout).__name__}."
        )
    if timeout <= timedelta(0):
        raise ValueError(f"{where}: timeout must be positive, got {timeout}.")
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"{where}: backend must be 'gloo', 'nccl' or None, got {backend!r}.")
    if not dist.is_available():
        raise RuntimeError(f"{where}: this build of PyTorch has no torch.distributed.")
    if dist.is_initialized():
        raise RuntimeError(
            f"{where}: torch.distributed is already initialized (backend "
            f"{dist.get_backend()!r}, {dist.get_world_size()} ranks). Initialize it once."
        )
    missing = [name for name in _ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{where}: the environment variable(s) {', '.join(missing)} are not set. Launch "
            "the script with torchrun (e.g. `torchrun --standalone --nproc_per_node=2 "
            "train.py`), or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE yourself."
        )
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
    device = None
    if backend == "nccl":
        if not cuda:
            raise ValueError(f"{where}: the NCCL backend needs CUDA, which is not available.")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    # Binding the group to the device connects NCCL now, so a missing rank is reported
    # at start-up rather than at the first collective.
    join(where, backend, timeout, device)
    return torch.device("cpu") if device is None else device


class MemberShard:
    """This rank's contiguous slice of an ensemble's members.

    With world size W, rank r owns ``member_slices(num_members, W)[r]`` (sizes differ
    by at most one; uneven splits are fine, more ranks than members are refused).
    Pass it to the collectives ([`all_gather`][funcensemble.distributed.all_gather],
    [`mean`][funcensemble.distributed.mean], ...) and to sharded
    [`save`][funcensemble.distributed.save]. Without an initialized process group it
    describes a single rank holding every member.

    Args:
        num_members: N, the size of the whole ensemble.
        group: The process group; the default group if ``None``.

    Attributes:
        num_members: N.
        rank: This process's rank in ``group``.
        world_size: The number of ranks.
        slices: Every rank's slice, in rank order.
        members: This rank's slice.
        group: The process group (``None`` for the default).

    Building it is a collective when there are several ranks: every rank builds its
    ``MemberShard`` with the same N (checked: ranks that disagree all raise, naming each
    rank's N, instead of training overlapping members or aborting in a collective).

    Raises:
        ValueError: More ranks than members, or ranks that disagree on N.
        RuntimeError: Launched by ``torchrun`` with several ranks but
            ``torch.distributed`` is not initialized.
        DistributedError: Another rank did not build its ``MemberShard`` within the
            process group's timeout.

    Example:
        >>> import funcensemble as fe
        >>> shard = fe.distributed.MemberShard(8)  # one process: all 8 members
        >>> shard.rank, shard.world_size, shard.members, shard.size
        (0, 1, slice(0, 8, None), 8)
    """

    def __init__(self, num_members: int, *, group: Any = None) -> None:
        where = "MemberShard"
        self.num_members = _count(where, "num_members", num_members)
        self.group = group
        self.rank, self.world_size = rank_and_world(where, group)
        # Every rank must split the same N: otherwise the ranks' slices overlap or leave
        # members out, and the collectives combine tensors of different sizes.
        agree(
            where,
            {"the member count N": str(num_members)},
            self.rank,
            self.world_size,
            group,
            "Every rank must build MemberShard(N) with the same N: the size of the whole "
            "ensemble, not of its own share.",
        )
        self.slices = tuple(member_slices(num_members, self.world_size))
        self.members = self.slices[self.rank]

    @property
    def size(self) -> int:
        """How many members this rank holds."""
        return slice_size(self.members)

    @property
    def sizes(self) -> tuple[int, ...]:
        """How many members each rank holds, in rank order."""
        return tuple(slice_size(s) for s in self.slices)

    def select(self, tree: StackedTree) -> StackedTree:
        """This rank's members of something that holds all N.

        Args:
            tree: An [`Ensemble`][funcensemble.Ensemble] of N members, or a pytree
                whose tensors have N rows first (e.g. ``fe.stack``'s ``params``, or the
                ``[N, samples]`` indices of
                [`bootstrap_indices`][funcensemble.bootstrap_indices] for bagging).

        Returns:
            A new ``Ensemble`` of this rank's members, or the pytree with each tensor
            cut to this rank's rows (copies; non-tensor leaves as they are).

        Raises:
            ValueError: A tensor without N rows.

        Example:
            >>> import torch, funcensemble as fe
            >>> indices = fe.bootstrap_indices(6, 100, generator=torch.Generator().manual_seed(0))
            >>> fe.distributed.MemberShard(6).select(indices).shape  # [my members, samples]
            torch.Size([6, 100])
        """
        where = "MemberShard.select"
        n = self.num_members

        def cut(name: str, t: Tensor) -> Tensor:
            if t.dim() == 0 or t.shape[0] != n:
                got = t.shape[0] if t.dim() else "no member axis"
                raise ValueError(
                    f"{where}: {name} has leading size {got}; expected the ensemble's "
                    f"{n} members first."
                )
            out = narrow_members(t.detach(), self.members).clone()
            return out.requires_grad_(True) if t.requires_grad else out

        if isinstance(tree, Ensemble):
            params = {k: cut(f"parameter `{k}`", v) for k, v in tree.stacked_params().items()}
            buffers = {k: cut(f"buffer `{k}`", v) for k, v in tree.stacked_buffers().items()}
            return Ensemble._from_stacked(
                tree.stacked, params, buffers, tree.randomness, tree.chunk_size
            )
        leaves, spec = _tree.flatten(tree)
        out = [cut(f"leaf {i}", x) if isinstance(x, Tensor) else x for i, x in enumerate(leaves)]
        return _tree.unflatten(spec, out)

    def from_factory(
        self,
        factory: Callable[[], nn.Module],
        *,
        seed: int = 0,
        randomness: Randomness = "different",
        chunk_size: int | None = None,
    ) -> Ensemble:
        """Build only this rank's members, exactly as ``Ensemble.from_factory`` builds them.

        Member i is built with the CPU generator seeded from ``(seed, i)``, i its index
        in the whole ensemble, so this rank's ensemble equals rows ``members`` of
        ``fe.Ensemble.from_factory(factory, num_members=N, seed=seed)`` at every world
        size, without building the other ranks' members.

        Example:
            >>> import torch, funcensemble as fe
            >>> make = lambda: torch.nn.Linear(4, 2)
            >>> shard = fe.distributed.MemberShard(6)
            >>> mine = shard.from_factory(make, seed=1)
            >>> full = fe.Ensemble.from_factory(make, num_members=6, seed=1)
            >>> torch.equal(mine.stacked.weight, full.stacked.weight[shard.members])
            True
        """
        if not callable(factory):
            raise TypeError(
                f"MemberShard.from_factory: factory must be callable, got {type(factory).__name__}."
            )
        indices = iter(range(self.members.start, self.members.stop))

        def seeded() -> nn.Module:
            # from_factory calls the factory once per member, in order, each under its
            # own local seed; reseed with the member's global index instead.
            with seeded_cpu_rng(member_seed(seed, next(indices))):
                return factory()

        ens = Ensemble.from_factory(
            seeded, self.size, seed=seed, randomness=randomness, chunk_size=chunk_size
        )
        description = describe_ensemble(ens)
        description["the seed"] = repr(seed)
        agree(
            "MemberShard.from_factory",
            description,
            self.rank,
            self.world_size,
            self.group,
            "Every rank must build its members with the same factory, seed and options "
            "(the same classes, settings, dtypes and parameter names).",
        )
        return ens

    def check_agreement(self, state: Any = None, *, optimizer: Any = None, **settings: Any) -> None:
        """Check that every rank set up the same thing; raise on every rank if not.

        A collective: every rank calls it with its own values. Ranks that disagree
        would otherwise run: members on one rank would train with another learning
        rate, or collectives would combine tensors of different meanings. Each rank
        describes its arguments, the descriptions are exchanged once, and where they
        differ every rank raises the same ``ValueError``, naming the ranks and what
        differs. [`from_factory`][funcensemble.distributed.MemberShard.from_factory]
        and the constructor already check the architecture and N.

        Args:
            state: This rank's [`Ensemble`][funcensemble.Ensemble] (compared by class,
                architecture fingerprint, each tensor's per-member shape and dtype,
                train/eval modes), or a pytree such as ``{"params": ..., "opt": ...}``
                (compared by structure, per-member shapes and dtypes of tensors with
                dimensions, and the values of other leaves such as step counts).
            optimizer: An ``fe.optim`` transformation (compared by the settings its
                functions hold: ``lr``, ``betas``, ...; per-member hyperparameter
                tensors by dtype, since each rank holds its own members' values) or a
                ``torch.optim.Optimizer`` (by its param groups' hyperparameters).
            **settings: Anything else that must be equal on every rank, compared by
                ``repr`` (e.g. ``batch_size=64, data="v2"``).

        Raises:
            ValueError: The ranks differ (the message names them and each difference).
            TypeError: ``state`` is an ordinary module, or ``optimizer`` is not an
                optimizer.
            DistributedError: Another rank did not call it within the timeout.

        Example:
            >>> import torch, funcensemble as fe
            >>> shard = fe.distributed.MemberShard(4)  # every rank, under torchrun
            >>> ens = shard.from_factory(lambda: torch.nn.Linear(3, 1))
            >>> shard.check_agreement(ens, optimizer=fe.optim.adam(1e-3), batch_size=32)
        """
        where = "MemberShard.check_agreement"
        description = {} if state is None else describe_state(where, state)
        if optimizer is not None:
            description.update(describe_optimizer(where, optimizer))
        for name, value in settings.items():
            description[f"`{name}`"] = repr(value)
        agree(
            where,
            description,
            self.rank,
            self.world_size,
            self.group,
            "Set up every rank alike: the same architecture, dtypes, optimizer and settings.",
        )

    def __repr__(self) -> str:
        return (
            f"MemberShard(num_members={self.num_members}, rank={self.rank}, "
            f"world_size={self.world_size}, members={self.members.start}:{self.members.stop})"
        )
