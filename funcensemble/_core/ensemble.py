"""``Ensemble``: N members as one ``nn.Module`` holding stacked ``[N, ...]`` parameters."""

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, SupportsIndex, TypeVar, cast

import torch
from torch import Tensor, nn

from .. import _torch_compat
from .._checkpoint.state_dict_checks import check_loadable
from .._kernels.fastpath import fast_call
from .._messages import positive_int
from .._structure import weight_transforms as _weight_transforms
from .._structure.architecture import Architecture, check_is_module, check_same_architecture
from .._types import StackedParameters, StackedTensors, StackedTree
from . import in_dims as _in_dims
from . import own_keywords, wrapper_call
from . import turns as _turns
from .fresh_outputs import not_saved
from .functional_module import FunctionalModule
from .in_dims import InDims
from .members import (
    Indices,
    check_indices,
    checked_member_index,
    copy_leaves_,
    copy_mapping,
    join,
    take,
)
from .seeding import build_seeded, check_seed, global_rng_restored_on_error, member_seed
from .skeleton import (
    Location,
    held_by_all,
    meta_skeleton,
    replace_tensors,
    restore_shared,
    shared,
    shared_state,
)
from .stack import (
    _num_members,
    checked_num_members,
    member_list,
    member_module,
    stack_as,
    stack_members,
)
from .tree_view import register_view
from .vmap import Randomness, check_options, mapped_call

# The hook tables of nn.Module's __call__ (and the handle-id sets flagging some of their
# entries), which select and concat carry over. State-dict hooks are not among them:
# torch binds some of those to the module they were registered on.
_CALL_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def _copy_call_hooks(src: nn.Module, dst: nn.Module) -> None:
    """Register ``src``'s own forward and backward hooks on ``dst`` too, in order.

    ``dst`` gets copies of the tables: a handle returned for ``src`` removes the hook
    from ``src`` only.
    """
    own = vars(src)
    for table in _CALL_HOOK_TABLES:
        hooks = own.get(table)
        if hooks:
            getattr(dst, table).update(hooks)
    if own.get("_backward_hooks"):
        dst._is_full_backward_hook = src._is_full_backward_hook


F = TypeVar("F", bound=Callable[..., Any])


def _taking_turns(method: F) -> F:
    """Run ``method`` while no call borrows the ensemble's module: a call off the fast
    path swaps its own tensors into ``self.stacked`` for its length (see ``_turns``),
    which another thread reading the module would see."""

    @functools.wraps(method)
    def taking_turns(self: "Ensemble", *args: Any, **kwargs: Any) -> Any:
        with _turn(self):
            return method(self, *args, **kwargs)

    return cast(F, taking_turns)


def _turn(ens: "Ensemble") -> contextlib.AbstractContextManager:
    stacked = ens._modules.get("stacked")  # (None while it is being built)
    if stacked is None or torch.compiler.is_compiling():  # (Dynamo cannot trace a lock)
        return contextlib.nullcontext()
    return _turns.lock(stacked)


