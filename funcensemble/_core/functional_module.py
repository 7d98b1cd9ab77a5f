"""``FunctionalModule``: one member's module as a pure function of its tensors."""

import re
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .. import _torch_compat
from .._kernels.fastpath import fast_call
from .._kernels.rewrites import vmap_rewrites
from .._structure import aliases as _aliases
from .._structure import backward_hooks as _backward_hooks
from .._structure import chunk_state as _chunk_state
from .._structure import escaped_tensors as _escaped_tensors
from .._structure import forward_state as _forward_state
from .._structure import updated_in_place as _updated_in_place
from .._structure import weight_transforms as _weight_transforms
from .._structure.tensor_tags import tensor_tags
from . import entry as _entry
from . import turns as _turns
from .diagnose import linear_width_error
from .rollback import save_before_update
from .skeleton import restore_shared, shared_state

MemberShapes = dict[str, tuple[str, torch.Size | None]]


def member_shapes(skeleton: nn.Module, stacked: bool | None) -> MemberShapes:
    """One member's shape of each of ``skeleton``'s tensors, by name, with its kind
    (``"parameter"`` or ``"buffer"``); ``stacked``: the tensors have the member axis
    (``None``: not known, the shapes are not recorded, only the names). A lazy
    module's uninitialized tensor has no shape yet: None."""

    def shape(t: Tensor) -> torch.Size | None:
        if stacked is None or nn.parameter.is_lazy(t):
            return None
        return t.shape[1:] if stacked else t.shape

    return {
        name: (kind, shape(t))
        for kind, named in (
            ("parameter", skeleton.named_parameters()),
            ("buffer", skeleton.named_buffers()),
        )
        for name, t in named
    }


def _check_given(
    shapes: MemberShapes,
    params: Any,
    buffers: Any,
    skeleton: nn.Module | None = None,
    where: str | None = None,
    *,
    stacked: bool = False,
) -> None:
    """Refuse ``params`` and ``buffers`` that leave out a tensor of the module, or hold
    one of another shape than the module's.

    ``functional_call(strict=False)`` would use the skeleton's own tensor for a missing
    one: a meta tensor (``fe.stack``) or all members' stacked one (``Ensemble.fmodel``),
    wrong numbers either way (or none at all). A tensor of another shape may broadcast
    where the member's would not (a ``[4]`` bias of an ``[N=4, 4]`` one, sliced to one
    number per member): each member would compute another function, without a word.
    Buffers merged into ``params``, and a tied tensor's second name, are refused too.
    ``stacked``: the tensors are all members' (their names only are checked).
    """
    where = where or _where()
    for name, (kind, shape) in shapes.items():
        t = params.get(name) if isinstance(params, Mapping) else None
        if t is None and isinstance(buffers, Mapping):
            t = buffers.get(name)
        if t is None:
            raise ValueError(
                f"{where}: the module's {kind} `{name}` is in neither params nor buffers "
                "(expected every parameter and buffer, as fe.stack returns them). Pass them "
                "all, the frozen ones too: value_and_grad differentiates only those that "
                "require grad."
            )
        if not stacked and shape is not None and isinstance(t, Tensor) and t.shape != shape:
            raise _shape_error(name, kind, tuple(shape), tuple(t.shape), where)
        if kind == "buffer" and isinstance(params, Mapping) and name in params:
            raise ValueError(
                f"{where}: the buffer `{name}` was passed in params (expected the "
                "buffers in their own dict, the second argument, as fe.stack returns "
                "them, got them merged into params, as in torch.func's "
                "functional_call(model, {**params, **buffers}, x)). In params, forward's "
                "in-place updates (BatchNorm's running statistics) would write into "
                "your tensors, and a call that fails could not put them back: call "
                "fmodel(params, buffers, x)."
            )
    given = (len(params) if isinstance(params, Mapping) else 0) + (
        len(buffers) if isinstance(buffers, Mapping) else 0
    )
    if given > len(shapes):
        _refuse_unknown(shapes, params, buffers, skeleton, where)


