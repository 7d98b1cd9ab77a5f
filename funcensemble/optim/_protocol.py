"""Optimizers as pure ``(init, update)`` pairs over pytrees, and how they compose.

The pytree plumbing shared by every transform lives here too: trees are flattened
with ``none_is_leaf=True`` so a ``None`` (an unused parameter's gradient, a skipped
leaf's state) keeps its slot and nothing downstream misaligns.
"""

import functools
import re
from collections.abc import Callable, Iterator, Mapping, MappingView
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from .. import _torch_compat
from .._messages import a, expected_got
from .._torch_compat import is_wrapped, set_grad_enabled_fast
from .._tree import check_same_structure, flatten
from .._types import StackedTree
from . import _aliasing
from ._recipes import rebuildable

# Any optree pytree (dict, list, tuple, NamedTuple, ...) whose leaves are tensors or None.
# `optree.typing.PyTree[Tensor]` would be the precise hint, but its forward references
# cannot be resolved by beartype at run time.
PyTree = Any


class GradientTransformation(NamedTuple):
    """An optimizer: two pure functions over pytrees, and their in-place form.

    ``init(params) -> state`` builds the state; ``update(grads, state, params) ->
    (updates, new_state)`` turns gradients into parameter updates. Neither mutates
    its inputs. Apply the updates with [`apply_updates`][funcensemble.optim.apply_updates],
    or do both at once, in place, with
    [`update_`][funcensemble.optim.GradientTransformation.update_].

    ``update_inplace(updates, state, params) -> (updates, state)`` is the in-place
    form of ``update``: the same arithmetic, but the new state is written into
    ``state``'s own tensors. It never writes the ``updates`` it is given (they may be
    the caller's gradients), nor ``params``, except ``fe.optim.adam``'s own: that one
    adds its step to ``params`` with ``torch.optim.Adam``'s fused kernel and returns
    None for the updates, so a chain runs it only last. Leave it None and the
    in-place form is derived from ``update``; [`chain`][funcensemble.optim.chain]
    runs its last transform's in-place form after the others' ``update``. Call
    ``update_``, not this field.

    Example:
        >>> import torch, funcensemble as fe
        >>> opt = fe.optim.adam(lr=0.1)
        >>> params = {"w": torch.ones(4, 3)}  # 4 members
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(4, 3)}, state, params)
        >>> params = fe.optim.apply_updates(params, updates)
        >>> torch.allclose(params["w"], torch.full((4, 3), 0.9))
        True
    """

    init: Callable[[PyTree], Any]
    update: Callable[..., tuple[PyTree, Any]]
    update_inplace: Callable[[PyTree, Any, PyTree], tuple[PyTree, Any]] | None = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a transform (such as fe.optim.adam(...)) cannot be pickled (expected "
            "tensors or an optimizer's state, got the transform: it is made of the "
            "functions its call built, which pickle cannot carry). Build it again in "
            "the other process from the same arguments (lr, betas, ...); its state "
            "pickles, as fe.save and torch.save of an optimizer's state_dict() do."
        )

    def __copy__(self) -> "GradientTransformation":
        return self  # (its functions hold no state of their own: nothing to copy)

    def __deepcopy__(self, memo: dict[int, Any]) -> "GradientTransformation":
        return self

    def update_(self, grads: StackedTree, state: Any, params: StackedTree) -> Any:
        """Step ``params`` in place; return the new state.

        Computes the step of ``updates, state = update(grads, state, params)``
        followed by ``params = apply_updates(params, updates)``, but writes the result
        into the ``params`` tensors (under ``torch.no_grad()``, so they may be
        ``nn.Parameter``s) and into the state's tensors, instead of allocating new
        ones. Each transform runs its in-place form: the same operations as its
        ``update``, so the two agree exactly; ``fe.optim.adam``'s own step runs
        torch's fused kernel or orders its last operations as torch.optim does for
        tensor hyperparameters, so it agrees with ``update`` up to float rounding
        (see [`adam`][funcensemble.optim.adam]); ``fe.optim.sgd``, and
        ``fe.optim.rmsprop`` with momentum, step as torch.optim does, where their
        ``update`` may differ by a rounding (see [`sgd`][funcensemble.optim.sgd] and
        [`rmsprop`][funcensemble.optim.rmsprop]).

        The returned state holds the same tensors as ``state`` wherever their shapes
        allow; keep a copy (``optree.tree_map(torch.clone, state)``) if you need the
        old values. A transform checks everything before it writes anything, and
        ``update_`` checks ``grads`` against ``params`` first: a call that raises
        leaves ``params`` and ``state`` as they were, in a
        [`chain`][funcensemble.optim.chain] too. Parameters and gradients sharing
        memory are refused: one tensor under two names (it would be stepped twice),
        views of one tensor (``base[:, 1:]`` and ``base[:, :4]``: the step would read
        what it has already written, where the loop's step of each member's slice
        refuses it), gradients that are the parameters. So are parameters torch
        cannot write in place (an expanded view, an inference tensor). The state is
        not compared with them: pass the one ``init`` or the previous step returned.

        Args:
            grads: Gradients shaped like ``params``; None for a leaf without one.
            state: The state from ``init`` or the previous step.
            params: The parameters to update in place.

        Returns:
            The new state.

        Raises:
            ValueError: ``grads`` or ``state`` do not match ``params``, with the
                messages of ``update``.
            RuntimeError: A gradient is sparse (or of another layout than dense);
                ``update`` refuses it too.

        Example:
            >>> import torch, funcensemble as fe
            >>> opt = fe.optim.adam(lr=0.1)
            >>> params = {"w": torch.ones(4, 3)}
            >>> state = opt.init(params)
            >>> state = opt.update_({"w": torch.ones(4, 3)}, state, params)
            >>> torch.allclose(params["w"], torch.full((4, 3), 0.9)), state[0].count["w"]
            (True, tensor(1.))
        """
        return step_in_place(self, grads, state, params)