class Ensemble(nn.Module):
    """N same-architecture modules run as one vectorized module.

    Its parameters are the members' parameters stacked along a leading member axis
    (``ens.stacked`` is a copy of the architecture holding them), so
    ``torch.optim.Adam(ens.parameters())``, ``state_dict``, ``.to()``, ``.double()``,
    ``.train()``/``.eval()``, hooks and ``torch.compile`` work as for any module.
    Calling it runs every member on the inputs and stacks the outputs.

    Args:
        modules: A non-empty sequence of modules of one architecture that differ
            only in their tensors (see [`stack`][funcensemble.stack]). Their tensors
            are copied, not shared.
        randomness: Passed to [`vmap`][funcensemble.vmap]: ``"different"`` dropout
            masks per member, or ``"same"`` for all members.
        chunk_size: Passed to [`vmap`][funcensemble.vmap]: run at most this many
            members at a time to bound memory.

    Example:
        >>> import torch, funcensemble as fe
        >>> ens = fe.Ensemble([torch.nn.Linear(8, 4) for _ in range(5)])
        >>> len(ens), ens(torch.randn(32, 8)).shape
        (5, torch.Size([5, 32, 4]))
        >>> ens(torch.randn(5, 32, 8), in_dims=0).shape  # one batch per member
        torch.Size([5, 32, 4])
    """

    _is_funcensemble_ensemble = True  # refused as a member's submodule

    stacked: nn.Module

    def __init__(
        self,
        modules: Sequence[nn.Module] | nn.ModuleList,
        *,
        randomness: Randomness = "different",
        chunk_size: int | None = None,
    ) -> None:
        fmodel, params, buffers = stack_as("Ensemble", modules)
        super().__init__()
        self._adopt(fmodel.skeleton, params, buffers, randomness, chunk_size)

    @classmethod
    def _from_stacked(
        cls,
        skeleton: nn.Module,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        randomness: Randomness,
        chunk_size: int | None,
    ) -> "Ensemble":
        """An ensemble holding already stacked tensors as they are (not copied), laid out
        as ``skeleton``'s: the one way in besides ``__init__`` (``from_factory``, member
        shards, ``ShardedEnsemble.to_ensemble``)."""
        ens = cls.__new__(cls)
        nn.Module.__init__(ens)
        ens._adopt(skeleton, params, buffers, randomness, chunk_size)
        return ens

    def _adopt(
        self,
        skeleton: nn.Module,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        randomness: Randomness,
        chunk_size: int | None,
    ) -> None:
        # Validate the vmap options once, here, rather than on the first call.
        check_options("Ensemble", lambda p, b: None, randomness, chunk_size)
        if not params and not buffers:
            raise ValueError(
                f"Ensemble: the members have no parameters or buffers (expected at least "
                f"one tensor to stack, got a {type(skeleton).__name__} without any), so "
                "there is no member axis to map over: every member computes the same "
                "function. Call one member directly (with torch.func.vmap over inputs "
                "for independent random draws)."
            )
        self.stacked = replace_tensors(
            skeleton,
            lambda name, t: nn.Parameter(params[name], requires_grad=t.requires_grad),
            lambda name, _: buffers[name],
        )
        self.randomness: Randomness = randomness
        self.chunk_size = chunk_size
        self.fmodel = FunctionalModule._of_stacked(self.stacked)
        # The call's own keywords that the members' forward also takes (refused there).
        self._keywords_taken = own_keywords.taken_by_forward(self.stacked)
        # Report the members' mode: an ensemble of eval-mode members is in eval mode.
        # (Not self.train(...): that would overwrite submodules' own, possibly mixed, flags.)
        self.training = skeleton.training

    @classmethod
    def from_factory(
        cls,
        factory: Callable[[], nn.Module],
        num_members: int,
        *,
        seed: int | None = None,
        randomness: Randomness = "different",
        chunk_size: int | None = None,
    ) -> "Ensemble":
        """Build N members by calling ``factory()`` once per member, in order.

        With ``seed=None``, the members draw from PyTorch's global generators as they
        are built, exactly as ``[factory() for _ in range(num_members)]`` would: the
        ensemble equals ``fe.Ensemble`` of that list, so ``torch.manual_seed(k)`` before
        the call reproduces it, and the global generators move on as after that loop
        (a call that raises puts them back as they were).
        With an int ``seed``, member i is built with the global CPU generator seeded
        from ``(seed, i)`` alone, whatever the global generator's state, and that state
        is restored afterwards. Either way each member gets the factory's own default
        initialization, members differ, and growing ``num_members`` keeps the existing
        members unchanged. Members are copied into preallocated stacked tensors one at
        a time: peak memory is the stacked tensors plus about two members, never N
        modules. Build on the CPU and move the ensemble with ``.to()``.
        Every member is checked against member 0 as in [`stack`][funcensemble.stack]:
        the factory must build the same architecture and non-tensor state each time.

        Args:
            factory: Called with no arguments once per member; returns an ``nn.Module``,
                the same architecture every time.
            num_members: N, a positive int.
            seed: None to draw from the global generators (see above), or any int
                >= 0 (no upper bound): member i then depends on ``(seed, i)`` only.
            randomness: As in [`Ensemble`][funcensemble.Ensemble].
            chunk_size: As in [`Ensemble`][funcensemble.Ensemble].

        Raises:
            TypeError: A non-callable ``factory``, a ``num_members`` or ``seed`` that is
                not an int (``bool`` included), a factory returning a non-module, or
                members of different classes.
            ValueError: ``num_members < 1``, ``seed < 0``, or members differing in
                names, shapes, dtypes, devices, ``requires_grad`` or train/eval mode.

        Example:
            >>> import torch, funcensemble as fe
            >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh())
            >>> ens = fe.Ensemble.from_factory(make, num_members=128, seed=0)
            >>> small = fe.Ensemble.from_factory(make, num_members=4, seed=0)
            >>> torch.equal(ens.member(3)[0].weight, small.member(3)[0].weight)
            True
            >>> _ = torch.manual_seed(7)
            >>> a = fe.Ensemble.from_factory(make, num_members=4)  # the global generator
            >>> _ = torch.manual_seed(7)
            >>> b = fe.Ensemble.from_factory(make, num_members=4)
            >>> torch.equal(a.stacked[0].weight, b.stacked[0].weight)
            True
        """
        where = "Ensemble.from_factory"
        if not callable(factory):
            raise TypeError(
                f"{where}: factory must be callable (expected a function building one "
                f"member, got {type(factory).__name__}). Pass e.g. lambda: nn.Linear(3, 1)."
            )
        positive_int(where, "num_members", num_members)
        if seed is None:

            def build(i: int) -> object:  # checked by stack_members
                return factory()

        else:
            base = check_seed(where, seed, none_ok=True)

            def build(i: int) -> object:  # checked by stack_members
                return build_seeded(factory, member_seed(base, i))

        # With seed=None the members draw from the global generators; a refused call
        # (a member that raises or differs from member 0) puts them back as they were.
        with global_rng_restored_on_error():
            members = (build(i) for i in range(num_members))
            first, params, buffers = stack_members(where, members, num_members, alive=False)
        skeleton = meta_skeleton(first, where=where)
        return cls._from_stacked(skeleton, params, buffers, randomness, chunk_size)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("randomness", "chunk_size") and "fmodel" in self.__dict__:
            # Checked as when the ensemble is built (torch's own messages came at the
            # next call otherwise).
            options = {"randomness": self.randomness, "chunk_size": self.chunk_size}
            options[name] = value
            check_options("Ensemble", lambda p, b: None, **options)  # type: ignore[arg-type]
        if name == "stacked" and "fmodel" in self.__dict__:
            # The function that runs the members keeps the module it was built with.
            raise AttributeError(
                "Ensemble: stacked cannot be replaced once the ensemble is built (expected "
                f"the module it was built with, got a new {type(value).__name__}): its "
                "calls would run the old module's settings on the new one's tensors. Build "
                "a new fe.Ensemble from the members, e.g. fe.Ensemble(ens.unstack()) after "
                "changing them."
            )
        super().__setattr__(name, value)

    def __getstate__(self) -> dict[str, Any]:
        # The objects every member holds stay one object in a deep copy or an unpickled
        # ensemble, as they stay one in copy.deepcopy of the members' list.
        return shared_state(self.stacked, dict(super().__getstate__()))

    def __setstate__(self, state: dict[str, Any]) -> None:
        record = restore_shared(state)
        super().__setstate__(state)
        record(self.stacked)

    def __len__(self) -> int:
        return self.num_members

    @property
    def num_members(self) -> int:
        """N, the size of the leading member axis."""
        for t in self.stacked_params().values():
            return t.shape[0]
        for t in self.stacked_buffers().values():
            return t.shape[0]
        raise ValueError("Ensemble: the architecture has no parameters or buffers.")

    def _checked_num_members(self, where: str) -> int:
        """N, after checking every stacked tensor's shape (see ``checked_num_members``)."""
        return checked_num_members(
            where, self.fmodel, self.stacked_params(), self.stacked_buffers(), computing=True
        )

    @_taking_turns
    def stacked_params(self) -> StackedParameters:
        """The live stacked parameters ``[N, ...]`` by state-dict name (tied ones once)."""
        return dict(self.stacked.named_parameters())

    @_taking_turns
    def stacked_buffers(self) -> StackedTensors:
        """The live stacked buffers ``[N, ...]`` by state-dict name."""
        return dict(self.stacked.named_buffers())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        taken = self.__dict__.get("_keywords_taken", ())  # (not in pickles of before)
        if taken:
            forward = f"{type(self.stacked).__name__}.forward"
            own_keywords.refuse_clash("Ensemble", ("in_dims",), taken, forward, kwargs)
        # Global forward hooks run on the members' modules, not on the Ensemble itself.
        return wrapper_call.call(self, "Ensemble", args, kwargs)

    def forward(self, *args: Any, in_dims: InDims = None, **kwargs: Any) -> StackedTree:
        """Run every member; outputs get a leading member axis.

        In train mode, BatchNorm running statistics are updated for every member; if the
        call raises (e.g. a wrong input shape for a later layer), they are left as they
        were.

        Args:
            *args: Positional inputs, shared by all members unless ``in_dims`` says
                otherwise.
            in_dims: As in [`vmap`][funcensemble.vmap]: ``0`` to give each member its
                own slice of every positional input, or one entry per input. Where
                the members' ``forward`` has a parameter ``in_dims`` too, passing it by
                keyword is refused: pass the member's positionally.
            **kwargs: Keyword inputs, shared by all members.
        """
        if in_dims is None:  # inputs shared by all members: nothing to check
            dims: tuple[Any, ...] = (None,) * len(args)
        else:
            _in_dims.check_type("Ensemble", in_dims)
            dims = _in_dims.per_argument(in_dims, args, self.num_members, "Ensemble")
        if self.chunk_size is None:
            fast = fast_call(self.stacked, None, args, kwargs, dims, where="Ensemble")
            if fast is not None:
                # (Checked here: a traced call must not enter not_saved as a new frame.)
                return fast if torch.compiler.is_compiling() else not_saved(fast)
        mapped = mapped_call(self.fmodel, self.randomness, self.chunk_size, where="Ensemble")
        # Read while no other thread's call has its own tensors swapped into the module
        # (see _turns); not while compiling (a lock does not trace). (The fast path above
        # reads them too: a plain MLP's calls never swap, they all take the fast path.)
        with _turn(self):
            params, buffers = self.stacked_params(), self.stacked_buffers()
        if not _torch_compat.jit_tracing():  # (which refuses below, saying why)
            try:  # a tensor assigned after building
                _num_members("Ensemble", params, buffers, checked=True, computing=True)
            except ValueError:
                if not torch.compiler.is_compiling():
                    # A weight transform added since changes the tensors' names and
                    # shapes: named rather than the shapes it changed (the call below
                    # checks for one anyway: not twice a call).
                    _weight_transforms.check_unchanged(
                        "Ensemble", self.stacked, self.fmodel._weight_transforms
                    )
                raise
        return mapped(params, buffers, args, kwargs, dims)

    @_taking_turns
    def member(self, index: SupportsIndex) -> nn.Module:
        """An independent ordinary module holding member ``index`` (negative counts back;
        a NumPy integer or a 0-d integer tensor such as ``losses.argmin()`` works too);
        objects of your own classes that every member holds stay shared, as in the loop.

        Example:
            >>> import torch, funcensemble as fe
            >>> ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(4)])
            >>> torch.equal(ens.member(-1).weight, ens.stacked.weight[3])
            True
        """
        where = "Ensemble.member"
        i = checked_member_index(where, index, self._checked_num_members(where))
        _weight_transforms.check_unchanged(where, self.stacked, self.fmodel._weight_transforms)
        return member_module(self.stacked, self.stacked_params(), self.stacked_buffers(), i)

    @_taking_turns
    def unstack(self) -> list[nn.Module]:
        """All members as independent ordinary modules (see [`unstack`][funcensemble.unstack])."""
        return [self.member(i) for i in range(self.num_members)]

    def _with_tensors(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        kept: dict[Location, object] | None = None,
    ) -> "Ensemble":
        """A new ensemble of this one's architecture and options holding these tensors,
        with the forward and backward hooks registered on this ensemble itself;
        ``kept``: the objects its members all hold (by default, this one's)."""
        _weight_transforms.check_unchanged("Ensemble", self.stacked, self.fmodel._weight_transforms)
        skeleton = meta_skeleton(self.stacked, kept)
        new = self._from_stacked(skeleton, params, buffers, self.randomness, self.chunk_size)
        _copy_call_hooks(self, new)
        return new

    @_taking_turns
    def select(self, indices: Indices) -> "Ensemble":
        """A new ensemble of the members ``indices``, in that order.

        Drop members by selecting the others, reorder them, or copy member i over
        member j with ``idx = list(range(N)); idx[j] = i`` (duplicates give independent
        copies; negative indices count back). The new ensemble holds new tensors on the
        same devices and dtypes, with the same ``randomness``, ``chunk_size``,
        train/eval flags, the members' hooks and the forward and backward hooks
        registered on this ensemble itself (copies: a handle from this ensemble's
        registration removes the hook here only; state-dict hooks on the ensemble
        itself are not carried over); its parameters are fresh leaves with the
        ``requires_grad`` of this one's (frozen stays frozen). This ensemble is
        unchanged. An optimizer follows with
        [`EnsembleOptimizer.select`][funcensemble.optim.EnsembleOptimizer.select].

        Raises:
            TypeError: ``indices`` is not a sequence of ints or a 1-D integer tensor.
            ValueError: ``indices`` is empty.
            IndexError: An index out of range.

        Example:
            >>> import torch, funcensemble as fe
            >>> ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(5)])
            >>> best = ens.select([4, 0])
            >>> len(best), torch.equal(best.member(0).weight, ens.member(4).weight)
            (2, True)
        """
        idx = check_indices(
            "Ensemble.select", indices, self._checked_num_members("Ensemble.select")
        )
        return self._with_tensors(
            take(self.stacked_params(), idx), take(self.stacked_buffers(), idx)
        )

    @_taking_turns
    def concat(self, modules: "Sequence[nn.Module] | nn.ModuleList | Ensemble") -> "Ensemble":
        """A new ensemble of this one's members followed by ``modules`` (members appended).

        Each new module must have this ensemble's architecture, checked as
        [`stack`][funcensemble.stack] checks members (same classes, names, shapes,
        dtypes, devices, ``requires_grad``, train/eval flags and non-tensor state);
        another ``Ensemble`` of that architecture adds all its members. Their tensors
        are copied. The new ensemble keeps this one's options, flags and hooks as
        [`select`][funcensemble.Ensemble.select] does. This ensemble is unchanged.
        Give the new members optimizer state with
        [`EnsembleOptimizer.concat`][funcensemble.optim.EnsembleOptimizer.concat].

        Raises:
            TypeError: A member that is not an ``nn.Module``, or of another class.
            ValueError: No modules, or a module of another architecture (the message
                names its member index in the grown ensemble).

        Example:
            >>> import torch, funcensemble as fe
            >>> ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(4)])
            >>> grown = ens.concat([torch.nn.Linear(3, 2)])
            >>> len(grown), torch.equal(grown.member(1).bias, ens.member(1).bias)
            (5, True)
        """
        where = "Ensemble.concat"
        n = self._checked_num_members(where)
        ref = Architecture.of(self.member(0))
        if isinstance(modules, Ensemble):
            check_same_architecture(where, n, ref, modules.member(0))
            params, buffers = modules.stacked_params(), modules.stacked_buffers()
            added = [modules.stacked]
        else:
            modules = member_list(where, modules, "a list, or an Ensemble")
            for k, module in enumerate(modules):
                check_same_architecture(where, n + k, ref, check_is_module(where, n + k, module))
            _, params, buffers = stack_as(where, modules)
            added = modules
        return self._with_tensors(
            join(where, [self.stacked_params(), params], "params"),
            join(where, [self.stacked_buffers(), buffers], "buffers"),
            # The objects every member holds: those the added members hold too.
            kept=held_by_all(shared(self.stacked), added),
        )

    @_taking_turns
    def copy_members_(self, src: SupportsIndex | Indices, dst: SupportsIndex | Indices) -> None:
        """Copy member ``src`` over member ``dst`` in place: parameters and buffers.

        The exploit step of population-based training. ``src`` and ``dst`` are ints or
        equal-length sequences of pairs; every source is read before any destination
        is written (so ``copy_members_([0, 1], [1, 0])`` swaps), destinations must be
        distinct, negative indices count back. The parameters stay the same tensors
        (an optimizer over them keeps working); their ``.grad`` is not touched. Copy
        the optimizer state too, with
        [`EnsembleOptimizer.copy_members_`][funcensemble.optim.EnsembleOptimizer.copy_members_].
        Everything is checked before anything is written.

        Raises:
            TypeError: An index that is not an int.
            ValueError: ``src`` and ``dst`` of different lengths, or a repeated ``dst``.
            IndexError: An index out of range.

        Example:
            >>> import torch, funcensemble as fe
            >>> ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(4)])
            >>> ens.copy_members_(src=[0, 0], dst=[2, 3])
            >>> torch.equal(ens.stacked.weight[3], ens.stacked.weight[0])
            True
        """
        where = "Ensemble.copy_members_"
        mapping = copy_mapping(where, src, dst, self._checked_num_members(where))
        copy_leaves_([self.stacked_params(), self.stacked_buffers()], mapping)

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}"

    @_taking_turns
    def _apply(self, fn: Any, recurse: bool = True) -> "Ensemble":
        # .to(), .double(), .cpu(), share_memory(), ...: all of nn.Module's conversions.
        check_no_swap("Ensemble.to/.double/.half/.cpu/.cuda/share_memory (nn.Module._apply)")
        return super()._apply(fn, recurse)

    @_taking_turns
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return super().state_dict(*args, **kwargs)

    def _named_members(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        # parameters(), buffers() and their named_ forms: read in one turn, then handed
        # out (a generator holding the lock would keep other threads' calls waiting).
        with _turn(self):
            found = list(super()._named_members(*args, **kwargs))
        yield from found

    @_taking_turns
    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module.load_state_dict``, checked in full before anything is copied.

        A state_dict that fails any check changes nothing: no parameter or buffer is
        written unless every entry is loadable. Values of another floating-point (or
        integer) dtype are converted, as ``nn.Module.load_state_dict`` converts them
        (with ``assign=True`` they are not: torch assigns the given tensors, dtype and
        all).

        Raises:
            TypeError: ``state_dict`` is not a mapping, or a value is not a tensor.
            ValueError: Missing or unexpected keys (when ``strict``); keys of one member
                module's state_dict (``"0.weight"`` for ``"stacked.0.weight"``, also
                when not ``strict``); a different member count; a shape that does not
                match this ensemble; a tensor on the meta device; a dtype of
                another kind (floating-point, integer, complex, bool); or
                ``assign=True`` for members with tied weights, which it would untie.
        """
        check_no_swap("Ensemble.load_state_dict")
        if assign:
            _refuse_untying("Ensemble.load_state_dict", self.stacked)
        check_loadable(
            "Ensemble.load_state_dict",
            self.state_dict(keep_vars=True),
            state_dict,
            self.num_members,
            strict=strict,
        )
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _refuse_untying(where: str, stacked: nn.Module) -> None:
    """Refuse ``assign=True`` for members with tied tensors: torch gives each slot
    (a module's parameter or buffer name) the tensor given for it, which unties one
    tensor held in two slots; the ensemble of tied members could not run after. (One
    submodule registered under two names is one slot: assign keeps it one.)"""
    slots: dict[int, dict[tuple[int, str], str]] = {}
    for path, module in stacked.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    full = f"{path}.{name}" if path else name
                    slots.setdefault(id(t), {}).setdefault((id(module), name), full)
    tied = next((list(s.values()) for s in slots.values() if len(s) > 1), None)
    if tied is not None:
        shown = " and ".join(f"`{n}`" for n in tied)
        raise ValueError(
            f"{where}: assign=True would untie {shown}, one tensor under several names "
            "in these members (torch's assign gives each name the tensor given for it, "
            "which the ensemble of tied members cannot run; expected assign=False for "
            "tied weights). Load without assign=True: the values are copied into the "
            "tied tensor, which stays tied."
        )


def check_no_swap(where: str) -> None:
    """Refuse, before anything is converted, torch's swap of module tensors: it refuses
    the ensemble's live stacked tensors (funcensemble keeps weak references to them)
    after converting some, which would leave the ensemble half-converted."""
    if torch.__future__.get_swap_module_params_on_conversion():
        raise RuntimeError(
            f"{where}: torch.__future__.set_swap_module_params_on_conversion(True) is on "
            "(expected it off for an Ensemble): torch's swap_tensors refuses the "
            "ensemble's stacked tensors, which funcensemble keeps weak references to, "
            "and would fail after converting some of them. Turn it off around the call "
            "(torch.__future__.set_swap_module_params_on_conversion(False)), or convert "
            "the members before building the ensemble."
        )


# The optimizer layer works on pytrees and knows nothing of Ensemble: it sees one as
# its stacked parameters and buffers.
register_view(
    Ensemble, lambda ens: {"params": ens.stacked_params(), "buffers": ens.stacked_buffers()}
)