def check_given(fmodel: "FunctionalModule", params: Any, buffers: Any, where: str) -> None:
    """[`_check_given`][]'s names for ``fmodel``'s module, naming ``where``, on all
    members' stacked tensors (their shapes are checked where they are split). A
    parametrization or pruning added after building, which renames tensors, is named
    first."""
    _weight_transforms.check_unchanged("Ensemble", fmodel.skeleton, fmodel._weight_transforms)
    _check_given(fmodel._member_shapes, params, buffers, fmodel.skeleton, where, stacked=True)


def keys_differ(fmodel: "FunctionalModule", params: Any, buffers: Any) -> bool:
    """Whether ``params`` and ``buffers`` hold more or fewer keys than ``fmodel``'s
    module has tensors: a cheap test run on every call, before the fast path, which
    reads only its own names (then [`_check_given`][] says which)."""
    if not (isinstance(params, Mapping) and isinstance(buffers, Mapping)):
        return False
    return len(params) + len(buffers) != len(fmodel._member_shapes)


def _refuse_unknown(
    shapes: MemberShapes, params: Any, buffers: Any, skeleton: nn.Module | None, where: str
) -> None:
    """Refuse a key of ``params`` or ``buffers`` that is a second name of one of the
    module's tensors (tied weights: torch's functional_call raises on it, unclearly), or
    a tensor given in both. Other keys the module does not have are left alone, as
    ``functional_call`` leaves them: a loss may keep its own tensors beside the
    model's in the dict it is given."""
    named = None
    for given, found, other in (("params", params, buffers), ("buffers", buffers, params)):
        for name in found if isinstance(found, Mapping) else ():
            if name not in shapes:
                if skeleton is None:
                    continue
                named = dict(_named_tensors(skeleton)) if named is None else named
                if name in named:
                    first = next(n for n, t in _named_tensors(skeleton) if t is named[name])
                    raise ValueError(
                        f"{where}: {given}[{name!r}] is a second name of the tied "
                        f"`{first}` (expected each tensor once, under the name fe.stack "
                        "gives it: a tied tensor is stacked once, under its first name). "
                        f"Pass it once, as `{first}`."
                    )
            elif given == "params" and isinstance(other, Mapping) and name in other:
                raise ValueError(
                    f"{where}: `{name}` is in both params and buffers (expected each "
                    "tensor once, as fe.stack returns them). Pass it in one of them."
                )


def _where() -> str:
    if torch.compiler.is_compiling():
        return "vmap"  # (Dynamo traces no ContextVar)
    return _entry.current() if _torch_compat.inside_transform() else "FunctionalModule"


def _shape_error(
    name: str, kind: str, want: tuple[int, ...], got: tuple[int, ...], where: str
) -> ValueError:
    given = f"{'params' if kind == 'parameter' else 'buffers'}[{name!r}]"
    if where == "FunctionalModule" and got[1:] == want:
        return ValueError(
            f"FunctionalModule: {given} has shape {got}, all members stacked "
            f"(expected one member's {want}): fmodel computes ONE member. Map it over the "
            "members with fe.vmap(fmodel)(params, buffers, x), or pass one member's slice "
            "({k: v[i] for k, v in params.items()})."
        )
    return ValueError(
        f"{where}: {given} has one member's shape {got}, but the members were "
        f"built with {want} (expected {want}, got {got}): a tensor of another shape would "
        "compute another function than each member's, or broadcast. Keep every stacked "
        "tensor [N, *shape] with the member's shape as built (the tensors fe.stack "
        "returned, or an ensemble's own); to change shapes, build a new ensemble from "
        "modules of the new shapes."
    )


def _named_tensors(skeleton: nn.Module) -> tuple[tuple[str, Tensor], ...]:
    return (
        *skeleton.named_parameters(remove_duplicate=False),
        *skeleton.named_buffers(remove_duplicate=False),
    )