def step_in_place(
    transform: GradientTransformation,
    grads: PyTree,
    state: Any,
    params: PyTree,
    *,
    where: str = "update_",
    grads_root: str | None = "grads",
    check: bool = True,
) -> Any:
    """``transform.update_(grads, state, params)``, named ``where`` in its refusals.

    ``grads_root`` names the gradients (None: ``params['w'].grad``, as
    ``EnsembleOptimizer.step`` reads them). ``check=False`` skips the shared-memory
    check, for a part of a tree whose whole has been checked (a partition's labels, a
    HeteroEnsemble's groups).
    """
    if check and not torch.compiler.is_compiling():
        check_writable_apart(where, grads, params, grads_root)
    # torch.no_grad() as a context manager costs as much as a small kernel here.
    grad_was_enabled = torch.is_grad_enabled()
    set_grad_enabled_fast(False)
    try:
        applies = traits(transform).applies
        if not applies:
            # The gradients against the parameters before any state is written: a
            # transform that never reads the parameters (a learning rate) would
            # step its count and leave the refusal to the add below.
            _checked_updates("update_", params, grads, ("grads", "the gradient"))
        updates, state = inplace_form(transform)(grads, state, params)
        if not applies:
            add_updates_("update_", params, updates)
    finally:
        set_grad_enabled_fast(grad_was_enabled)
    return state


def check_writable_apart(
    where: str, grads: PyTree, params: PyTree, grads_root: str | None = "grads"
) -> None:
    """Refuse, before anything is written, an in-place step the loop would not compute:
    a parameter torch cannot write in place (an expanded view, an inference tensor),
    or parameters stepped and gradients sharing memory (one tensor under two names,
    views of one tensor, gradients that are the parameters). The step would read
    values it has already changed, or fail halfway with torch's error; the loop over
    members refuses them, or never meets them (its parameters and their ``.grad`` are
    tensors of their own). The state is not compared, on every step (about 5 us
    more): pass the one ``init`` or the previous step returned. Tensors inside a
    ``torch.func`` transform, and others whose memory Python cannot read (a DTensor),
    are not compared.
    """
    p_leaves, spec = flatten(params)
    try:
        g_leaves = spec.flatten_up_to(grads)
    except (ValueError, TypeError):  # the transform's own check says how they differ
        return
    stepped, written, read = [], [], []
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
        if isinstance(g, Tensor) and isinstance(p, Tensor):
            if (p.is_inference() or not p.is_contiguous()) and not is_wrapped(p):
                problem = _aliasing.unwritable(p)
                if problem is not None:
                    raise ValueError(
                        f"{where}: {leaf_name(spec, i)} is {problem[0]}, which cannot be "
                        f"stepped in place (expected a tensor that owns its elements, got "
                        f"{problem[0]}). Make the parameter writable: {problem[1]}."
                    )
            stepped.append(i)
            written.append(p)
            read.append(g)
    clash = _aliasing.first_clash(written, read)
    if clash is None:
        return
    w, r = clash
    param = leaf_name(spec, stepped[w])
    if r >= 0:
        i = stepped[r]
        grad = leaf_name(spec, i, grads_root) if grads_root else f"{leaf_name(spec, i)}.grad"
        raise ValueError(
            f"{where}: {grad} shares memory with {param} (expected gradients in tensors of "
            "their own, got views of the parameters' memory), so the step would read "
            "values it has already written. Pass gradients that own their memory (e.g. a "
            ".clone() of each)."
        )
    first, second = sorted((stepped[w], stepped[-1 - r]))
    one, other = leaf_name(spec, first), leaf_name(spec, second)
    if _aliasing.one_view(written[w], written[-1 - r]):
        raise ValueError(
            f"{where}: {one} and {other} are one tensor under two names (expected each "
            "parameter once, got it twice), which would be stepped twice. Drop the second "
            "name (the loop steps a tied weight once)."
        )
    raise ValueError(
        f"{where}: {one} shares memory with {other} (expected parameters in memory of "
        "their own, got overlapping views of one tensor), so stepping one would change "
        "what the other's step reads. Pass each as a tensor of its own (e.g. a .clone())."
    )


