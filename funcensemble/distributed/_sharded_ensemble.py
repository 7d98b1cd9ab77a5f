"""``ShardedEnsemble``: one process, the members spread over several devices.

Each device holds a contiguous slice of the members (see ``member_slices``) and runs
it as one vectorized call. The shards are launched one after another from one Python
thread, with nothing in the loop that waits for a device: on CUDA, kernel launches
return at once, so every device works on its slice while Python goes on to launch the
next. Inputs are copied to every device before any compute is launched, and outputs
are gathered with non-blocking copies (``_device_copies``). On the CPU (for testing)
every op completes before it returns, so the shards simply run one after another.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._core.ensemble import Ensemble
from .._core.functional_module import FunctionalModule
from .._core.grad import value_and_grad
from .._core.in_dims import InDims, arg_dims, check_member_sizes
from .._core.rollback import rollback_on_error
from .._core.seeding import rng_state, set_rng_state
from .._core.skeleton import meta_skeleton
from .._core.stack import _num_members, stack
from .._core.vmap import Randomness, vmap
from .._hetero.ensemble import HeteroEnsemble
from .._tree import flatten as tree_flatten
from .._tree import unflatten
from .._types import StackedTree
from ..optim._protocol import GradientTransformation, apply_updates
from ._device_copies import join_on
from ._per_shard import PerShard
from ._placement import device_of, devices_of, place_arg
from ._slices import member_slices, narrow_members, slice_size


def _renamed(where: str, error: Exception) -> Exception:
    return type(error)(str(error).replace("vmap:", f"{where}:", 1))


class ShardedEnsemble:
    """An ensemble whose members are split over several devices of one process.

    Device k holds a contiguous slice of the members (sizes from
    [`member_slices`][funcensemble.distributed.member_slices]: they differ by at most
    one) as ``params[k]`` and ``buffers[k]``, fresh tensors that share nothing with the
    input. Every call runs each device's slice as one vectorized call; the slices are
    launched back to back with nothing that waits for a device in between, so on CUDA
    the devices compute at the same time. Outputs come back gathered on one device, or
    left sharded as a [`PerShard`][funcensemble.distributed.PerShard] value. Each
    member computes what it computes in the single-device
    [`Ensemble`][funcensemble.Ensemble] to rounding, and bit for bit for the test
    suite's MLPs and convolutions on the CPU. Where a kernel rounds according to how
    many members share it, or where a member starts in memory, the split changes a
    member's numbers by a few ulps: "Does the split change the numbers?" in the
    scale-out guide lists the five known cases (BatchNorm on 2-D inputs, a float32
    convolution alone on its device, a member that is one narrow Linear, a member whose
    activations start unaligned, torch's fused in-place Adam) with measured figures. A
    gradient which is pure rounding noise (a Linear's bias right before a BatchNorm,
    whose true gradient is zero) may differ by that noise, which Adam then scales up.
    Several shards may share a device (e.g. ``["cpu", "cpu"]``).

    Args:
        members: An [`Ensemble`][funcensemble.Ensemble] (its options are kept unless
            given here) or a non-empty sequence of modules of one architecture.
        devices: One device per shard, e.g. ``["cuda:0", "cuda:1"]``.
        randomness: As in [`vmap`][funcensemble.vmap]. Random draws (dropout) come
            from each device's generator, so they differ from a single-device run.
            With ``"same"`` every shard replays the first one's draw, so all members
            share one, as on one device; it needs every shard on one device.
        chunk_size: As in [`vmap`][funcensemble.vmap], within each shard.

    Raises:
        ValueError: More devices than members, no devices, an unknown or unavailable
            device.
        TypeError: ``devices`` not a list of devices.

    Example:
        >>> import torch, funcensemble as fe
        >>> ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(5)])
        >>> sharded = fe.distributed.ShardedEnsemble(ens, ["cpu", "cpu"])  # e.g. 2 GPUs
        >>> sharded.sizes
        (3, 2)
        >>> x = torch.randn(8, 3)
        >>> torch.allclose(sharded(x), ens(x))
        True
    """

    def __init__(
        self,
        members: Ensemble | Sequence[nn.Module] | nn.ModuleList,
        devices: Sequence[str | torch.device],
        *,
        randomness: Randomness | None = None,
        chunk_size: int | None = None,
    ) -> None:
        where = "ShardedEnsemble"
        if isinstance(members, HeteroEnsemble):
            raise TypeError(
                f"{where}: got a HeteroEnsemble, whose members have several architectures "
                "(expected an fe.Ensemble or modules of one architecture). Shard each of "
                "its groups as its own ShardedEnsemble (hens.groups[g]), or keep it on "
                "one device."
            )
        found = devices_of(where, devices)
        if isinstance(members, Ensemble):
            skeleton = meta_skeleton(members.stacked)
            params, buffers = members.stacked_params(), members.stacked_buffers()
            randomness = members.randomness if randomness is None else randomness
            chunk_size = members.chunk_size if chunk_size is None else chunk_size
        else:
            fmodel, params, buffers = stack(members)
            skeleton = fmodel.skeleton
        randomness = "different" if randomness is None else randomness
        vmap(lambda p, b: None, randomness=randomness, chunk_size=chunk_size)  # validates
        generators = dict.fromkeys("cpu" if d.type == "cpu" else str(d) for d in found)
        if randomness == "same" and len(generators) > 1:
            raise ValueError(
                f"{where}: randomness='same' shares one draw among all members, which "
                f"shards on different devices ({', '.join(generators)}) cannot: each "
                "draws from its own device's generator (expected one device for every "
                "shard). Put every shard on one device, or pass randomness='different'."
            )
        n = _num_members(where, params, buffers)
        self.fmodel = FunctionalModule(skeleton)
        if isinstance(members, Ensemble):  # the shapes its members were built with
            self.fmodel._member_shapes = dict(members.fmodel._member_shapes)
        self.randomness: Randomness = randomness
        self.chunk_size = chunk_size
        self.devices = found
        self.slices = tuple(member_slices(n, len(found)))
        self._num_members = n

        def place(t: Tensor, members: slice, device: torch.device) -> Tensor:
            out = narrow_members(t.detach(), members).to(device, copy=True)
            return out.requires_grad_(True) if t.requires_grad else out

        self._params = PerShard(
            {k: place(v, s, d) for k, v in params.items()}
            for s, d in zip(self.slices, found, strict=True)
        )
        self._buffers = PerShard(
            {k: place(v, s, d) for k, v in buffers.items()}
            for s, d in zip(self.slices, found, strict=True)
        )

    # --- state ---------------------------------------------------------------------

    @property
    def num_members(self) -> int:
        """N, the members over all shards."""
        return self._num_members

    @property
    def sizes(self) -> tuple[int, ...]:
        """How many members each shard holds, in device order."""
        return tuple(slice_size(s) for s in self.slices)

    def __len__(self) -> int:
        return self._num_members

    def _check_state(self, what: str, value: object, ref: PerShard) -> PerShard:
        where = f"ShardedEnsemble.{what}"
        if not isinstance(value, Sequence) or len(value) != len(ref):
            raise ValueError(
                f"{where}: the {what} do not come one dict per shard (expected {len(ref)} "
                f"dicts, one per shard, got {type(value).__name__}"
                + (f" of {len(value)}" if isinstance(value, Sequence) else "")
                + f"). Pass what ShardedEnsemble.{what} holds, one dict per device."
            )
        for k, (new, old) in enumerate(zip(value, ref, strict=True)):
            if not isinstance(new, Mapping) or new.keys() != old.keys():
                got = sorted(new) if isinstance(new, Mapping) else type(new).__name__
                raise ValueError(
                    f"{where}: shard {k} must map the names {sorted(old)} to tensors "
                    f"(expected those names, got {got}). Keep each shard's names as "
                    f"ShardedEnsemble.{what} gives them."
                )
            for name, t in new.items():
                was = old[name]
                # (Another dtype is a conversion, as module.double() makes one.)
                if not isinstance(t, Tensor) or (t.shape, t.device) != (was.shape, was.device):
                    got = f"shape {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else None
                    raise ValueError(
                        f"{where}: shard {k}'s `{name}` does not fit the shard (expected "
                        f"shape {tuple(was.shape)} on {was.device}: its {self.sizes[k]} "
                        f"members first, got {got or type(t).__name__}). Give each shard "
                        "its own members' tensors, in device order, as "
                        f"ShardedEnsemble.{what} holds them."
                    )
        return PerShard(dict(v) for v in value)

    @property
    def params(self) -> PerShard:
        """Each shard's stacked parameters ``[n_k, ...]``, on its device."""
        return self._params

    @params.setter
    def params(self, value: Sequence[Mapping[str, Tensor]]) -> None:
        self._params = self._check_state("params", value, self._params)

    @property
    def buffers(self) -> PerShard:
        """Each shard's stacked buffers ``[n_k, ...]``, on its device."""
        return self._buffers

    @buffers.setter
    def buffers(self, value: Sequence[Mapping[str, Tensor]]) -> None:
        self._buffers = self._check_state("buffers", value, self._buffers)

    @property
    def training(self) -> bool:
        """Whether the members run in train mode."""
        return self.fmodel.skeleton.training

    def train(self, mode: bool = True) -> "ShardedEnsemble":
        """Put every member in train (or eval) mode, like ``nn.Module.train``."""
        self.fmodel.skeleton.train(mode)
        return self

    def eval(self) -> "ShardedEnsemble":
        """Put every member in eval mode."""
        return self.train(False)

    # --- running -------------------------------------------------------------------

    def map(
        self, fn: Callable[..., Any], *args: Any, in_dims: InDims = None, **kwargs: Any
    ) -> PerShard:
        """Call a vectorized function once per shard, each on its own device.

        Shard k calls ``fn(params[k], buffers[k], *args_k, **kwargs_k)``, where a
        [`PerShard`][funcensemble.distributed.PerShard] argument gives its k-th item,
        an argument mapped by ``in_dims`` gives the rows of shard k's members, and any
        other tensor is shared: copied to shard k's device. All copies are made before
        the first call; no call waits for a device. ``fn`` itself must be vectorized
        over the members (e.g. ``fe.vmap(fmodel, in_dims)`` or ``fe.value_and_grad``
        with the same ``in_dims``).

        Args:
            fn: The function to run on each shard.
            *args: Its positional arguments after params and buffers.
            in_dims: Which arguments are split over members, as in
                [`vmap`][funcensemble.vmap]; ``None`` entries for ``PerShard`` ones.
            **kwargs: Keyword arguments, shared (or ``PerShard``).

        Returns:
            The results, one per shard, left on their devices.

        Raises:
            ValueError: A per-member argument with the wrong member count, a
                ``PerShard`` of the wrong length or mapped by ``in_dims``.

        Example:
            >>> import torch, funcensemble as fe
            >>> sharded = fe.distributed.ShardedEnsemble(
            ...     [torch.nn.Linear(3, 2) for _ in range(5)], ["cpu", "cpu"])
            >>> forward = fe.vmap(sharded.fmodel, in_dims=0)
            >>> outs = sharded.map(forward, torch.randn(5, 8, 3), in_dims=0)
            >>> [tuple(o.shape) for o in outs]
            [(3, 8, 2), (2, 8, 2)]
        """
        return self._map(fn, args, in_dims, kwargs, same_draw=False)

    def _map(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        in_dims: InDims,
        kwargs: dict[str, Any],
        *,
        same_draw: bool,
        where: str = "ShardedEnsemble.map",
        internal: int = 0,
    ) -> PerShard:
        """[`map`][funcensemble.distributed.ShardedEnsemble.map]; ``same_draw``: every
        shard replays the random state the first one started from (``randomness="same"``:
        one draw for all members, as the chunks of one call replay it). The first
        ``internal`` arguments are the caller's own (``step_``'s optimizers and states):
        messages count the user's arguments after them, in ``where``'s name."""
        if not callable(fn):
            raise TypeError(
                f"{where}: fn is not callable (expected a callable, got "
                f"{type(fn).__name__}). Pass the function to map over members."
            )
        shards = len(self.devices)
        try:
            dims = arg_dims(in_dims, len(args))
        except (TypeError, ValueError) as error:
            raise _renamed(where, error) from None
        named = [
            (f"argument {i - internal}", a, d)
            for i, (a, d) in enumerate(zip(args, dims, strict=True))
            if i >= internal
        ]
        named += [(f"keyword argument `{k}`", v, None) for k, v in kwargs.items()]
        for label, value, dim in named:
            if isinstance(value, PerShard):
                if len(value) != shards:
                    raise ValueError(
                        f"{where}: {label} is a PerShard of {len(value)} values; this "
                        f"ensemble has {shards} shards."
                    )
                if dim is not None:
                    raise ValueError(
                        f"{where}: {label} is a PerShard value, already split by shard; "
                        f"its in_dims entry must be None (expected None, got {dim!r}). Set "
                        "its in_dims entry to None."
                    )
        plain = tuple(None if isinstance(a, PerShard) else a for a in args[internal:])
        try:
            checked = check_member_sizes(plain, dims[internal:], self._num_members)
        except (TypeError, ValueError) as error:
            raise _renamed(where, error) from None
        dims = (*dims[:internal], *checked)

        def for_shard(value: Any, dim: Any, k: int) -> Any:
            if isinstance(value, PerShard):
                return value[k]
            return place_arg(value, dim, self.slices[k], self.devices[k])

        calls = [
            (
                tuple(for_shard(a, d, k) for a, d in zip(args, dims, strict=True)),
                {name: for_shard(v, None, k) for name, v in kwargs.items()},
            )
            for k in range(shards)
        ]
        replay = rng_state(self.devices[0]) if same_draw and shards > 1 else None

        def run(k: int, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
            if replay is not None and k:
                set_rng_state(self.devices[0], replay)
            return fn(self._params[k], self._buffers[k], *a, **kw)

        # One transaction over the shards: a later shard's failure puts back what the
        # earlier ones updated in place (BatchNorm statistics), as one Ensemble's does.
        with rollback_on_error({}):
            return PerShard([run(k, a, kw) for k, (a, kw) in enumerate(calls)])

    def __call__(
        self,
        *args: Any,
        in_dims: InDims = None,
        gather: bool | str | torch.device = True,
        **kwargs: Any,
    ) -> StackedTree | PerShard:
        """Run every member; outputs get a leading member axis.

        Args:
            *args: Positional inputs, shared by all members unless ``in_dims`` says
                otherwise.
            in_dims: As in [`vmap`][funcensemble.vmap].
            gather: ``True``: concatenate the outputs on the first device; a device:
                concatenate them there; ``False``: leave them sharded (a ``PerShard``).
            **kwargs: Keyword inputs, shared by all members.
        """
        mapped = vmap(self.fmodel, in_dims, randomness=self.randomness, chunk_size=self.chunk_size)
        same = self.randomness == "same"
        outputs = self._map(mapped, args, in_dims, kwargs, same_draw=same)
        if gather is False:
            return outputs
        return self.gather(outputs, device=None if gather is True else gather)

    def gather(
        self, outputs: Sequence[StackedTree], *, device: str | torch.device | None = None
    ) -> StackedTree:
        """Concatenate per-shard outputs along the member axis, on one device.

        Args:
            outputs: One pytree of tensors per shard, members first (e.g. what
                [`map`][funcensemble.distributed.ShardedEnsemble.map] returns).
            device: Where the result lives; the first shard's device by default.

        Every copy is issued without blocking (``non_blocking=True``) before any is
        waited for. To a GPU, the copies are ordered on the devices' streams and the host
        never waits. To the CPU, the GPUs' copies into pinned memory overlap, and this
        waits once for each source device before it returns, so the result is never
        read before it has arrived.

        Returns:
            One pytree of ``[N, ...]`` tensors, in member order.

        Raises:
            ValueError: Not one output per shard, outputs of different structures, or
                a leaf whose leading size is not its shard's member count.
            TypeError: A leaf that is not a tensor.

        Example:
            >>> import torch, funcensemble as fe
            >>> sharded = fe.distributed.ShardedEnsemble(
            ...     [torch.nn.Linear(3, 2) for _ in range(5)], ["cpu", "cpu"])
            >>> parts = sharded(torch.randn(8, 3), gather=False)
            >>> sharded.gather(parts).shape
            torch.Size([5, 8, 2])
        """
        where = "ShardedEnsemble.gather"
        target = self.devices[0] if device is None else device_of(where, device)
        if not isinstance(outputs, Sequence) or len(outputs) != len(self.devices):
            raise ValueError(
                f"{where}: outputs do not come one per shard (expected "
                f"{len(self.devices)} outputs, one per shard, got {type(outputs).__name__}"
                + (f" of {len(outputs)}" if isinstance(outputs, Sequence) else "")
                + "). Pass what ShardedEnsemble.map returned."
            )
        flat = [tree_flatten(o) for o in outputs]
        spec = flat[0][1]
        for k, (leaves, other) in enumerate(flat):
            if other != spec:
                raise ValueError(
                    f"{where}: shard {k}'s output has structure {other}; shard 0's has {spec}."
                )
            for j, leaf in enumerate(leaves):
                if not isinstance(leaf, Tensor):
                    raise TypeError(
                        f"{where}: leaf {j} of shard {k}'s output is a {type(leaf).__name__}; "
                        "only tensors with a leading member axis can be gathered."
                    )
                if leaf.dim() == 0 or leaf.shape[0] != self.sizes[k]:
                    got = leaf.shape[0] if leaf.dim() else "no member axis"
                    raise ValueError(
                        f"{where}: leaf {j} of shard {k}'s output has leading size {got}; "
                        f"shard {k} holds {self.sizes[k]} members. Gather outputs with "
                        "the member axis first."
                    )
        return unflatten(spec, join_on([leaves for leaves, _ in flat], target))

    # --- training ------------------------------------------------------------------

    def _optimizers(self, where: str, optimizer: object) -> PerShard:
        opts = optimizer if isinstance(optimizer, PerShard) else None
        if opts is None:
            opts = PerShard([optimizer] * len(self.devices))
        if len(opts) != len(self.devices):
            raise ValueError(
                f"{where}: optimizer does not come one per shard (expected "
                f"{len(self.devices)} optimizers, one per shard, got {len(opts)}). Pass one "
                "GradientTransformation, or a PerShard of one per device."
            )
        for k, opt in enumerate(opts):
            if not isinstance(opt, GradientTransformation):
                raise TypeError(
                    f"{where}: optimizer {k} is a {type(opt).__name__}, not a "
                    f"GradientTransformation (expected one such as fe.optim.adam(lr=1e-3), "
                    f"got {type(opt).__name__}). Build one with fe.optim."
                )
        return opts

    def init_optimizer(self, optimizer: GradientTransformation | PerShard) -> PerShard:
        """Each shard's optimizer state, built on its device.

        Args:
            optimizer: An ``fe.optim`` transformation, or a ``PerShard`` of them (for
                per-member hyperparameters, each holding its shard's values, e.g.
                ``PerShard(fe.optim.adam(lr=lr[s]) for s in sharded.slices)``).

        Example:
            >>> import torch, funcensemble as fe
            >>> sharded = fe.distributed.ShardedEnsemble(
            ...     [torch.nn.Linear(3, 1) for _ in range(4)], ["cpu", "cpu"])
            >>> state = sharded.init_optimizer(fe.optim.adam(1e-2))
            >>> len(state)
            2
        """
        opts = self._optimizers("ShardedEnsemble.init_optimizer", optimizer)
        return PerShard(opt.init(p) for opt, p in zip(opts, self._params, strict=True))

    def step_(
        self,
        loss_fn: Callable[..., Any],
        optimizer: GradientTransformation | PerShard,
        state: PerShard,
        *batch: Any,
        in_dims: InDims = None,
        has_aux: bool = False,
        **kwargs: Any,
    ) -> tuple[PerShard, ...]:
        """One training step of every member, in place: gradients, update, new buffers.

        On each shard: [`value_and_grad`][funcensemble.value_and_grad] of the
        one-member ``loss_fn``, then ``optimizer.update`` and
        [`apply_updates`][funcensemble.optim.apply_updates]. ``params`` and
        ``buffers`` are replaced by the new ones; nothing is gathered and nothing waits
        for a device, so the shards train concurrently.

        Args:
            loss_fn: The one-member loss ``loss_fn(params, buffers, *batch, **kwargs)``.
            optimizer: An ``fe.optim`` transformation, or a ``PerShard`` of them.
            state: The optimizer state from
                [`init_optimizer`][funcensemble.distributed.ShardedEnsemble.init_optimizer]
                or the previous step.
            *batch: The batch, shared or split by ``in_dims``.
            in_dims: As in [`vmap`][funcensemble.vmap].
            has_aux: ``loss_fn`` returns ``(loss, aux)``.
            **kwargs: Shared keyword arguments of ``loss_fn``.

        Returns:
            ``(losses, state)``, or ``(losses, state, aux)`` with ``has_aux``; each a
            ``PerShard`` left on the devices (``gather`` them when needed).

        Example:
            >>> import torch, funcensemble as fe
            >>> sharded = fe.distributed.ShardedEnsemble(
            ...     [torch.nn.Linear(3, 1) for _ in range(5)], ["cpu", "cpu"])
            >>> def loss_fn(p, b, x, y):
            ...     return torch.nn.functional.mse_loss(sharded.fmodel(p, b, x), y)
            >>> opt = fe.optim.adam(1e-2)
            >>> state = sharded.init_optimizer(opt)
            >>> x, y = torch.randn(16, 3), torch.randn(16, 1)
            >>> losses, state = sharded.step_(loss_fn, opt, state, x, y)
            >>> sharded.gather(losses).shape
            torch.Size([5])
        """
        where = "ShardedEnsemble.step_"
        opts = self._optimizers(where, optimizer)
        if not isinstance(state, PerShard):
            raise TypeError(
                f"{where}: state must be the PerShard returned by init_optimizer, got "
                f"{type(state).__name__}."
            )
        try:
            dims = arg_dims(in_dims, len(batch))
        except (TypeError, ValueError) as error:
            raise _renamed(where, error) from None
        grad_fn = value_and_grad(
            loss_fn, dims, has_aux=has_aux, randomness=self.randomness, chunk_size=self.chunk_size
        )

        def one_shard(params, buffers, opt, opt_state, *args, **kw):
            losses, grads, buffers, *aux = grad_fn(params, buffers, *args, **kw)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (losses, apply_updates(params, updates), buffers, opt_state, *aux)

        results = self._map(
            one_shard,
            (opts, state, *batch),
            (None, None, *dims),
            kwargs,
            same_draw=self.randomness == "same",
            where=where,
            internal=2,
        )
        losses, params, buffers, state, *aux = results.unzip()
        self._params, self._buffers = params, buffers
        return (losses, state, *aux)

    def to_ensemble(self, *, device: str | torch.device | None = None) -> Ensemble:
        """All members gathered into one single-device [`Ensemble`][funcensemble.Ensemble].

        Args:
            device: Where the ensemble lives; the first shard's device by default.

        Example:
            >>> import torch, funcensemble as fe
            >>> ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(5)])
            >>> back = fe.distributed.ShardedEnsemble(ens, ["cpu", "cpu"]).to_ensemble()
            >>> torch.equal(back.stacked.weight, ens.stacked.weight)
            True
        """
        target = self.devices[0] if device is None else device_of("to_ensemble", device)

        def joined(shards: PerShard) -> dict[str, Tensor]:
            names = list(shards[0])
            parts = [[s[name].detach() for name in names] for s in shards]
            return dict(zip(names, join_on(parts, target), strict=True))

        params, buffers = joined(self._params), joined(self._buffers)
        return Ensemble._from_stacked(
            self.fmodel.skeleton, params, buffers, self.randomness, self.chunk_size
        )

    def __repr__(self) -> str:
        layout = ", ".join(f"{d}: {n}" for d, n in zip(self.devices, self.sizes, strict=True))
        return f"ShardedEnsemble(num_members={self._num_members}, {layout})"