@torch.compiler.disable  # torch.compile cannot read a tensor's attributes
def _tags_and_tensors(
    skeleton: nn.Module,
) -> tuple[dict[str, dict[str, Any]], dict[str, "weakref.ref[Tensor]"]]:
    """The Python attributes set on the skeleton's tensors, by name (see
    ``_structure.attributes``: the stacked tensors carry the members' tags), and the
    skeleton's tensors by name, weakly."""
    named = _named_tensors(skeleton)
    tags = {name: found for name, t in named if (found := tensor_tags(t))}
    return tags, {name: weakref.ref(t) for name, t in named}


@torch.compiler.assume_constant_result
def _tagged(skeleton: nn.Module) -> bool:
    """Whether any of the skeleton's tensors has a tag, asked by torch.compile while it
    traces: a constant of the graph, evaluated at each compilation.

    torch 2.10 and 2.11 stop here (a module is no constant to their Dynamo). Left so:
    past this stop, their inductor computed wrong training steps (versions.md).
    """
    return bool(_tags_and_tensors(skeleton)[0])


def _call(fmodel: "FunctionalModule", params: Any, buffers: Any, args: Any, kwargs: Any) -> Any:
    return fmodel(params, buffers, *args, **kwargs)


# torch.compile cannot show forward a tensor's tags (a traced tensor takes no attribute):
# a call whose forward may read them runs eagerly, where it sees them.
_eagerly = _torch_compat.compile_disabled(
    _call,
    reason="funcensemble: forward may read the Python attributes set on the members' "
    "parameters or buffers, which torch.compile cannot show it, so this call runs "
    "eagerly. To compile it, delete those attributes before building the ensemble (for "
    "optimizer groups, name the parameters in fe.optim.partition instead of tagging them).",
)