class Traits(NamedTuple):
    """What ``chain`` and ``update_`` need to know of a transform beyond its fields.

    ``applies``: its in-place form adds its step to the parameters itself (the fused
    Adam kernel), so it may run only last. ``fold(next)``: the one exact transform
    doing this one and ``next`` together, or None; a chain asks pair by pair (Adam
    folds the learning rate into its bias correction, as torch.optim does).
    ``learning_rate``: ``(where, value or schedule)`` of a ``scale_by_learning_rate``
    (``where`` names it in error messages).
    """

    applies: bool = False
    fold: Callable[[Any], Any] | None = None
    learning_rate: Any = None


# Kept on the transform's `update` function itself: a GradientTransformation is a plain
# NamedTuple of three functions (users build and unpack it), so what the library knows
# about its own transforms lives beside them, not in extra fields. With the function's
# identity: a wrapper made with functools.wraps copies the attribute, not the traits.
# (Not a WeakKeyDictionary: torch.compile guards on such a dict's keys by position,
# and a transform collected between tracing and guarding broke the guard.)
_ATTRIBUTE = "_funcensemble_traits"
_NONE = Traits()


def with_traits(t: GradientTransformation, **kw: Any) -> GradientTransformation:
    """``t``, with ``Traits(**kw)`` recorded for it."""
    setattr(t.update, _ATTRIBUTE, (id(t.update), Traits(**kw)))
    return t


def traits(t: GradientTransformation) -> Traits:
    """What is recorded for ``t`` (nothing, for a transform of the user's own)."""
    found = getattr(t.update, _ATTRIBUTE, None)
    if isinstance(found, tuple) and found[0] == id(t.update):
        return found[1]
    return _NONE


def derived_inplace(update: Callable[..., tuple[PyTree, Any]]) -> Callable[..., tuple[PyTree, Any]]:
    """The in-place form of a transform without one: ``update``, then its new state
    copied into the old state's tensors (where shapes allow)."""

    def update_inplace(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        new_updates, new_state = update(updates, state, params)
        return new_updates, refill(state, new_state)

    return update_inplace


def inplace_form(t: GradientTransformation) -> Callable[..., tuple[PyTree, Any]]:
    """``t``'s in-place form: its own, or the one derived from its ``update``."""
    return t.update_inplace if t.update_inplace is not None else derived_inplace(t.update)


class EmptyState(NamedTuple):
    """The state of a transform that keeps none.

    Example:
        >>> import torch, funcensemble as fe
        >>> fe.optim.add_decayed_weights(0.1).init({"w": torch.zeros(2, 3)})
        EmptyState()
    """


# The checks below take whole lists of leaves, not one leaf per call: a transform calls
# them on every step, and one call per leaf would cost as much as the kernels for small
# models (more still under the test run's runtime type checker).


def trainable(leaves: list[Any]) -> list[int]:
    """The indices of the leaves a transform updates: floating-point tensors."""
    out = []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor):
            if isinstance(leaf, torch.nn.Module | Iterator | MappingView):
                _not_a_tree(leaf)
            continue
        if leaf.is_complex():
            raise TypeError(
                "funcensemble.optim: complex parameters are not supported; store them as real "
                "tensors (torch.view_as_real) in the parameter tree."
            )
        if leaf.is_floating_point():
            out.append(i)
    return out


