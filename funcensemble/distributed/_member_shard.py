"""Several processes: starting ``torch.distributed`` and each rank's slice of the members.

Members are independent, so training needs no communication: rank r of the mesh's
``"member"`` axis (``_mesh``) owns a contiguous slice of the members
(``member_slices``) and steps it on its own. Communication is for data-parallel
replicas along a ``"data"`` axis (``_data_parallel``), for looking at all members at
once (``_collectives``) and for checkpoints (``_sharded_checkpoint``). Without an
initialized process group everything here runs as one rank holding all members, so the
same script runs with or without ``torchrun``.
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
from .._core.seeding import build_seeded, check_seed, member_seed
from .._core.vmap import Randomness
from .._types import StackedTree
from ..optim._protocol import leaf_name
from ._agreement import agree, describe_ensemble, describe_optimizer, describe_state
from ._mesh import default_mesh, mesh_axes
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
    backend: str | None = None,
    *,
    timeout: timedelta = timedelta(seconds=60),
    join_timeout: timedelta | None = None,
) -> torch.device:
    """Start ``torch.distributed`` from ``torchrun``'s environment, with a short timeout.

    Reads the launcher's ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and
    ``WORLD_SIZE`` (as ``env://`` does), picks the backend, binds each rank to its GPU,
    and sets a timeout of a minute rather than torch's default of ten or thirty, so
    that a rank that stops answering makes the others fail with an error instead of
    hanging. (A rank that crashes is noticed sooner: its connections close.)

    The rendezvous keeps to ``join_timeout`` as a whole, counted from this call: each
    rank waits for the store server (rank 0's, or ``torchrun``'s agent's), announces
    itself and waits for all the others, and a rank that never joins makes every
    other rank raise a
    [`DistributedError`][funcensemble.distributed.DistributedError] naming it once
    ``join_timeout`` has passed (torch's own rendezvous overruns it, up to twice over,
    and names no rank). Collectives, checkpoints and set-up checks then wait at most
    ``timeout`` each. Call ``torch.distributed.destroy_process_group()`` at the end.

    Restarts by ``torchrun --max-restarts`` work as they are: the restarted ranks
    agree on a key namespace of their own in the store ``torchrun`` keeps across
    restarts, so they never read an earlier attempt's addresses (torch's own
    ``init_process_group`` does, unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).

    Args:
        backend: ``"gloo"`` or ``"nccl"``; ``None`` picks NCCL where CUDA is available
            and gloo otherwise.
        timeout: How long any rank waits for the others in a collective.
        join_timeout: How long each rank waits at start-up for every rank to join;
            ``timeout`` if ``None``. Give a longer one where ranks start minutes apart.

    Returns:
        This rank's device: ``cuda:LOCAL_RANK`` with NCCL (also made the current CUDA
        device), else the CPU.

    Raises:
        DistributedError: A rank did not join within ``join_timeout`` (the message
            says which), or the process group could not be built.
        RuntimeError: The process group is already initialized, or the launcher's
            environment variables are missing (run the script with ``torchrun``).
        ValueError: A timeout or join timeout that is not positive, NCCL without CUDA,
            or a malformed ``RANK``, ``WORLD_SIZE`` or ``MASTER_PORT``.
        TypeError: A timeout or join timeout that is not a ``timedelta``.

    Example:
        In a script started by ``torchrun``: ``device = fe.distributed.init_process_group()``.
        The timeout is checked before anything starts:

        >>> import datetime, funcensemble as fe
        >>> try:
        ...     fe.distributed.init_process_group(timeout=datetime.timedelta(0))
        ... except ValueError as error:
        ...     print(error)
        init_process_group: timeout must be positive (expected more than 0 seconds, got
        0:00:00). Pass a positive timedelta.
    """
    where = "init_process_group"
    for name, value in (("timeout", timeout), ("join_timeout", join_timeout)):
        if value is None and name == "join_timeout":
            continue
        if not isinstance(value, timedelta):
            raise TypeError(
                f"{where}: {name} must be a datetime.timedelta (expected e.g. "
                f"timedelta(minutes=5), got {type(value).__name__}). Pass {name} as a "
                "datetime.timedelta."
            )
        if value <= timedelta(0):
            raise ValueError(
                f"{where}: {name} must be positive (expected more than 0 seconds, got "
                f"{value}). Pass a positive timedelta."
            )
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(
            f"{where}: backend must be 'gloo', 'nccl' or None (expected one of those, got "
            f"{backend!r}). Pass 'gloo' for CPUs, 'nccl' for GPUs, or None to choose."
        )
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
    join(where, backend, timeout, device, timeout if join_timeout is None else join_timeout)
    return torch.device("cpu") if device is None else device


class MemberShard:
    """This rank's contiguous slice of an ensemble's members, on a device mesh.

    The members are split over the ``"member"`` axis of a ``DeviceMesh``: with M
    ranks on it, member rank r owns ``member_slices(num_members, M)[r]`` (sizes differ
    by at most one; uneven splits are fine, more ranks than members are refused).
    Without ``mesh``, the mesh is one-dimensional over ``group``: every rank holds
    other members. A mesh from [`init_mesh(M, D)`][funcensemble.distributed.init_mesh]
    (or torch's ``init_device_mesh(device_type, (M, D), mesh_dim_names=("member",
    "data"))``, whose groups get torch's default timeout) adds D data-parallel replicas
    of each member slice: each replica is fed its part of every batch
    ([`batch_slice`][funcensemble.distributed.MemberShard.batch_slice]) and the
    gradients are averaged over the ``"data"`` axis
    ([`average_gradients`][funcensemble.distributed.average_gradients]), as
    ``DistributedDataParallel`` does. Pass the shard to the collectives
    ([`all_gather`][funcensemble.distributed.all_gather],
    [`mean`][funcensemble.distributed.mean], ...) and to sharded
    [`save`][funcensemble.distributed.save]. Without an initialized process group it
    describes a single rank holding every member.

    Args:
        num_members: N, the size of the whole ensemble.
        group: The process group the members are split over; the default group if
            ``None``. Not with ``mesh``.
        mesh: A ``DeviceMesh`` over all ranks with dimensions named ``("member",)``
            or ``("member", "data")``.

    Attributes:
        num_members: N.
        rank: This process's rank on the member axis.
        world_size: The number of ranks on the member axis (M).
        slices: Every member rank's slice, in rank order.
        members: This rank's slice.
        group: The process group of the member axis (``None`` for the default).
        mesh: The ``DeviceMesh`` (``None`` without ``torch.distributed``).
        data_rank: This process's rank on the data axis (0 without one).
        data_size: The number of data-parallel replicas of each member (D; 1
            without a data axis).
        data_group: The process group of the data axis (``None`` without one).

    Building it is a collective when there are several ranks: every rank builds its
    ``MemberShard`` with the same N (checked: ranks that disagree all raise, naming each
    rank's N, instead of training overlapping members or aborting in a collective).

    Raises:
        ValueError: More member ranks than members, ranks that disagree on N, or a
            mesh whose dimensions are not named ``"member"`` (and ``"data"``) or that
            does not span every rank.
        TypeError: ``mesh`` is not a ``DeviceMesh``, or both ``mesh`` and ``group``.
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

    def __init__(self, num_members: int, *, group: Any = None, mesh: Any = None) -> None:
        where = "MemberShard"
        self.num_members = _count(where, "num_members", num_members)
        self.data_rank, self.data_size, self.data_group = 0, 1, None
        self.mesh = None
        if mesh is not None:
            if group is not None:
                raise TypeError(
                    f"{where}: pass either mesh or group, not both: the mesh's "
                    '"member" axis is the group the members are split over.'
                )
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"{where}: a mesh was given but torch.distributed is not initialized."
                )
            axes = mesh_axes(where, mesh)
            self.mesh, self.group = mesh, axes.member_group
            self.rank, self.world_size = axes.member_rank, axes.member_size
            self.data_rank, self.data_size = axes.data_rank, axes.data_size
            self.data_group = axes.data_group
        else:
            self.group = group
            self.rank, self.world_size = rank_and_world(where, group)
            if dist.is_available() and dist.is_initialized():
                self.mesh = default_mesh(group)
        # Every rank must split the same N: otherwise the ranks' slices overlap or leave
        # members out, and the collectives combine tensors of different sizes.
        self._agree(
            where,
            {"the member count N": str(num_members), "the mesh": self._mesh_text()},
            "Every rank must build MemberShard(N) with the same N: the size of the whole "
            "ensemble, not of its own share.",
        )
        self.slices = tuple(member_slices(num_members, self.world_size))
        self.members = self.slices[self.rank]

    def _mesh_text(self) -> str:
        if self.mesh is None:
            return "none"
        return f"{tuple(self.mesh.mesh_dim_names)} of shape {tuple(self.mesh.shape)}"

    def _all_ranks(self) -> tuple[int, int, Any]:
        """This process's rank among every rank holding these members, their number and
        group: the member axis, or the whole mesh when it has data replicas."""
        if self.data_size == 1:
            return self.rank, self.world_size, self.group
        return dist.get_rank(), dist.get_world_size(), None

    def _agree(self, where: str, description: dict[str, str], advice: str) -> None:
        """Every rank of the mesh, data replicas included, must describe the same thing."""
        rank, world, group = self._all_ranks()
        agree(where, description, rank, world, group, advice)

    def _check_randomness(self, where: str, randomness: object) -> None:
        """Refuse ``randomness="same"`` with the members split over several ranks.

        ``"same"`` promises one draw shared by all N members; each member rank draws
        for its own members from its own generators, which no vmap option can share
        across processes (``ShardedEnsemble`` refuses it across devices alike). Data
        replicas hold every member of their slice, so a mesh of one member rank is fine.
        """
        if randomness == "same" and self.world_size > 1:
            raise ValueError(
                f"{where}: randomness='same' shares one draw among all members, which "
                f"members split over {self.world_size} member ranks cannot: each rank "
                "draws for its own members from its own generator (expected 'different' "
                "or 'error' with the members split, got 'same'). Pass "
                "randomness='different', or hold every member on each rank (a mesh of one "
                "member rank, with only data replicas)."
            )

    def batch_slice(self, batch_size: int) -> slice:
        """This data replica's samples of a batch of ``batch_size``: its equal part.

        With D replicas on the ``"data"`` axis, replica d takes samples
        ``d * B / D`` to ``(d + 1) * B / D``. Each replica's loss is the mean over
        its part; [`average_gradients`][funcensemble.distributed.average_gradients]
        then gives each member the gradient of the mean over the whole batch, as one
        process computes it. Equal parts are required: with unequal ones the
        average of the replicas' means is not the whole batch's mean. A loss
        weighted by ``fe.weighted_mean`` (bagging) divides by each replica's own
        weight sum: pass those weights to ``average_gradients(..., weights=...)``.

        Args:
            batch_size: B, the number of samples of the whole batch (of each member).

        Returns:
            A ``slice`` of the sample axis (all of it without a data axis).

        Raises:
            ValueError: B is not a multiple of D.

        Example:
            >>> import funcensemble as fe
            >>> fe.distributed.MemberShard(4).batch_slice(32)  # one process: every sample
            slice(0, 32, None)
        """
        where = "MemberShard.batch_slice"
        b = _count(where, "batch_size", batch_size)
        if b % self.data_size:
            raise ValueError(
                f"{where}: a batch of {b} samples cannot be split into {self.data_size} "
                f"equal parts, one per data replica (expected a multiple of "
                f"{self.data_size}). Use a batch size divisible by the data axis's size: "
                "with unequal parts the replicas' averaged gradient is not the whole "
                "batch's."
            )
        part = b // self.data_size
        return slice(self.data_rank * part, (self.data_rank + 1) * part)

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
                whose tensors have N rows first (e.g. ``fe.stack``'s ``params``, an
                ``fe.optim`` state, or the ``[N, samples]`` indices of
                [`bootstrap_indices`][funcensemble.bootstrap_indices] for bagging);
                its 0-dim tensors (step counts shared by all members) are kept whole,
                as [`fe.select`][funcensemble.select] keeps them.

        Returns:
            A new ``Ensemble`` of this rank's members, or the pytree with each tensor
            cut to this rank's rows (copies; non-tensor leaves as they are).

        Raises:
            ValueError: A tensor with dimensions but without N rows, or an
                ``Ensemble`` with ``randomness="same"`` while the members are split
                over several ranks (one draw cannot be shared across them).

        Example:
            >>> import torch, funcensemble as fe
            >>> indices = fe.bootstrap_indices(6, 100, generator=torch.Generator().manual_seed(0))
            >>> fe.distributed.MemberShard(6).select(indices).shape  # [my members, samples]
            torch.Size([6, 100])
        """
        where = "MemberShard.select"
        n = self.num_members

        def cut(name: str, t: Tensor) -> Tensor:
            if t.dim() == 0 and not isinstance(tree, Ensemble):
                # One value shared by all members (an optimizer's step count), as
                # fe.select keeps it.
                return t.detach().clone().requires_grad_(t.requires_grad)
            if t.dim() == 0 or t.shape[0] != n:
                got = t.shape[0] if t.dim() else "no member axis"
                raise ValueError(
                    f"{where}: {name} has leading size {got} (expected the ensemble's {n} "
                    f"members first, got {got}). Pass the whole ensemble's tensors, member "
                    "axis first."
                )
            out = narrow_members(t.detach(), self.members).clone()
            return out.requires_grad_(True) if t.requires_grad else out

        if isinstance(tree, Ensemble):
            self._check_randomness(where, tree.randomness)
            params = {k: cut(f"parameter `{k}`", v) for k, v in tree.stacked_params().items()}
            buffers = {k: cut(f"buffer `{k}`", v) for k, v in tree.stacked_buffers().items()}
            return Ensemble._from_stacked(
                tree.stacked, params, buffers, tree.randomness, tree.chunk_size
            )
        leaves, spec = _tree.flatten(tree)
        out = [
            cut(f"`{leaf_name(spec, i, 'tree')}`", x) if isinstance(x, Tensor) else x
            for i, x in enumerate(leaves)
        ]
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

        ``randomness="same"`` (one draw shared by all members) is refused when the
        members are split over several member ranks: each rank draws for its own
        members from its own generator, so no draw is shared across ranks. With one
        member rank (every member on each rank, data replicas only) it is kept.

        Raises:
            ValueError: The ranks differ in factory, seed or options (raised on
                every rank, naming what differs), or ``randomness="same"`` with the
                members split over several ranks (raised on every rank).

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
                f"MemberShard.from_factory: factory must be callable (expected a function "
                f"building one member, got {type(factory).__name__}). Pass e.g. "
                "lambda: nn.Linear(3, 1)."
            )
        if seed is None:
            raise TypeError(
                "MemberShard.from_factory: seed must be an int >= 0 (expected an int, got "
                "None): every rank builds its own members, and member i must be the same "
                "whichever rank builds it, which a draw from each rank's own entropy is "
                "not. Pass the same whole number on every rank, e.g. seed=0."
            )
        seed = check_seed("MemberShard.from_factory", seed)
        indices = iter(range(self.members.start, self.members.stop))

        def seeded() -> nn.Module:
            # from_factory calls the factory once per member, in order: each is seeded
            # from its global index here (seed=None there, which seeds nothing itself).
            return build_seeded(factory, member_seed(seed, next(indices)))

        ens = Ensemble.from_factory(
            seeded, self.size, seed=None, randomness=randomness, chunk_size=chunk_size
        )
        description = describe_ensemble(ens)
        description["the seed"] = repr(seed)
        self._agree(
            "MemberShard.from_factory",
            description,
            "Every rank must build its members with the same factory, seed and options "
            "(the same classes, settings, dtypes and parameter names).",
        )
        # After the ranks agreed (randomness is part of the description): every rank
        # refuses alike, none waits in the exchange for a rank that refused alone.
        self._check_randomness("MemberShard.from_factory", randomness)
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
                tensors by dtype, since each rank holds its own members' values), an
                [`EnsembleOptimizer`][funcensemble.optim.EnsembleOptimizer] (by its
                ``transform``, the same way) or a ``torch.optim.Optimizer`` (by its
                param groups' hyperparameters).
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
        self._agree(
            where,
            description,
            "Set up every rank alike: the same architecture, dtypes, optimizer and settings.",
        )
        # After the exchange (which compares randomness too): every rank raises alike.
        if isinstance(state, Ensemble):
            self._check_randomness(where, state.randomness)

    def __repr__(self) -> str:
        return (
            f"MemberShard(num_members={self.num_members}, rank={self.rank}, "
            f"world_size={self.world_size}, members={self.members.start}:{self.members.stop}"
            + (
                f", data_rank={self.data_rank}, data_size={self.data_size})"
                if self.data_size > 1
                else ")"
            )
        )
