"""``HeteroEnsemble``: members of several architectures, one vectorized group per architecture."""

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, SupportsIndex

import torch
from torch import Tensor, nn

from .. import _torch_compat
from .._checkpoint.state_dict_checks import check_groups_loadable
from .._core import in_dims as _in_dims
from .._core import own_keywords, wrapper_call
from .._core.ensemble import Ensemble, check_no_swap
from .._core.in_dims import InDims
from .._core.members import checked_member_index
from .._core.own_keywords import OWN
from .._core.rollback import rollback_on_error
from .._core.stack import member_list
from .._core.tree_view import register_view
from .._core.vmap import Randomness
from ..optim._protocol import GradientTransformation
from . import group_errors
from .grad import grouped_value_and_grad
from .grouping import group_by_architecture, per_member, regroup, select_inputs
from .routing import built_for, grouped

_STACK_FIX = (
    "Stacking needs one shape, dtype and device for all members' outputs; pass "
    "stack=False for a list of per-member outputs in member order."
)


class HeteroEnsemble(nn.Module):
    """Members of different architectures, run as one vectorized group per architecture.

    The members are grouped by architecture, where "the same architecture" is exactly
    what [`stack`][funcensemble.stack] requires; a member joins the first group whose
    first member it matches, so groups come in order of first appearance (members that
    differ only in dtype, device or train/eval mode form groups of their own, each run
    as the loop would run it). Each group is
    an [`Ensemble`][funcensemble.Ensemble] (``hens.groups[g]``, holding the members
    ``hens.group_members[g]``); a group of one member is an ``Ensemble`` of one. Everything
    else speaks in the members' original order: calling it returns ``[N, ...]``
    outputs, ``value_and_grad`` returns ``[N]`` losses, and per-member hyperparameters
    of ``optimizer`` are ``[N]`` tensors. Its parameters are the groups' stacked
    parameters, so element-wise ``torch.optim`` optimizers, ``state_dict``, ``.to()``,
    ``.train()`` and ``.eval()`` work as on an ``Ensemble``; [`save`][funcensemble.save],
    [`load`][funcensemble.load], [`export_state_dicts`][funcensemble.export_state_dicts],
    [`import_state_dicts`][funcensemble.import_state_dicts] and
    [`EnsembleOptimizer`][funcensemble.optim.EnsembleOptimizer] take it as they take an
    ``Ensemble``. See the how-to page "Members of different architectures".

    Args:
        modules: A non-empty sequence of modules, of one or more architectures. Their
            tensors are copied, not shared.
        randomness: Passed to every group, as in [`Ensemble`][funcensemble.Ensemble]:
            ``"same"`` gives the members of one group the same draws; each group draws
            its own.
        chunk_size: Passed to every group, as in [`Ensemble`][funcensemble.Ensemble].

    Raises:
        TypeError: ``modules`` is a single module, or a member is not an
            ``nn.Module`` (or holds a layer ``vmap`` cannot run, as in ``stack``).
        ValueError: No modules.

    Example:
        >>> import torch, funcensemble as fe
        >>> make = lambda width: torch.nn.Sequential(
        ...     torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
        >>> hens = fe.HeteroEnsemble([make(16), make(64), make(16), make(32)])
        >>> hens.group_members
        ((0, 2), (1,), (3,))
        >>> hens(torch.randn(10, 8)).shape  # member order
        torch.Size([4, 10, 4])
    """

    _is_funcensemble_ensemble = True  # refused as a member's submodule

    groups: nn.ModuleList

    def __init__(
        self,
        modules: Sequence[nn.Module] | nn.ModuleList,
        *,
        randomness: Randomness = "different",
        chunk_size: int | None = None,
    ) -> None:
        where = "HeteroEnsemble"
        modules = member_list(where, modules)
        members = group_by_architecture(where, modules)
        for group in members:
            first = modules[group[0]]
            if next(first.parameters(), None) is None and next(first.buffers(), None) is None:
                raise ValueError(
                    f"{where}: members {list(group)} ({type(first).__name__}) have no "
                    "parameters or buffers (expected at least one tensor to stack for each "
                    "architecture, got none), so there is no member axis to map over for "
                    "them: every such member computes the same function. Leave them out "
                    "of the ensemble and call one of them directly."
                )
        ensembles = [
            Ensemble([modules[i] for i in group], randomness=randomness, chunk_size=chunk_size)
            for group in members
        ]
        super().__init__()
        self.groups = nn.ModuleList(ensembles)
        self.group_members: tuple[tuple[int, ...], ...] = tuple(tuple(g) for g in members)
        self._index = [torch.tensor(g) for g in members]
        self._position = {i: (g, p) for g, group in enumerate(members) for p, i in enumerate(group)}
        self.training = modules[0].training

    # -- layout ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_members

    @property
    def num_members(self) -> int:
        """N, the number of members over all groups."""
        return len(self._position)

    def _prefix(self, g: int) -> str:
        return f"groups.{g}.stacked."

    def _names(self, kind: str) -> list[list[str]]:
        """Per group, the full names of its stacked parameters or buffers."""
        return [
            [self._prefix(g) + k for k in getattr(ens, f"stacked_{kind}")()]
            for g, ens in enumerate(self.groups)
        ]

    def _layout(self) -> tuple[Any, ...]:
        return (self.group_members, tuple(tuple(k) for k in self._names("params")))

    def stacked_params(self) -> dict[str, nn.Parameter]:
        """The live stacked parameters of every group, by name (``groups.<g>.stacked.<name>``).

        Group g's parameters have a leading axis of its size, ``len(hens.group_members[g])``.
        """
        return {
            self._prefix(g) + k: v
            for g, ens in enumerate(self.groups)
            for k, v in ens.stacked_params().items()
        }

    def stacked_buffers(self) -> dict[str, Tensor]:
        """The live stacked buffers of every group, by name (``groups.<g>.stacked.<name>``)."""
        return {
            self._prefix(g) + k: v
            for g, ens in enumerate(self.groups)
            for k, v in ens.stacked_buffers().items()
        }

    def _split(self, where: str, what: str, tree: Any, kind: str) -> list[dict[str, Any]]:
        """A flat dict over all groups as one dict per group, by the group's own names."""
        if not isinstance(tree, dict):
            raise TypeError(
                f"{where}: {what} must be a dict keyed by the ensemble's names (as "
                f"hens.stacked_{kind}() returns) (expected a dict, got "
                f"{type(tree).__name__}). Pass the dict that hens.stacked_{kind}() returns."
            )
        names = self._names(kind)
        expected = {k for group in names for k in group}
        if tree.keys() != expected:
            missing, extra = sorted(expected - tree.keys()), sorted(tree.keys() - expected)
            raise ValueError(
                f"{where}: {what} do not match this ensemble: missing {missing}, unexpected "
                f"{extra}. Pass a dict with the keys of hens.stacked_{kind}()."
            )
        return [
            {k[len(self._prefix(g)) :]: tree[k] for k in group} for g, group in enumerate(names)
        ]

    def _join(self, parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {self._prefix(g) + k: v for g, part in enumerate(parts) for k, v in part.items()}

    # -- running -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _buffers_restored_on_error(self) -> Iterator[None]:
        """Put every group's buffers back if the call raises after some group ran.

        Each group rolls back its own statistics when its own call fails; this covers
        the groups that ran before, and a refusal to stack the outputs.
        """
        if len(self.groups) == 1:
            yield
            return
        buffers = list(self.buffers())
        saved = [b.detach().clone() for b in buffers]
        try:
            # One transaction over the groups: what an earlier group updated in place
            # outside its buffers (Embedding(max_norm)'s renormalised rows of its
            # weight) is handed here when that group ends well, and put back too.
            with rollback_on_error({}):
                yield
        except BaseException as error:
            if not _torch_compat.ends_recomputation(type(error)):  # (not a failure)
                with torch.no_grad():
                    for b, s in zip(buffers, saved, strict=True):
                        b.copy_(s)
            raise

    def _dims(self, where: str, in_dims: InDims, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if in_dims is None:
            return (None,) * len(args)
        _in_dims.check_type(where, in_dims)
        return _in_dims.per_argument(in_dims, args, self.num_members, where)

    def _inputs(self, g: int, args: tuple[Any, ...], dims: tuple[Any, ...]) -> tuple[Any, ...]:
        if all(d is None for d in dims):
            return args
        return select_inputs(args, dims, self._index[g])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for ens in self.groups:
            taken = ens.__dict__.get("_keywords_taken", ())
            if taken:
                forward = f"{type(ens.stacked).__name__}.forward"
                own_keywords.refuse_clash("HeteroEnsemble", OWN, taken, forward, kwargs)
        # Global forward hooks run on the members' modules, not on the HeteroEnsemble itself.
        return wrapper_call.call(self, "HeteroEnsemble", args, kwargs)

    def forward(self, *args: Any, in_dims: InDims = None, stack: bool = True, **kwargs: Any) -> Any:
        """Run every member; outputs in member order.

        Each group runs as its ``Ensemble`` does; the groups' outputs are put back in
        member order. A call that raises (a wrong input, outputs that cannot be
        stacked) leaves every group's buffers as they were, and the rows an
        ``Embedding(max_norm=...)`` renormalised in an earlier group.

        Args:
            *args: Positional inputs, shared by all members unless ``in_dims`` says
                otherwise.
            in_dims: As in [`vmap`][funcensemble.vmap]: ``0`` to give each member its
                own slice of every positional input (slice i for member i), or one
                entry per input.
            stack: True: outputs stacked ``[N, ...]``, which needs every member's output
                to have one structure, shape, dtype and device. False: a list of N
                per-member outputs.
            **kwargs: Keyword inputs, shared by all members. Where a member's
                ``forward`` has a parameter ``in_dims`` or ``stack``, passing that name
                by keyword is refused (it is the ensemble's): pass it positionally.

        Raises:
            ValueError: With ``stack=True``, members whose outputs differ in structure,
                shape, dtype or device (naming two of them); and the errors of
                ``Ensemble``.
        """
        where = "HeteroEnsemble"
        dims = self._dims(where, in_dims, args)
        with self._buffers_restored_on_error():
            outs = []
            for g, ens in enumerate(self.groups):
                with group_errors.naming(where, g, self.group_members[g], len(self.groups)):
                    # (in_dims only where given: a group refuses it where its members'
                    # forward takes a parameter of that name.)
                    own = {} if in_dims is None else {"in_dims": dims}
                    outs.append(ens(*self._inputs(g, args, dims), **own, **kwargs))
            if stack:
                return regroup(where, "output", outs, self.group_members, _STACK_FIX)
        return per_member(outs, self.group_members, self.num_members)

    def value_and_grad(
        self, loss_fn: Callable[..., Any], in_dims: InDims = None, *, has_aux: bool = False
    ) -> Callable[..., tuple[Any, ...]]:
        """Per-member losses and gradients of every member, one vectorized call per group.

        [`value_and_grad`][funcensemble.value_and_grad] for every group, in member order.
        ``loss_fn(fmodel, params, buffers, *batch, **kwargs)`` is written for ONE
        member: ``fmodel`` is that member's function (its group's
        [`FunctionalModule`][funcensemble.FunctionalModule]), ``params`` and ``buffers``
        its own tensors. The returned function takes flat dicts keyed like
        ``hens.stacked_params()`` and ``hens.stacked_buffers()``; it is pure (the
        buffers given are not modified; the updated ones come back). Each group runs
        with the ensemble's ``randomness`` and ``chunk_size``.

        Args:
            loss_fn: The one-member loss, taking the member's function first.
            in_dims: As in [`vmap`][funcensemble.vmap], over all N members in member
                order (``0``: slice i of the input for member i).
            has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back stacked in
                member order (every member's aux must have one shape).

        Returns:
            A function returning ``(losses, grads, buffers)`` (or with ``aux`` last):
            ``losses`` is ``[N]`` in member order, ``grads`` and ``buffers`` are flat
            dicts keyed like the ones given.

        Raises:
            TypeError: ``loss_fn`` not callable; ``params`` or ``buffers`` not dicts.
            ValueError: Dicts whose keys are not this ensemble's, and the errors of
                ``value_and_grad``.

        Example:
            >>> import torch, funcensemble as fe
            >>> hens = fe.HeteroEnsemble([torch.nn.Linear(3, 1), torch.nn.Sequential(
            ...     torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))])
            >>> def loss_fn(fmodel, p, b, x, y):
            ...     return torch.nn.functional.mse_loss(fmodel(p, b, x), y)
            >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
            >>> params, buffers = hens.stacked_params(), hens.stacked_buffers()
            >>> losses, grads, _ = hens.value_and_grad(loss_fn)(params, buffers, x, y)
            >>> losses.shape, grads["groups.1.stacked.0.weight"].shape
            (torch.Size([2]), torch.Size([1, 5, 3]))
        """
        return grouped_value_and_grad(self, loss_fn, in_dims, has_aux)

    # -- optimizing ----------------------------------------------------------------------

    def optimizer(
        self,
        transform: GradientTransformation | Callable[..., GradientTransformation],
        /,
        *args: Any,
        **hyperparameters: Any,
    ) -> GradientTransformation:
        """An ``fe.optim`` optimizer over all members: one transform per group.

        ``hens.optimizer(fe.optim.adam, lr=lrs)`` builds ``fe.optim.adam`` once per
        group, with every ``[N]`` tensor among the arguments (also inside tuples such as
        ``betas``, and returned by a schedule ``lr(count)``) indexed to that group's
        members: per-member values are given in member order. ``hens.optimizer(t)``
        with a built transform runs ``t`` in every group (one holding per-member
        values is refused when there are several groups: it cannot tell which group's
        members they are for). Either way each group's transform sees
        only its own members' leaves, so
        [`clip_by_global_norm`][funcensemble.optim.clip_by_global_norm] clips each
        member by its own norm.

        The result is a [`GradientTransformation`][funcensemble.optim.GradientTransformation]
        over flat dicts keyed like ``hens.stacked_params()``: use its ``init``,
        ``update`` (with [`apply_updates`][funcensemble.optim.apply_updates]) and
        ``update_``, or hand it to [`EnsembleOptimizer`][funcensemble.optim.EnsembleOptimizer]
        with the ensemble (which wraps a plain transform the same way). Its state
        is a tuple of the groups' states. ``update_`` checks the keys and every
        gradient's shape, dtype and device before any group steps. A schedule is
        called once per group and step.

        Args:
            transform: A built transform, or a function building one (``fe.optim.adam``,
                ``fe.optim.sgd``, or your own function returning a ``chain``).
            *args: Positional arguments of the function.
            **hyperparameters: Keyword arguments of the function.

        Raises:
            TypeError: Not a transform nor a function building one; a built transform
                with arguments.
            ValueError: A 1-D tensor argument whose length is not N (before anything
                is built); a built transform holding per-member values, with several
                groups; and the function's own errors.

        Example:
            >>> import torch, funcensemble as fe
            >>> hens = fe.HeteroEnsemble([torch.nn.Linear(3, 1), torch.nn.Linear(3, 2),
            ...                           torch.nn.Linear(3, 1)])
            >>> opt = hens.optimizer(fe.optim.sgd, lr=torch.tensor([0.1, 0.2, 0.3]))
            >>> params = hens.stacked_params()
            >>> state = opt.init(params)
            >>> grads = {k: torch.ones_like(v) for k, v in params.items()}
            >>> updates, state = opt.update(grads, state, params)
            >>> updates["groups.0.stacked.bias"].flatten()  # members 0 and 2
            tensor([-0.1000, -0.3000])
        """
        where = "HeteroEnsemble.optimizer"
        keys = self._names("params")
        return grouped(
            where, keys, self.group_members, self._layout(), transform, args, hyperparameters
        )

    def _adapt(self, transform: GradientTransformation) -> GradientTransformation:
        """A transform for an EnsembleOptimizer over this ensemble: grouped if it is not."""
        layout = built_for(transform)
        if layout == self._layout():
            return transform
        if layout is not None:  # grouped for another HeteroEnsemble
            raise ValueError(
                "EnsembleOptimizer: the transform was built by another HeteroEnsemble's "
                f"optimizer(...), for groups of members {list(map(list, layout[0]))} "
                f"(expected one built for this ensemble, whose groups are "
                f"{list(map(list, self.group_members))}). Build it with this ensemble's "
                "own: hens.optimizer(fe.optim.adam, lr=lrs)."
            )
        return self.optimizer(transform)

    # -- members -----------------------------------------------------------------------

    def member(self, index: SupportsIndex) -> nn.Module:
        """An independent ordinary module holding member ``index`` (negative counts back;
        a NumPy integer or a 0-d integer tensor works too).

        Example:
            >>> import torch, funcensemble as fe
            >>> hens = fe.HeteroEnsemble([torch.nn.Linear(3, 2), torch.nn.Linear(3, 4)])
            >>> hens.member(1).weight.shape
            torch.Size([4, 3])
        """
        i = checked_member_index("HeteroEnsemble.member", index, self.num_members)
        g, position = self._position[i]
        return self.groups[g].member(position)

    def unstack(self) -> list[nn.Module]:
        """All members as independent ordinary modules, in member order."""
        return [self.member(i) for i in range(self.num_members)]

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module.load_state_dict``, checked in full before anything is copied.

        Each group's entries are checked as
        [`Ensemble.load_state_dict`][funcensemble.Ensemble.load_state_dict] checks them
        (keys, shapes with the group's member count, kinds of dtype), and with
        ``strict`` no key may lie outside the groups, before the first value is
        copied: a state_dict that fails any check changes nothing. The keys name
        groups, not members: a state_dict of an ensemble whose members came in another
        order, in groups of the same sizes, loads without an error. [`fe.save`][funcensemble.save]
        and [`fe.load`][funcensemble.load] record the grouping and check it.

        Raises:
            TypeError: ``state_dict`` is not a mapping, or a value is not a tensor.
            ValueError: Keys, shapes or dtypes that do not match (naming the group).
        """
        check_no_swap("HeteroEnsemble.load_state_dict")
        check_groups_loadable("HeteroEnsemble.load_state_dict", self.groups, state_dict, strict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, fn: Any, recurse: bool = True) -> "HeteroEnsemble":
        check_no_swap("HeteroEnsemble.to/.double/.half/.cpu/.cuda/share_memory")
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, group_members={self.group_members}"


# The optimizer layer sees a HeteroEnsemble as its stacked parameters and buffers, and
# runs a transform over them group by group.
register_view(
    HeteroEnsemble,
    lambda hens: {"params": hens.stacked_params(), "buffers": hens.stacked_buffers()},
    adapt=lambda hens, transform: hens._adapt(transform),
)