def refuse_integer_updates(
    where: str, what: str, spec: optree.PyTreeSpec, ups: list[Any], params: list[Any] | None
) -> None:
    """Refuse an integer or bool update of a floating-point parameter (of any, without
    ``params``): ``trainable`` would skip it as no update, the parameter not stepped."""
    for i, u in enumerate(ups):
        if not isinstance(u, Tensor) or u.is_floating_point() or u.is_complex():
            continue
        if params is not None and not (
            isinstance(params[i], Tensor) and params[i].is_floating_point()
        ):
            continue
        raise ValueError(
            f"{where}: {what} for {leaf_name(spec, i)} has dtype {u.dtype} (expected a "
            f"floating-point tensor, as its parameter's, got {u.dtype}): it would be taken "
            "for no update, and the parameter would not step. Pass it in the parameter's "
            "dtype."
        )


def _not_a_tree(leaf: Any) -> None:
    kind = (
        "module"
        if isinstance(leaf, torch.nn.Module)
        else "view of a dict"
        if isinstance(leaf, MappingView)
        else "iterator"
    )
    raise TypeError(
        f"funcensemble.optim: got {a(type(leaf).__name__)} {kind} where the parameters "
        "should be (expected a pytree of stacked tensors, such as fe.stack's params, "
        f"got {type(leaf).__name__}): a transform would see it as one leaf without "
        "state. Pass ens.stacked_params() (the live stacked tensors, for "
        "update_), or step an Ensemble with fe.optim.EnsembleOptimizer(ens, transform)."
    )


def leaves_like(where: str, what: str, spec: optree.PyTreeSpec, tree: PyTree) -> list[Any]:
    """``tree``'s leaves aligned with ``spec``'s, or a clear error if the shapes differ."""
    return check_same_structure(
        where,
        what,
        spec,
        tree,
        "Pass a pytree shaped like the params (None for a leaf without a gradient).",
        reference="the structure of the parameters",
    )


def check_state_type(where: str, state: Any, state_type: type) -> None:
    """Refuse a state that is not a ``state_type``, the type of the transform's own state."""
    if not isinstance(state, state_type):
        wanted = f"{a(state_type.__name__)} from its init"
        raise TypeError(
            f"{where}: the state is not this transform's "
            f"{expected_got(wanted, type(state).__name__)}. Pass the state that this "
            "transform's init returned."
        )


class StateLeaves(NamedTuple):
    """A per-leaf optimizer state and the updates, flattened and checked against each other."""

    spec: optree.PyTreeSpec
    counts: list[Any]  # the state's first field: None for a leaf without state
    grads: list[Any]
    fields: dict[str, list[Any]]  # the other fields asked for, leaf by leaf
    active: list[int]  # leaves with an update and a state: the ones a step updates


def state_leaves(
    where: str, state: Any, state_type: type, updates: PyTree, fields: tuple[str, ...]
) -> StateLeaves:
    """The preamble of a per-leaf transform's ``update`` (SGD, RMSprop, Adam's moments).

    Checks that ``state`` is ``state_type`` (from the transform's init), that the updates
    and the state's ``fields`` have the structure of its first field (one entry per
    parameter leaf), and that every update is a tensor or None; before anything changes.
    """
    check_state_type(where, state, state_type)
    counts, spec = flatten(state[0])
    grads = leaves_like(where, "updates", spec, updates)
    check_tensors(where, "the update", spec, grads)
    per_field = {f: leaves_like(where, f"state.{f}", spec, getattr(state, f)) for f in fields}
    active = [
        i
        for i, (g, c) in enumerate(zip(grads, counts, strict=True))
        if g is not None and c is not None
    ]
    return StateLeaves(spec, counts, grads, per_field, active)


def leaf_name(spec: optree.PyTreeSpec, index: int, root: str = "params") -> str:
    """A readable name for leaf ``index``, e.g. ``params['net.0.weight']``."""
    return optree.treespec_accessors(spec)[index].codify(root)


# A HeteroEnsemble's stacked names: `groups.<g>.stacked.<name>`, one member axis per group;
# a group is named with the path to it (`a.groups.0` and `b.groups.0`: two ensembles').
_HETERO_GROUP = re.compile(r"^(.*?groups\.\d+)\.stacked\.")


_ONE_GROUP_AT_A_TIME = (
    "Build the optimizer with hens.optimizer(...) or EnsembleOptimizer(hens, ...), which "
    "run it on each group's own members."
)


