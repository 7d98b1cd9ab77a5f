"""``EnsembleOptimizer``: a functional optimizer stepping an Ensemble in place, torch-style."""

import copy
from collections.abc import Callable, Mapping
from typing import Any, SupportsIndex

import optree
import torch
from torch import Tensor

from .._core.members import (
    Indices,
    check_indices,
    copy_leaves_,
    copy_mapping,
    num_members,
    take,
)
from .._core.tree_view import Stacked, adapted, state_view
from .._messages import a, expected_got, key_difference
from .._types import StackedTensor
from ._members import check_state_like, count_mask, count_sizes, grown, selected
from ._protocol import EmptyState, GradientTransformation, PyTree, flatten, step_in_place
from ._recipes import describe
from ._transforms import ScheduleState


def _state_keys(spec: optree.PyTreeSpec) -> list[str]:
    return [path.codify("state") for path in optree.treespec_accessors(spec)]


def _describe(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return a(type(value).__name__)


def _check_distinct(where: str, named: Mapping[str, Any]) -> None:
    """Refuse one tensor under two names: each step would update it twice, with two
    states (torch.optim warns of duplicate parameters, and steps them twice too)."""
    seen: dict[Any, str] = {}
    for name, p in named.items():
        if not isinstance(p, Tensor) or p.numel() == 0:
            continue
        key: Any = id(p)
        if type(p) in (Tensor, torch.nn.Parameter) and p.device.type != "meta":
            # Another tensor over the same memory (p.detach(), nn.Parameter(p)) too.
            ptr = p.untyped_storage().data_ptr()
            key = (p.device, ptr, p.storage_offset(), p.shape, p.stride())
        if key in seen:
            raise ValueError(
                f"{where}: `{seen[key]}` and `{name}` are the same tensor (expected each "
                "parameter once, got one under two names); every step would update it twice, "
                "with two states. Pass it under one name (as named_parameters() lists tied "
                "weights once)."
            )
        seen[key] = name


def _shown(described: object, other: object, limit: int = 600) -> str:
    """``described``, around where it first differs from ``other`` if it is long."""
    text, other = str(described), str(other)
    if len(text) <= limit:
        return text
    pairs = enumerate(zip(text, other, strict=False))
    first = next((i for i, (a, b) in pairs if a != b), min(len(text), len(other)))
    start = max(0, min(first - limit // 3, len(text) - limit))
    return ("..." if start else "") + text[start : start + limit] + "..."


def _carried(old: Any, new: Any) -> Any:
    """``old``, the state kept, in the structure of ``new``, a fresh state of the
    transform assigned: a learning rate's entry follows ``new`` (an ``EmptyState`` for a
    constant, a ``ScheduleState`` from 0 for a schedule); every other entry must be of
    the same kind and is kept. ``_MISMATCH`` where they are not."""
    if isinstance(new, (EmptyState, ScheduleState)) and isinstance(
        old, (EmptyState, ScheduleState)
    ):
        return old if type(old) is type(new) else new
    if type(old) is not type(new):
        return _MISMATCH
    if isinstance(new, (tuple, list)):
        if len(old) != len(new):
            return _MISMATCH
        kept = [_carried(o, n) for o, n in zip(old, new, strict=True)]
        if any(k is _MISMATCH for k in kept):
            return _MISMATCH
        return type(new)(*kept) if hasattr(new, "_fields") else type(new)(kept)
    if isinstance(new, dict):
        if old.keys() != new.keys():
            return _MISMATCH
        kept_dict = {k: _carried(old[k], new[k]) for k in new}
        if any(k is _MISMATCH for k in kept_dict.values()):
            return _MISMATCH
        return type(new)(kept_dict)
    return old  # a tensor or another leaf: the state's values


_MISMATCH = object()


def _kept_state(state: Any, transform: GradientTransformation, params: Any) -> Any:
    """The optimizer's state for ``transform`` assigned in place of its transform: the
    state kept, its learning rate's entry made ``transform``'s. A state that does not
    carry over (another optimizer, ``amsgrad`` switched) is kept as it is: the next
    ``step``'s checks refuse it, naming what differs.

    The new transform's state is first made on meta tensors (no memory, no time):
    only where a learning rate's entry changes kind is it made for real, for its
    step count."""
    probe = _probe(transform, params)
    if probe is not None:
        kept = _carried(state, probe)
        if kept is _MISMATCH or not _lr_changed(state, probe):
            return state
    with torch.no_grad():
        fresh = transform.init(params)
    kept = _carried(state, fresh)
    return state if kept is _MISMATCH else kept


def _state_fits(state: Any, transform: GradientTransformation, params: Any) -> bool:
    """Whether ``state`` carries over to ``transform`` (see ``_kept_state``); an init
    that cannot run on meta tensors is taken as fitting (its step checks)."""
    probe = _probe(transform, params)
    return probe is None or _carried(state, probe) is not _MISMATCH


def _probe(transform: GradientTransformation, params: Any) -> Any:
    """``transform``'s fresh state made on meta tensors (no memory, no time), or None
    for an init that reads values."""
    try:
        with torch.no_grad():
            return transform.init({k: v.to("meta") for k, v in params.items()})
    except Exception:
        return None


def _lr_changed(old: Any, new: Any) -> bool:
    """Whether a learning rate's entry of ``new`` is of another kind than ``old``'s."""
    if isinstance(new, (EmptyState, ScheduleState)):
        return type(old) is not type(new)
    if isinstance(new, (tuple, list)):
        return any(_lr_changed(o, n) for o, n in zip(old, new, strict=True))
    if isinstance(new, dict):
        return any(_lr_changed(old[k], new[k]) for k in new)
    return False


class EnsembleOptimizer:
    """Step stacked parameters in place, for a training loop that calls ``loss.backward()``.

    It behaves like a ``torch.optim.Optimizer`` over the ensemble's stacked ``[N, ...]``
    parameters: ``step()`` reads each parameter's ``.grad`` (skipping parameters whose
    ``.grad`` is None) and steps the parameters and the state in place with the
    transform's [`update_`][funcensemble.optim.GradientTransformation.update_]
    (``fe.optim.adam``'s runs ``torch.optim.Adam(fused=True)``'s kernel where it can).
    Its state is ``transform``'s state, in ``self.state``. Learning-rate schedules are
    given to the transform as a callable ``lr`` (such as
    [`warmup_cosine`][funcensemble.optim.warmup_cosine], per member if need be);
    ``torch.optim.lr_scheduler`` classes do not apply.

    Args:
        params: An [`Ensemble`][funcensemble.Ensemble] (its stacked parameters are
            stepped), a [`HeteroEnsemble`][funcensemble.HeteroEnsemble] (each group's,
            the transform run per group as by its
            [`optimizer`][funcensemble.HeteroEnsemble.optimizer]) or a mapping of names
            to parameter tensors (e.g. the ``params`` of [`stack`][funcensemble.stack]).
        transform: The optimizer, e.g. ``fe.optim.adam(lr=1e-3)``.

    Raises:
        TypeError: ``params`` or ``transform`` of the wrong type, or a parameter that
            is not a leaf tensor.
        ValueError: One tensor under two names (it would be stepped twice a step);
            tied weights are one parameter, as ``named_parameters()`` lists them.

    Example:
        >>> import torch, funcensemble as fe
        >>> ens = fe.Ensemble([torch.nn.Linear(3, 1) for _ in range(4)])
        >>> opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=0.1))
        >>> before = ens.stacked.bias.detach().clone()
        >>> opt.zero_grad()
        >>> ens(torch.randn(8, 3)).sum().backward()  # the members' losses add up
        >>> opt.step()
        >>> torch.allclose((ens.stacked.bias - before).abs(), torch.full((4, 1), 0.1))
        True
    """

    def __init__(
        self,
        params: Stacked | Mapping[str, StackedTensor],
        transform: GradientTransformation,
    ) -> None:
        where = "EnsembleOptimizer"
        view = state_view(params)  # an Ensemble stands for its stacked parameters
        if view is not None:
            named = dict(view["params"])
        elif isinstance(params, Mapping):
            named = dict(params)
            for name, p in named.items():
                if not isinstance(p, Tensor) or not p.is_leaf:
                    raise TypeError(
                        f"{where}: parameter `{name}` must be a leaf tensor (expected an "
                        f"nn.Parameter or a tensor from fe.stack, got "
                        f"{type(p).__name__ if not isinstance(p, Tensor) else 'a non-leaf tensor'}"
                        "). Pass the stacked parameters themselves, not a result computed from "
                        "them."
                    )
        else:
            raise TypeError(
                f"{where}: params is neither an Ensemble nor a mapping of names to stacked "
                f"parameters (expected an Ensemble or a dict of tensors with a leading member "
                f"axis, got {type(params).__name__}). Pass the Ensemble itself, or "
                "a dict of stacked parameters (e.g. the one fe.stack returns)."
            )
        if not isinstance(transform, GradientTransformation):
            raise TypeError(
                f"{where}: transform is not a GradientTransformation (expected one such as "
                f"fe.optim.adam(), got {type(transform).__name__}). Build one with fe.optim, "
                "e.g. fe.optim.adam(1e-3)."
            )
        _check_distinct(where, named)
        self._over = params  # what a transform assigned later is adapted to, too
        self.params: dict[str, Tensor] = named
        self.transform = transform
        with torch.no_grad():
            self.state: Any = self.transform.init(named)

    @property
    def transform(self) -> GradientTransformation:
        """The transform each ``step`` runs. Assign another to change hyperparameters
        between steps (the state is kept; a constant ``lr`` may become a schedule, whose
        step count starts at 0 then, as a ``torch.optim.lr_scheduler`` made mid-run
        starts, or a schedule a constant; a schedule assigned in place of another keeps
        its count); another optimizer, or one that keeps other
        state (``amsgrad``), is refused by the next ``step``: build a new optimizer
        for it. Over a
        [`HeteroEnsemble`][funcensemble.HeteroEnsemble] it runs group by group, as
        the one given when the optimizer was built."""
        return self._transform

    @transform.setter
    def transform(self, transform: GradientTransformation) -> None:
        if not isinstance(transform, GradientTransformation):
            raise TypeError(
                f"EnsembleOptimizer: transform is not a GradientTransformation (expected one "
                f"such as fe.optim.adam(), got {type(transform).__name__}). Build one with "
                "fe.optim, e.g. fe.optim.adam(1e-3)."
            )
        # A HeteroEnsemble runs the transform group by group (see HeteroEnsemble.optimizer).
        adapted_ = adapted(self._over, transform)
        described = describe(transform)
        if adapted_ is not transform and hasattr(self, "_transform"):
            from .._hetero.routing import check_assigned  # (hetero imports this module)

            check_assigned(adapted_, self.params)  # what its init checks (the state is kept)
        if hasattr(self, "state"):
            self.state = _kept_state(self.state, adapted_, self.params)
        self._transform = adapted_
        self._described = described  # what state_dict() records of it

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Not a ``torch.optim`` optimizer's: tools that read its groups (such as
        ``torch.amp.GradScaler``) raise this clear ``AttributeError``."""
        raise AttributeError(
            "EnsembleOptimizer has no param_groups (expected by tools that drive a "
            "torch.optim optimizer, such as torch.amp.GradScaler). Its hyperparameters "
            "belong to its transform: pass a schedule as the transform's lr (e.g. "
            "fe.optim.warmup_cosine), and scale the loss yourself, or train with a "
            "torch.optim optimizer over ens.parameters() for GradScaler."
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "EnsembleOptimizer cannot be pickled (expected its state, got the optimizer: "
            "its transform is made of Python functions, as Optax's are). Save its state "
            "with fe.save(path, opt) or torch.save(opt.state_dict(), path), and load it "
            "into an EnsembleOptimizer built with the same transform (fe.load, or "
            "load_state_dict); copy.deepcopy((ens, opt)) copies both."
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> "EnsembleOptimizer":
        new = object.__new__(type(self))
        memo[id(self)] = new
        for key, value in vars(self).items():
            vars(new)[key] = copy.deepcopy(value, memo)  # (functions are kept as they are)
        return new

    def __copy__(self) -> "EnsembleOptimizer":
        new = object.__new__(type(self))
        vars(new).update(vars(self))
        return new

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every parameter's ``.grad``: to None, or to zeros if ``set_to_none=False``."""
        for p in self.params.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the parameters in place from their ``.grad``.

        Args:
            closure: Optional; re-evaluates the loss (with gradients) and returns it.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads: PyTree = {}
        for name, p in self.params.items():
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError(
                    f"EnsembleOptimizer.step: `{name}` has a sparse gradient, which is not "
                    "supported; use dense gradients (e.g. nn.Embedding(sparse=False))."
                )
            grads[name] = p.grad
        try:
            self.state = step_in_place(
                self.transform,
                grads,
                self.state,
                self.params,
                where="EnsembleOptimizer.step",
                grads_root=None,
            )
        except (TypeError, ValueError) as error:
            if isinstance(error, ValueError) and "the state is not this chain's" in str(error):
                raise ValueError(
                    "EnsembleOptimizer.step: the transform assigned since this optimizer's "
                    "state was made is a chain of another length (expected a transform "
                    "whose state is this optimizer's, got one that needs "
                    f"another: {error}). Nothing was changed. Build a new "
                    "EnsembleOptimizer with it (its state starts afresh); to keep the "
                    "moments when you put a stateless transform in front "
                    "(chain(clip_by_global_norm(c), adam(lr))), assign "
                    "opt.state = (fe.optim.EmptyState(), opt.state) with it."
                ) from error
            if "the state is not this transform's" not in str(error):
                raise
            told = str(error).replace(" Pass the state that this transform's init returned.", "")
            raise TypeError(
                f"EnsembleOptimizer.step: {told} This optimizer's state was made by the "
                "transform it was built with (or assigned before): the transform "
                "assigned since keeps another kind of state (another optimizer, or "
                "momentum or amsgrad switched on together with a schedule). Build a new "
                "EnsembleOptimizer with it (its state starts afresh), or assign a "
                "schedule on its own, then the other change."
            ) from error
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state as ``{"state": {path: tensor or None}, "transform": str}``.

        ``"transform"`` records the transform with its hyperparameters, as the call
        that built it (``"adam(lr=0.01, betas=(0.9, 0.999), ...)"``; per-member
        tensors of more than 8 values by a digest): the state holds no hyperparameters,
        so [`load_state_dict`][funcensemble.optim.EnsembleOptimizer.load_state_dict]
        compares it with the loading optimizer's. Plain dicts, strings and tensors
        only, so ``torch.save`` and ``torch.load(..., weights_only=True)`` take it. As
        with ``torch.optim``, the tensors are the live state's, not copies: ``step()``
        updates them in place, so clone them to keep a snapshot of this step's values.
        """
        leaves, spec = flatten(self.state)
        state = dict(zip(_state_keys(spec), leaves, strict=True))
        return {"state": state, "transform": self._described}

    def _refuse_another_transform(self, where: str, saved: Any) -> None:
        """Refuse a state saved with another transform record (``None``: no record)."""
        if saved is not None and saved != self._described:
            raise ValueError(
                f"{where}: the state was saved by an optimizer whose transform was\n  "
                f"{_shown(saved, self._described)}\nand this one's is\n  "
                f"{_shown(self._described, saved)}\n"
                "(expected the same transform and hyperparameters, got others): "
                "torch.optim's load_state_dict would put the saved hyperparameters back, "
                "while this state holds none and would continue with these. Build the "
                "optimizer with the saved transform and load; to change hyperparameters "
                "on purpose, assign the new one afterwards (opt.transform = ..., as "
                "torch.optim users set param_groups after loading), or drop the record "
                "(state_dict.pop('transform'))."
            )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state saved by [`state_dict`][funcensemble.optim.EnsembleOptimizer.state_dict].

        Everything is checked before anything changes; tensors are copied to the current
        state's device and dtype. Step counts load whether they are shared by the
        members or one per member (after [`concat`][funcensemble.optim.EnsembleOptimizer.concat]):
        a fresh optimizer resumes from a state saved after members joined.

        The transform and hyperparameters recorded with the state must be this
        optimizer's: ``torch.optim`` restores the saved hyperparameters on load, while
        this state holds none, so resuming with others is refused (a transform or
        schedule of your own is recorded by its kind only, and not compared). To
        change hyperparameters on purpose, load into the saved transform and then
        assign the new one (``opt.transform = ...``, as ``torch.optim`` users set
        ``param_groups`` after loading), or ``state_dict.pop("transform")`` first.

        Raises:
            ValueError: Another transform or other hyperparameters than the saved ones;
                keys, shapes or missing tensors that do not match this optimizer (a
                different transform or parameter set).
        """
        where = "EnsembleOptimizer.load_state_dict"
        if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
            wanted = "the dict returned by state_dict(), {'state': {...}}"
            raise TypeError(
                f"{where}: this is not an optimizer state "
                f"{expected_got(wanted, type(state_dict).__name__)}. Pass what "
                "EnsembleOptimizer.state_dict() returned."
            )
        loaded = state_dict["state"]
        if "param_groups" in state_dict or any(isinstance(k, int) for k in loaded):
            raise TypeError(
                f"{where}: this is a torch.optim optimizer's state_dict (it has "
                "'param_groups' or integer parameter ids), which does not map onto stacked "
                "parameters (expected what EnsembleOptimizer.state_dict() returned). "
                "Stack the members' optimizer states yourself, or start the ensemble's "
                "optimizer fresh."
            )
        self._refuse_another_transform(where, state_dict.get("transform"))
        leaves, spec = flatten(self.state)
        keys = _state_keys(spec)
        difference = key_difference(set(keys) - set(loaded), set(loaded) - set(keys))
        if difference:
            raise ValueError(
                f"{where}: the state does not match this optimizer: it {difference}. It was "
                "saved from a different transform or set of parameters."
            )
        n_all = self._num_members() if self.params else None
        counts = count_mask(self.state)
        # Each count's member count is its own state's (a HeteroEnsemble's groups differ).
        sizes = count_sizes(self.state)
        new = []
        for key, size, mine, is_count in zip(keys, sizes, leaves, counts, strict=True):
            value = loaded[key]
            if (
                isinstance(value, Tensor)
                and value.is_meta
                and isinstance(mine, Tensor)
                and not mine.is_meta
            ):
                raise ValueError(
                    f"{where}: `{key}` is on the meta device, which holds no values "
                    f"(expected a tensor with values, got a meta tensor of shape "
                    f"{tuple(value.shape)}). Load a state saved from a trained optimizer "
                    "(state_dict() of one whose parameters hold values)."
                )
            if mine is None or value is None:
                if mine is not value:
                    raise ValueError(
                        f"{where}: `{key}` does not match this optimizer's state "
                        f"{expected_got(_describe(mine), _describe(value))}. It was saved "
                        "from a different transform or set of parameters."
                    )
                new.append(None)
                continue
            n = size if size >= 0 else n_all
            if (
                is_count
                and isinstance(value, Tensor)
                and value.shape != mine.shape
                and {tuple(value.shape), tuple(mine.shape)} == {(), (n,)}
            ):
                # Step counts shared by the members (0-dim) or one per member ([N],
                # after members joined): either loads into either.
                value = value.reshape(()).expand(n) if value.dim() == 0 else value
                new.append(value.detach().to(device=mine.device, dtype=mine.dtype, copy=True))
                continue
            if not isinstance(value, Tensor) or value.shape != mine.shape:
                raise ValueError(
                    f"{where}: `{key}` does not match this optimizer's state "
                    f"{expected_got(_describe(mine), _describe(value))}. It was saved with a "
                    "different member count or architecture."
                )
            new.append(value.detach().to(device=mine.device, dtype=mine.dtype, copy=True))
        self.state = spec.unflatten(new)

    def _num_members(self) -> int:
        for p in self.params.values():
            return p.shape[0]
        raise ValueError("EnsembleOptimizer: there are no parameters (no member axis).")

    def _transform_for(
        self, where: str, transform: GradientTransformation | None, follow: Callable[[], Any]
    ) -> GradientTransformation:
        if transform is None:
            return follow()
        if not isinstance(transform, GradientTransformation):
            raise TypeError(
                f"{where}: transform is not a GradientTransformation (expected one such as "
                f"fe.optim.adam(), got {type(transform).__name__}). Build one with fe.optim, "
                "or leave transform as None."
            )
        return transform

    def _refuse_hetero(self, where: str) -> None:
        """A HeteroEnsemble's optimizer: refused by the surgery methods whatever its
        number of groups (hetero.md), before its transform is looked at (the grouped
        transform hides the user's, whose values could not be found)."""
        from .._hetero.ensemble import HeteroEnsemble  # (hetero imports this module)

        if isinstance(self._over, HeteroEnsemble):
            raise ValueError(
                f"{where}: this optimizer steps a HeteroEnsemble, whose groups each have "
                "their own member axis and transform (expected an optimizer of an "
                "fe.Ensemble or of stacked tensors with one member axis). Rebuild "
                "instead: fe.HeteroEnsemble([hens.member(i) for i in indices]) and a new "
                "optimizer from its optimizer(...)."
            )

    def select(
        self,
        indices: Indices,
        params: Stacked | Mapping[str, Tensor],
        *,
        transform: GradientTransformation | None = None,
    ) -> "EnsembleOptimizer":
        """A new optimizer stepping ``params``, with the state of members ``indices``.

        The optimizer side of [`Ensemble.select`][funcensemble.Ensemble.select]:
        ``params`` is the new ensemble (``ens.select(indices)``) and must have
        ``len(indices)`` members. Each selected member keeps its moments, buffers and
        per-member hyperparameters (``lr`` etc. given as ``[N]`` tensors), as after
        ``load_state_dict`` of its own ``torch.optim`` state; see
        [`fe.optim.select`][funcensemble.optim.select]. This optimizer is unchanged
        and keeps stepping the old parameters: step the new one from now on.

        Args:
            indices: Member indices, as in ``Ensemble.select``.
            params: The parameters of the selected members (an Ensemble or mapping).
            transform: Only for a transform of your own (whose per-member values
                cannot be found): the transform for the selected members.

        Raises:
            TypeError: Bad ``indices``, or a transform of your own and no
                ``transform=``.
            ValueError: Empty ``indices``, or ``params`` that do not fit the selected
                state (another member count or architecture).
            IndexError: An index out of range.

        Example:
            >>> import torch, funcensemble as fe
            >>> ens = fe.Ensemble([torch.nn.Linear(3, 1) for _ in range(4)])
            >>> opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=torch.rand(4)))
            >>> best = ens.select([2, 3])
            >>> opt = opt.select([2, 3], best)
            >>> opt.state[0].mu["weight"].shape
            torch.Size([2, 1, 3])
        """
        where = "EnsembleOptimizer.select"
        self._refuse_hetero(where)
        num_members(where, "this optimizer's parameters", self.params)  # not a hetero layout
        n = self._num_members()
        idx = check_indices(where, indices, n)
        new_transform = self._transform_for(
            where, transform, lambda: selected(where, self.transform, idx, n)
        )
        state = take(self.state, idx)
        view = state_view(params)
        named = view["params"] if view is not None else params
        got = num_members(where, "params", dict(named)) if isinstance(named, Mapping) else None
        if got is not None and got != len(idx):
            raise ValueError(
                f"{where}: params has {got} members, but {len(idx)} are selected. Pass the "
                "parameters of the selected members (ens.select(indices))."
            )
        new = EnsembleOptimizer(params, new_transform)
        check_state_like(
            where,
            new.state,
            state,
            f"Pass the parameters of the {len(idx)} selected members (ens.select(indices)).",
        )
        new.state = state
        return new

    def concat(
        self,
        params: Stacked | Mapping[str, Tensor],
        *,
        transform: GradientTransformation | None = None,
    ) -> "EnsembleOptimizer":
        """A new optimizer stepping ``params``, grown by new members with fresh state.

        The optimizer side of [`Ensemble.concat`][funcensemble.Ensemble.concat]:
        ``params`` is the grown ensemble; its first N members keep this optimizer's
        state, the new ones get the state a fresh ``torch.optim`` optimizer starts
        with, step counts at 0 (once the old members have stepped, each member keeps
        its own count; see [`fe.optim.concat`][funcensemble.optim.concat]). This
        optimizer is unchanged.

        Args:
            params: The grown parameters (an Ensemble or mapping).
            transform: The transform for all members; by default this one, which
                fits if its hyperparameters are floats. With per-member ``[N]``
                values, pass one built with a value for every member.

        Raises:
            ValueError: ``params`` with no more members than this optimizer;
                per-member values not shaped like the grown members; a learning-rate
                schedule that has been called.

        Example:
            >>> import torch, funcensemble as fe
            >>> ens = fe.Ensemble([torch.nn.Linear(3, 1) for _ in range(2)])
            >>> opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=1e-3))
            >>> ens = ens.concat([torch.nn.Linear(3, 1)])
            >>> opt = opt.concat(ens)
            >>> opt.state[0].nu["bias"].shape
            torch.Size([3, 1])
        """
        where = "EnsembleOptimizer.concat"
        self._refuse_hetero(where)
        new_transform = self._transform_for(where, transform, lambda: self.transform)
        new = EnsembleOptimizer(params, new_transform)
        new.state = grown(where, self.state, new.state)
        return new

    def copy_members_(
        self,
        src: SupportsIndex | Indices,
        dst: SupportsIndex | Indices,
        *,
        transform: GradientTransformation | None = None,
    ) -> None:
        """Copy member ``src``'s optimizer state over member ``dst``'s, in place.

        The optimizer side of
        [`Ensemble.copy_members_`][funcensemble.Ensemble.copy_members_] (same ``src``
        and ``dst`` rules): member ``dst``'s moments and buffers become ``src``'s, and
        its per-member hyperparameters (``[N]`` tensors) take ``src``'s values, as
        after loading ``src``'s ``torch.optim`` state_dict into ``dst``'s optimizer.
        Step counts shared by all members are equal already; per-member ones are
        copied with the rest. The state tensors
        stay the same objects; ``self.transform`` is replaced by the rebuilt one.
        Everything is checked before anything is written.

        Args:
            src: Source member(s).
            dst: Destination member(s).
            transform: Only for a transform of your own: the transform to use after
                the copy.

        Example:
            >>> import torch, funcensemble as fe
            >>> ens = fe.Ensemble([torch.nn.Linear(3, 1) for _ in range(3)])
            >>> opt = fe.optim.EnsembleOptimizer(ens, fe.optim.sgd(lr=0.1, momentum=0.9))
            >>> ens(torch.randn(8, 3)).sum().backward(); opt.step()
            >>> ens.copy_members_(0, 2); opt.copy_members_(0, 2)
            >>> buf = opt.state[0].momentum_buffer["weight"]
            >>> torch.equal(buf[2], buf[0])
            True
        """
        where = "EnsembleOptimizer.copy_members_"
        self._refuse_hetero(where)
        num_members(where, "this optimizer's parameters", self.params)  # not a hetero layout
        n = self._num_members()
        mapping = copy_mapping(where, src, dst, n)
        new_transform = self._transform_for(
            where, transform, lambda: selected(where, self.transform, mapping, n)
        )
        if transform is not None and not _state_fits(self.state, new_transform, self.params):
            raise ValueError(
                f"{where}: the transform given keeps another state than this optimizer's "
                f"(expected the same optimizer, got {describe(transform)}): its next step "
                "could not run. Pass a transform of the optimizer's own kind, or copy the "
                "members and then build a new EnsembleOptimizer."
            )
        copy_leaves_(self.state, mapping)
        self.transform = new_transform

    def __repr__(self) -> str:
        return f"EnsembleOptimizer({len(self.params)} stacked parameters)"