class FunctionalModule:
    """A module turned into a pure function of ``(params, buffers, *args, **kwargs)``.

    It computes ONE member: ``params`` and ``buffers`` are dicts keyed by state-dict
    names holding one member's tensors. Map it over members with
    [`funcensemble.vmap`][]. The wrapped ``skeleton`` holds no weights of its own (its
    tensors are on the meta device, or are the stacked tensors of an
    [`Ensemble`][funcensemble.Ensemble]); its ``training`` flags decide train/eval
    behaviour: switch them with ``fmodel.skeleton.train()`` and
    ``fmodel.skeleton.eval()`` (a FunctionalModule has no ``train`` or ``eval`` of its
    own).

    Example:
        >>> import torch, funcensemble as fe
        >>> fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 2) for _ in range(4)])
        >>> one = {k: v[0] for k, v in params.items()}
        >>> fmodel(one, {}, torch.ones(5, 3)).shape
        torch.Size([5, 2])
    """

    def __init__(self, skeleton: nn.Module) -> None:
        self.skeleton = skeleton
        self._keep_tensors()
        self._weight_transforms = _weight_transforms.of(skeleton)
        self._member_shapes = member_shapes(skeleton, stacked=False)

    @classmethod
    def _of_stacked(cls, stacked: nn.Module) -> "FunctionalModule":
        """The function of one member of ``stacked``, whose tensors are ``[N, ...]``."""
        fmodel = cls(stacked)
        fmodel._member_shapes = member_shapes(stacked, stacked=True)
        return fmodel

    def _keep_tensors(self) -> None:
        """Keep (weakly) the skeleton's own tensors by name: torch.export's non-strict
        tracing swaps them for fake ones, which hold no tags; the tags are read from
        these, as they are then."""
        self._tensors = _tags_and_tensors(self.skeleton)[1]

    def __getstate__(self) -> dict[str, Any]:  # weak references neither copy nor pickle
        state = {
            "skeleton": self.skeleton,
            "weight_transforms": self._weight_transforms,
            "member_shapes": self._member_shapes,
        }
        return shared_state(self.skeleton, state)  # (see Ensemble.__getstate__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        restore_shared(state)(state["skeleton"])
        self.skeleton = state["skeleton"]
        self._keep_tensors()
        self._weight_transforms = state.get("weight_transforms", frozenset())
        # (A pickle from before shapes were recorded: its tensors' names only.)
        self._member_shapes = state.get("member_shapes") or member_shapes(self.skeleton, None)

    def _kept_tags(self) -> dict[str, dict[str, Any]]:
        """The tags of the tensors ``_keep_tensors`` kept."""
        out = {}
        for name, ref in self._tensors.items():
            t = ref()
            if t is not None and (tags := tensor_tags(t)):
                out[name] = tags
        return out

    def __call__(
        self, params: dict[str, Tensor], buffers: dict[str, Tensor], *args: Any, **kwargs: Any
    ) -> Any:
        compiling = torch.compiler.is_compiling()
        differ = compiling or keys_differ(self, params, buffers)
        # A parametrization or pruning added to the ensemble's module after it was
        # built would act on all members' stacked tensor at once: refused. Where the
        # members had none, that check waits for a call the fast path does not take:
        # the fast path runs only plain layer classes without hooks, so one added since
        # to a layer the call runs sends it on, to the check below, before anything ran.
        deferred = compiling or not (differ or self._weight_transforms)
        if not deferred:
            _weight_transforms.check_unchanged("Ensemble", self.skeleton, self._weight_transforms)
        if differ:
            # Traced once: no cost per call. Eagerly, the fast path checks what it reads;
            # a key more or fewer than the module's tensors is refused here.
            _check_given(self._member_shapes, params, buffers, self.skeleton)
        if len(args) == 1 and not kwargs:
            entry = "vmap" if compiling else _entry.current()  # (Dynamo traces no ContextVar)
            fast = fast_call(self.skeleton, params, args, kwargs, None, where=entry)
            if fast is not None:
                return fast
        if deferred and not compiling:
            _weight_transforms.check_unchanged("Ensemble", self.skeleton, self._weight_transforms)
        if not compiling and _torch_compat.jit_tracing():
            raise RuntimeError(
                "torch.jit.trace cannot trace this ensemble (expected a plain MLP of "
                "Linear layers and activations, whose fast path traces): torch.func's "
                "functional_call, which runs every other member architecture, refuses "
                "TorchScript tracing. Use torch.export.export or torch.compile instead."
            )
        if compiling:  # (Dynamo cannot trace a lock; a compiled graph borrows nothing)
            return self._borrowing_call(params, buffers, args, kwargs, compiling=True)
        with _turns.lock(self.skeleton):  # (see _turns: calls would swap each other's tensors)
            return self._borrowing_call(params, buffers, args, kwargs, compiling=False)

    def _borrowing_call(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        compiling: bool,
    ) -> Any:
        """The call off the fast path: ``forward`` on the skeleton, with this call's
        tensors swapped in by ``functional_call``."""
        if not compiling:
            _check_given(self._member_shapes, params, buffers, self.skeleton)
        dynamo = compiling and torch.compiler.is_dynamo_compiling()
        if dynamo and _tagged(self.skeleton):
            return _eagerly(self, params, buffers, args, kwargs)
        exporting = compiling and not dynamo  # torch.export's non-strict tracing
        if not compiling:
            _chunk_state.seen(self.skeleton)  # a chunked call replays each chunk alike
        inside = not compiling and _torch_compat.inside_transform()
        where = _entry.current() if inside else "FunctionalModule"
        if inside:
            # Backward hooks would not run here: refused (see _structure.backward_hooks).
            _backward_hooks.check_call(where, self.skeleton)
            # Inside fe.vmap: keep a copy of the tensors this forward will update,
            # put back if the call fails (see _rollback).
            save_before_update(_updated_in_place.by_forward(self.skeleton))
        # The skeleton's modules, walked by the checks before and after the forward.
        modules = list(self.skeleton.modules()) if inside else []
        before = _forward_state.kept_tensors(modules) if inside else None
        # Containers only where no code of the caller's runs in the call after the
        # forward: a loss may read, in the same call, what a hook kept for it.
        containers = inside and _entry.forward_only()
        in_containers = _escaped_tensors.snapshot(modules) if containers else None
        # One dict of our own: functional_call writes back into it what the module holds
        # at the end, so re-assigned buffers show (see _forward_state).
        given = {**params, **buffers}
        if inside:  # read at every call: a tag set after the first call counts too
            tagged, self._tensors = _tags_and_tensors(self.skeleton)
        elif exporting and _torch_compat.inside_transform():
            # torch.export's non-strict tracing runs this code on fake tensors, which
            # hold no tags: read them from the tensors they stand for.
            tagged = self._kept_tags()
        else:
            tagged = {}
        if tagged:
            # forward reads a tag as the loop's member does (getattr with a default
            # too): set on this call's own wrappers of the stacked tensors only.
            for name, tags in tagged.items():
                t = params.get(name, buffers.get(name))
                if isinstance(t, Tensor) and _torch_compat.is_wrapped(t):
                    vars(t).update(tags)
        try:
            # Under vmap, BatchNorm of all members runs as one call, and a few calls that
            # vmap cannot batch, or batches wrongly, run as the loop's math (see _rewrites).
            # A submodule under two names: put back what functional_call leaks (see _aliases).
            # Inside parametrize.cached(), the skeleton's parametrized tensors are cached
            # for this call only: they are one member's, or batched.
            with (
                vmap_rewrites(self.skeleton, (given, args, kwargs)),
                _aliases.kept(self.skeleton),
                _torch_compat.own_parametrize_cache(),
            ):
                out = functional_call(
                    self.skeleton, given, args, kwargs, tie_weights=True, strict=False
                )
        except RuntimeError:
            if torch.compiler.is_compiling():
                raise
            clear = linear_width_error(where, self.skeleton, params, buffers, args, kwargs)
            if clear is None:
                raise
            raise clear from None
        except AttributeError as error:
            clear = (
                None
                if torch.compiler.is_compiling()
                else _tensor_attribute(where, self.skeleton, error)
            )
            if clear is None:
                raise
            raise clear from error
        if before is not None:
            # Listed again: the forward may have made or replaced submodules.
            modules = list(self.skeleton.modules())
            try:
                _forward_state.check_kept(where, self.skeleton, modules, before)
            finally:  # what the call left in containers goes too, whichever is refused
                if containers:
                    _escaped_tensors.check(where, self.skeleton, modules, in_containers)
        _forward_state.carry_rebound(where, params, buffers, given, save_before_update)
        return out

    def __repr__(self) -> str:
        return f"FunctionalModule({self.skeleton!r})"

    if not TYPE_CHECKING:  # type checkers go on reporting every unknown attribute

        def __getattr__(self, name: str) -> Any:
            # Reached only for an attribute the object lacks: nn.Module's two mode
            # switches, looked for here first, get a pointer to the skeleton's.
            message = f"'{type(self).__name__}' object has no attribute '{name}'"
            if name in ("train", "eval"):
                message += (
                    ": a FunctionalModule is a function, and its skeleton's training flags "
                    f"decide train/eval behaviour (expected fmodel.skeleton.{name}(), got "
                    f"fmodel.{name}()). Call fmodel.skeleton.{name}()."
                )
            raise AttributeError(message, name=name, obj=self)


def _tensor_attribute(where: str, skeleton: nn.Module, error: AttributeError) -> ValueError | None:
    """A clear error for a forward that read an attribute set on a parameter or buffer:
    inside the call it holds the stacked (and batched) values, plain tensors."""
    found = re.search(r"object has no attribute '([^']+)'", str(error))
    if found is None or not isinstance(getattr(error, "obj", None), Tensor):
        return None  # another object's attribute
    name = found[1]
    for kind, tensors in (
        ("parameter", skeleton.named_parameters()),
        ("buffer", skeleton.named_buffers()),
    ):
        for path, t in tensors:
            if name in vars(t):
                return ValueError(
                    f"{where}: forward read `{name}`, an attribute set on the {kind} `{path}`, "
                    "from a tensor that does not carry it (expected the tensors of the "
                    "ensemble's own calls: Ensemble, fe.vmap and fe.value_and_grad hand "
                    "forward tensors carrying the members' attributes, while fmodel "
                    "called on other tensors, such as one member's slice, gets them as "
                    f"they are). Set `{name}` on those tensors, or keep the value on the "
                    f"module instead (self.{name} = ...)."
                )
    return None