def _dotted(accessor: Any) -> str:
    """A leaf's path as one dotted name: ``{"a": {"b.c": t}}`` -> ``a.b.c``."""
    return ".".join(str(entry.entry) for entry in accessor)


@functools.lru_cache(maxsize=64)
def _hetero_groups(spec: optree.PyTreeSpec) -> tuple[str | None, ...] | None:
    """Each leaf's HeteroEnsemble group (by its path), or None when no leaf has one."""
    found = tuple(
        None if (m := _HETERO_GROUP.match(_dotted(a))) is None else m.group(1)
        for a in optree.treespec_accessors(spec)
    )
    return found if any(g is not None for g in found) else None


def check_one_member_axis(
    where: str,
    what: str,
    spec: optree.PyTreeSpec,
    indices: list[int],
    advice: str = _ONE_GROUP_AT_A_TIME,
    root: str = "params",
) -> None:
    """Refuse leaves of several HeteroEnsemble groups where ``what`` pairs their members.

    Each group's leaves stack that group's own members: index k of group 0 and index k
    of group 1 are different members, so a per-member computation across the groups
    (one norm, one per-member value) would combine unrelated members, silently where
    the groups have the same size. Run once per call, from the leaves' paths.
    """
    if torch.compiler.is_compiling():
        return  # checked eagerly by init, which runs before any compiled step
    groups = _hetero_groups(spec)
    if groups is None:
        return
    seen: dict[str, int] = {}
    for i in indices:
        found = groups[i]
        if found is not None:
            seen.setdefault(found, i)
            if len(seen) > 1:
                first, other = (leaf_name(spec, k, root) for k in seen.values())
                raise ValueError(
                    f"{where}: {first} and {other} belong to different groups of a "
                    "HeteroEnsemble, whose member axes hold different members, so "
                    f"{what} would combine unrelated members (expected the leaves of one "
                    f"member axis). {advice}"
                )


def check_tensors(where: str, what: str, spec: optree.PyTreeSpec, xs: list[Any]) -> None:
    """Check that every leaf is a dense tensor or None."""
    for index, x in enumerate(xs):
        if x is None:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(
                f"{where}: {what} for {leaf_name(spec, index)} is not a tensor (expected a "
                f"tensor or None, got {type(x).__name__}). Pass one tensor per parameter, "
                "or None for no gradient."
            )
        if x.layout is not torch.strided:
            # torch's kernels would refuse it midway, after earlier leaves had stepped.
            raise RuntimeError(
                f"{where}: {what} for {leaf_name(spec, index)} is not a dense tensor "
                f"(expected layout torch.strided, got {x.layout}); fe.optim steps dense "
                "gradients only. Convert it with .to_dense(), or train a parameter with "
                "sparse gradients by torch.optim on a plain module (torch.optim.SparseAdam, "
                "or SGD)."
            )


def missing_state(where: str, leaf: str) -> str:
    """The refusal of a state made by a transform that keeps less state than this one."""
    return (
        f"{where}: the state holds no buffer for {leaf} that this transform needs "
        "(expected the state of a transform with the same options; this one was made "
        "without momentum, centered or amsgrad, and a transform with it now steps it). "
        "torch.optim cannot switch those on mid-training either (it creates a "
        "parameter's buffers at its first step); keep the options, or start a new "
        "state with init (EnsembleOptimizer: a new optimizer)."
    )


_MOVED = (
    "build the optimizer (or init the state) after the change; to keep its moments, "
    "load the old state into it: new = fe.optim.EnsembleOptimizer(ens, transform); "
    "new.load_state_dict(opt.state_dict()) converts them"
)


def check_like(
    where: str,
    what: str,
    spec: optree.PyTreeSpec,
    indices: list[int],
    xs: list[Any],
    refs: list[Any],
    state: str | None = None,
) -> None:
    """Check that ``xs[i]`` can stand in for ``refs[i]`` (same shape, dtype and device).

    ``state``: the name of the state field ``refs`` are (e.g. ``"state.mu"``), whose
    mismatch with the gradients is told as such; ``None``: ``refs`` are parameters.
    """
    for index in indices:
        x, ref = xs[index], refs[index]
        if ref is None or (x is None and what.startswith("state.")):
            raise ValueError(missing_state(where, leaf_name(spec, index)))
        if not isinstance(x, Tensor):
            raise TypeError(
                f"{where}: {what} for {leaf_name(spec, index)} is not a tensor (expected a "
                f"tensor or None, got {type(x).__name__}). Pass one tensor per parameter, "
                "or None for no gradient."
            )
        if (x.shape != ref.shape or x.dtype != ref.dtype or x.device != ref.device) and state:
            raise ValueError(
                f"{where}: {what} for {leaf_name(spec, index)} has shape {tuple(x.shape)}, "
                f"dtype {x.dtype}, device {x.device}, but {state} holds shape "
                f"{tuple(ref.shape)}, dtype {ref.dtype}, device {ref.device} (expected them "
                "alike). If the parameters changed dtype or device since the state was made "
                f"(ens.double(), .to(...)), {_MOVED}; otherwise pass gradients shaped like "
                "the parameters."
            )
        if x.shape != ref.shape or x.dtype != ref.dtype or x.device != ref.device:
            advice = (
                "If the parameters changed dtype or device since the state was made "
                f"(ens.double(), .to(...)), {_MOVED}."
                if what.startswith("state.")
                else "Give it the parameter's shape, dtype and device."
            )
            raise ValueError(
                f"{where}: {what} for {leaf_name(spec, index)} has shape {tuple(x.shape)}, "
                f"dtype {x.dtype}, device {x.device} (expected shape {tuple(ref.shape)}, "
                f"dtype {ref.dtype}, device {ref.device}, like the parameter). {advice}"
            )


def scatter(base: list[Any], indices: list[int], values: list[Any] | tuple[Any, ...]) -> list:
    """A copy of ``base`` with ``values`` placed at ``indices``."""
    out = list(base)
    for i, v in zip(indices, values, strict=True):
        out[i] = v
    return out


def not_the_chains_state(state: Any, size: int) -> str:
    """The message for a state that is not a chain's tuple of ``size`` states."""
    if type(state) is tuple:
        got = f"a tuple of {len(state)}"
    elif isinstance(state, tuple):  # another transform's state (a NamedTuple)
        got = f"{type(state).__name__}, another transform's state"
    else:
        got = type(state).__name__
    swapped = (
        " A dict here is often the parameters: update and update_ take (grads, state, "
        "params), in that order."
        if isinstance(state, Mapping)
        else ""
    )
    return (
        f"chain: the state is not this chain's (expected the state returned by this "
        f"chain's init, a tuple of {size} states, got {got}; adam, adamw, sgd and rmsprop "
        "are chains too). Pass the state that init returned, or the one update returned "
        f"last.{swapped}"
    )


@rebuildable
def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Run transforms one after the other, each on the previous one's updates.

    The state is a tuple with one entry per transform. The chain's
    [`update_`][funcensemble.optim.GradientTransformation.update_] runs every transform
    but the last out of place, then the last one's in-place form, and then copies the
    others' new states into their tensors: it writes every state in place, agrees
    exactly with ``update`` followed by
    [`apply_updates`][funcensemble.optim.apply_updates], and a transform that raises
    leaves every state as it was. One exception:
    [`scale_by_adam`][funcensemble.optim.scale_by_adam] directly followed by
    [`scale_by_learning_rate`][funcensemble.optim.scale_by_learning_rate] fold into
    one step, [`adam`][funcensemble.optim.adam]'s, which computes torch.optim's
    arithmetic in both and runs its fused kernel in ``update_`` (equal up to
    rounding, as ``adam``'s own ``update`` and ``update_`` are). The chains
    [`sgd`][funcensemble.optim.sgd] and [`rmsprop`][funcensemble.optim.rmsprop] fold
    their direction and rate likewise into torch.optim's step.

    Example:
        >>> import torch, funcensemble as fe
        >>> opt = fe.optim.chain(fe.optim.add_decayed_weights(0.5),
        ...                      fe.optim.scale_by_learning_rate(0.1))
        >>> params = {"w": torch.ones(2, 3)}
        >>> updates, _ = opt.update({"w": torch.zeros(2, 3)}, opt.init(params), params)
        >>> torch.allclose(updates["w"], torch.full((2, 3), -0.05))
        True
    """
    for k, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: transform {k} is not a GradientTransformation (expected one such "
                f"as fe.optim.scale_by_adam(), got {type(t).__name__}). Build each with "
                "fe.optim."
            )

    def init(params: PyTree) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    # Steps: a transform alone (one state entry), or a pair folded into one exact
    # transform whose state is the pair's two entries.
    steps: list[tuple[GradientTransformation, int]] = []
    k = 0
    while k < len(transforms):
        fold = traits(transforms[k]).fold
        folded = fold(transforms[k + 1]) if fold is not None and k + 1 < len(transforms) else None
        steps.append((folded, 2) if folded is not None else (transforms[k], 1))
        k += 2 if folded is not None else 1
    # In place, the steps before the last run out of place, and their new states are
    # copied into the old ones only once the last step (in place: one that adds its
    # updates to the parameters may do so only last) has run: a step that refuses its
    # input (a schedule's value of the wrong length) leaves every state as it was.
    last = len(steps) - 1
    forms = [inplace_form(t) if j == last else t.update for j, (t, _) in enumerate(steps)]
    sizes = [size for _, size in steps]

    def check(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(not_the_chains_state(state, len(transforms)))

    def run(
        fns: list[Callable[..., tuple[PyTree, Any]]], updates: PyTree, state: Any, params: PyTree
    ) -> tuple[PyTree, tuple[Any, ...]]:
        check(state)
        new_state: list[Any] = []
        at = 0
        for fn, size in zip(fns, sizes, strict=True):
            if size == 1:
                updates, s = fn(updates, state[at], params)
                new_state.append(s)
            else:
                updates, s = fn(updates, state[at : at + size], params)
                new_state.extend(s)
            at += size
        return updates, tuple(new_state)

    def update(
        updates: PyTree, state: tuple[Any, ...], params: PyTree = None
    ) -> tuple[PyTree, tuple[Any, ...]]:
        return run([t.update for t, _ in steps], updates, state, params)

    def update_inplace(
        updates: PyTree, state: tuple[Any, ...], params: PyTree = None
    ) -> tuple[PyTree, tuple[Any, ...]]:
        updates, new_state = run(forms, updates, state, params)
        kept = len(state) - sizes[-1] if steps else 0  # the entries of the steps before last
        return updates, tuple(
            refill(old, new) if k < kept else new
            for k, (old, new) in enumerate(zip(state, new_state, strict=True))
        )

    if len(steps) == 1 and sizes[0] == len(transforms) > 1:
        # One folded step (adam): its own functions take the whole tuple and check it.
        update, update_inplace = steps[0][0].update, forms[0]  # type: ignore[assignment]
    out = GradientTransformation(init, update, update_inplace)
    return with_traits(out, applies=bool(steps) and traits(steps[-1][0]).applies)


def _checked_updates(
    where: str, params: PyTree, updates: PyTree, words: tuple[str, str] = ("updates", "the update")
) -> tuple[list[Any], optree.PyTreeSpec, list[Any], list[int]]:
    """Params' leaves and spec, the updates' leaves, and which leaves have an update.

    Every updated leaf must be a tensor shaped like its update; checked before anything
    is applied.
    """
    tree, leaf = words
    leaves, spec = flatten(params)
    ups = leaves_like(where, tree, spec, updates)
    active = [i for i, u in enumerate(ups) if u is not None]
    for i in active:
        if not isinstance(leaves[i], Tensor):
            raise TypeError(
                f"{where}: {leaf_name(spec, i)} is a {type(leaves[i]).__name__} but has an "
                "update; only tensor leaves can be updated."
            )
    check_like(where, leaf, spec, active, ups, leaves)
    return leaves, spec, ups, active


def add_updates_(where: str, params: PyTree, updates: PyTree) -> None:
    """``params += updates`` in place, leaf by leaf, after checking every leaf."""
    leaves, _, ups, active = _checked_updates(where, params, updates)
    if active:
        with torch.no_grad():
            torch._foreach_add_([leaves[i] for i in active], [ups[i] for i in active])


def refill(state: Any, new_state: Any) -> Any:
    """``new_state``, its values copied into ``state``'s tensors where shapes allow.

    So that a state's tensors stay the same objects from step to step (what
    ``EnsembleOptimizer.state_dict`` hands out stays live), like ``torch.optim``'s.
    """
    old, spec = flatten(state)
    new, new_spec = flatten(new_state)
    if spec != new_spec:
        return new_state
    out = []
    with torch.no_grad():
        for o, n in zip(old, new, strict=True):
            same = (
                isinstance(o, Tensor)
                and isinstance(n, Tensor)
                and (o.shape, o.dtype, o.device) == (n.shape, n.dtype, n.device)
            )
            if same and o is not n:
                o.copy_(n)
            out.append(o if same else n)
    return spec.unflatten(out)


def updates_to_(new: list[Tensor], params: list[Tensor]) -> list[Tensor]:
    """``new - params`` in place on ``new`` (returned): what ``apply_updates`` adds to
    ``params`` to give ``new``.

    Exact wherever the two are within a factor 2 of each other (Sterbenz), so the sum
    gives ``new`` back there. Where they are equal the update is 0, also for a parameter
    already infinite that the step leaves so (a diverged member): ``inf - inf`` would be
    NaN, and the sum NaN where torch.optim keeps the infinity. (A step flipping an
    infinite parameter's sign, AdamW with ``lr * weight_decay > 1``, has no such update.)
    """
    if not _may_be_infinite(params):
        torch._foreach_sub_(new, params)  # the usual case: one pass
        return new
    same = [n == p for n, p in zip(new, params, strict=True)]
    torch._foreach_sub_(new, params)
    for u, equal in zip(new, same, strict=True):
        u.masked_fill_(equal, 0.0)
    return new


def _may_be_infinite(params: list[Tensor]) -> bool:
    """Whether a leaf may hold an infinity: its 2-norm is not finite (one fast pass, read
    on the CPU: no device sync; a norm overflowing on large finite values only takes
    the masked difference, exact too); elsewhere, and while compiling, assumed."""
    if not params or torch.compiler.is_compiling() or params[0].device.type != "cpu":
        return bool(params)
    return not bool(torch.stack(torch._foreach_norm(params)).isfinite().all())


def apply_updates(params: StackedTree, updates: StackedTree) -> StackedTree:
    """Add updates to parameters, returning new tensors; the inputs are untouched.

    A leaf whose update is ``None`` (no gradient, or not floating point) is returned
    as it is, the same tensor. Updated leaves are fresh autograd leaves with their
    parameter's ``requires_grad``: no history links them to the old parameters.

    Args:
        params: A pytree of tensors, e.g. stacked ``[N, ...]`` parameters.
        updates: The updates from ``update``, shaped like ``params``.

    Returns:
        The new parameters, shaped like ``params``.

    Raises:
        ValueError: ``updates`` do not match ``params`` in structure or leaf shapes.
        RuntimeError: Under ``torch.compile``, a parameter with an update requires
            grad: a compiled graph cannot return new autograd leaves. Step in place
            with [`update_`][funcensemble.optim.GradientTransformation.update_] there.
            The same inside a ``torch.func`` transform (``grad``, ``vmap``), which
            cannot make new autograd leaves either; parameters that do not require
            grad are added there one leaf at a time (``vmap`` has no rule for the
            multi-tensor add).

    Example:
        >>> import torch, funcensemble as fe
        >>> params = {"w": torch.zeros(3, 2), "frozen": torch.ones(3)}
        >>> new = fe.optim.apply_updates(params, {"w": torch.ones(3, 2), "frozen": None})
        >>> new["w"].sum().item(), new["frozen"] is params["frozen"], params["w"].sum().item()
        (6.0, True, 0.0)
    """
    where = "apply_updates"
    leaves, spec, ups, active = _checked_updates(where, params, updates)
    if not active:
        return spec.unflatten(leaves)
    if torch.compiler.is_compiling() and any(leaves[i].requires_grad for i in active):
        # Dynamo refuses a graph output made an autograd leaf by requires_grad_() (it
        # would drop the flag); returning the new tensors without it would silently
        # turn trainable parameters into frozen ones.
        raise RuntimeError(
            f"{where}: cannot return new parameters that require grad under torch.compile "
            f"(got {leaf_name(spec, active[0])} with requires_grad=True; a compiled graph "
            "cannot make its outputs autograd leaves). Step in place inside the compiled "
            "function instead: state = opt.update_(grads, state, params)."
        )
    inside = _torch_compat.inside_transform()
    if inside and any(leaves[i].requires_grad for i in active):
        # torch refuses requires_grad_() there; returning the sums without it would turn
        # trainable parameters into frozen ones (as under compile, above).
        raise RuntimeError(
            f"{where}: cannot return new parameters that require grad inside a torch.func "
            f"transform (got {leaf_name(spec, active[0])} with requires_grad=True; "
            "torch.func.grad and vmap cannot make new autograd leaves). Add the updates "
            "there yourself (p + u for each leaf whose update is not None) to "
            "differentiate through the step, or call apply_updates outside the transform."
        )
    with torch.no_grad():
        if inside:  # one op per leaf: the multi-tensor add has no batching rule
            new = [leaves[i] + ups[i] for i in active]
        else:
            new = torch._foreach_add([leaves[i] for i in active], [ups[i] for i in active])
    for i, t in zip(active, new, strict=True):
        if leaves[i].requires_grad:
            t.requires_grad_(True)
    return spec.unflatten(scatter(leaves, active, new))
