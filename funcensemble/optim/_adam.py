"""Adam and AdamW as in ``torch.optim``, over pytrees of stacked ``[N, ...]`` parameters."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from .._messages import boolean as _flag
from ._adam_step import Moments, Options, adam_step, adam_step_, foreach_adam
from ._hyper import (
    Hyper,
    PerMember,
    check_members,
    hyperparameter,
    is_per_member,
    schedule_value,
)
from ._protocol import (
    GradientTransformation,
    PyTree,
    chain,
    check_like,
    check_state_type,
    check_tensors,
    flatten,
    leaf_name,
    leaves_like,
    not_the_chains_state,
    scatter,
    state_leaves,
    trainable,
    traits,
    with_traits,
)
from ._recipes import rebuildable
from ._transforms import Schedule, ScheduleState, checked_learning_rate, learning_rate


class AdamState(NamedTuple):
    """The state of [`scale_by_adam`][funcensemble.optim.scale_by_adam].

    Each field is a pytree shaped like the parameters, holding ``None`` for leaves that
    are not floating point. The names map to ``torch.optim.Adam``'s per-parameter
    state: ``count`` is ``step``, ``mu`` is ``exp_avg``, ``nu`` is ``exp_avg_sq`` and
    ``nu_max`` is ``max_exp_avg_sq``.

    Attributes:
        count: Per leaf, how many updates it has received (a 0-dim float32 tensor on
            the leaf's device). A leaf whose gradient is None is not stepped, so
            its count (and bias correction) falls behind, exactly like torch.optim.
            Members that join an optimizer that has stepped
            ([`fe.optim.concat`][funcensemble.optim.concat]) make it a ``[N]`` tensor,
            one count per member; ``update`` and ``update_`` then run the
            multi-tensor step instead of the fused kernel.
        mu: First-moment running averages, like the parameters.
        nu: Second-moment running averages, like the parameters.
        nu_max: With ``amsgrad``, the running maximum of ``nu``; otherwise all None.

    Example:
        >>> import torch, funcensemble as fe
        >>> params = {"w": torch.zeros(4, 3), "steps": torch.zeros(4, dtype=torch.int64)}
        >>> state = fe.optim.scale_by_adam(amsgrad=True).init(params)
        >>> state.mu["w"].shape, state.mu["steps"], state.count["w"]
        (torch.Size([4, 3]), None, tensor(0.))
    """

    count: PyTree
    mu: PyTree
    nu: PyTree
    nu_max: PyTree


def _betas(where: str, betas: object) -> tuple[Hyper, Hyper]:
    if not isinstance(betas, Sequence) or isinstance(betas, str):
        raise TypeError(
            f"{where}: betas must be a pair (beta1, beta2) (expected e.g. (0.9, 0.999), got "
            f"{type(betas).__name__}). Pass betas as a tuple of two."
        )
    if len(betas) != 2:
        raise ValueError(
            f"{where}: betas must be a pair (beta1, beta2) (expected 2 values, got "
            f"{len(betas)} values). Pass betas as a tuple of two."
        )
    return tuple(  # type: ignore[return-value]
        hyperparameter(where, f"betas[{k}]", b, label=f"beta parameter at index {k}", upper=1.0)
        for k, b in enumerate(betas)
    )


_NO_DECAY = Hyper("weight_decay", 0.0)


def _adam_moments(
    where: str,
    b1: Hyper,
    b2: Hyper,
    eps: Hyper,
    amsgrad: bool,
    *,
    weight_decay: Hyper = _NO_DECAY,
    maximize: bool = False,
    decoupled: bool = False,
) -> GradientTransformation:
    """``scale_by_adam`` from already validated hyperparameters.

    Followed by a learning rate in a ``chain``, the two fold into one step computing
    torch.optim's arithmetic (the rate enters the bias correction before the division),
    with the sign flip and weight decay of ``adam``/``adamw`` inside it. Only ``adam``
    passes those: without a learning rate to fold they have no meaning.
    """
    per_member = [h for h in (b1, b2, eps, weight_decay) if is_per_member(h)]
    # lr = -1 turns torch.optim's step -lr * m̂ / (sqrt(v̂) + eps) into the direction itself.
    options = Options(
        Hyper("lr", -1.0), b1, b2, eps, Hyper("weight_decay", 0.0), amsgrad, False, False
    )

    def init(params: PyTree) -> AdamState:
        leaves, spec = flatten(params)
        indices = trainable(leaves)
        for h in per_member:
            check_members(h, where, spec, leaves, indices)
        # torch.optim's `step` is a float32 tensor too; here it lives on the leaf's device.
        counts = [torch.zeros((), dtype=torch.float32, device=leaves[i].device) for i in indices]
        none = [None] * len(leaves)

        def zeros() -> PyTree:
            moments = [
                torch.zeros_like(leaves[i], memory_format=torch.preserve_format) for i in indices
            ]
            return spec.unflatten(scatter(none, indices, moments))

        return AdamState(
            spec.unflatten(scatter(none, indices, counts)),
            zeros(),
            zeros(),
            zeros() if amsgrad else spec.unflatten(none),
        )

    def step(updates: PyTree, state: AdamState, in_place: bool) -> tuple[PyTree, AdamState]:
        """``update`` and its in-place form: one arithmetic, the state written or not."""
        # Leaves without state (not floating point) or without a gradient are skipped.
        spec, counts, grads, fields, active = state_leaves(
            where, state, AdamState, updates, AdamState._fields[1:]
        )
        mu, nu, nu_max = fields["mu"], fields["nu"], fields["nu_max"]
        if not active:
            return spec.unflatten([None] * len(counts)), state
        check_like(where, "the update", spec, active, grads, mu, "state.mu")
        for h in per_member:
            check_members(h, where, spec, mu, active)

        def pick(xs: list[Any]) -> list[Any]:
            return [xs[i] for i in active]

        moments = Moments(pick(mu), pick(nu), pick(nu_max) if amsgrad else [], pick(counts))
        with torch.no_grad():
            new, direction = foreach_adam(
                pick(mu), pick(grads), moments, options, in_place=in_place, apply=False
            )
        out = spec.unflatten(scatter([None] * len(counts), active, direction))
        if in_place:
            return out, state
        new_state = AdamState(
            spec.unflatten(scatter(counts, active, new.counts)),
            spec.unflatten(scatter(mu, active, new.mu)),
            spec.unflatten(scatter(nu, active, new.nu)),
            spec.unflatten(scatter(nu_max, active, new.nu_max)) if amsgrad else state.nu_max,
        )
        return out, new_state

    def update(
        updates: PyTree, state: AdamState, params: PyTree = None
    ) -> tuple[PyTree, AdamState]:
        return step(updates, state, in_place=False)

    def update_inplace(
        updates: PyTree, state: AdamState, params: PyTree = None
    ) -> tuple[PyTree, AdamState]:
        return step(updates, state, in_place=True)

    def fold(rate: GradientTransformation) -> GradientTransformation | None:
        found = traits(rate).learning_rate
        if found is None:
            return None
        lr_where, lr = found
        # Placeholder lr in the options: the step puts the current value in (a schedule's).
        options = Options(Hyper("lr", 0.0), b1, b2, eps, weight_decay, amsgrad, maximize, decoupled)
        pair_update, pair_update_ = _steps(where, lr, options, lr_where)

        def pair_init(params: PyTree) -> tuple[Any, Any]:
            return init(params), rate.init(params)

        pair = GradientTransformation(pair_init, pair_update, pair_update_)
        return with_traits(pair, applies=True)

    out = GradientTransformation(init, update, update_inplace)
    if weight_decay is not _NO_DECAY or maximize:
        # Never run alone: the decay and sign belong to the folded step.
        out = GradientTransformation(init, _unfolded(where), _unfolded(where))
    return with_traits(out, fold=fold)


def _unfolded(where: str) -> Callable[..., tuple[PyTree, Any]]:
    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        raise AssertionError(f"{where}: Adam with weight decay ran without its learning rate.")

    return update


@rebuildable
def scale_by_adam(
    betas: tuple[float | PerMember, float | PerMember] = (0.9, 0.999),
    eps: float | PerMember = 1e-8,
    *,
    amsgrad: bool = False,
) -> GradientTransformation:
    """Rescale gradients into Adam's bias-corrected direction ``m̂ / (sqrt(v̂) + eps)``.

    The building block of [`adam`][funcensemble.optim.adam]: the moments, bias
    corrections and AMSGrad maximum of ``torch.optim.Adam``, without the learning
    rate, weight decay or sign. Directly followed by
    [`scale_by_learning_rate`][funcensemble.optim.scale_by_learning_rate] in a
    [`chain`][funcensemble.optim.chain], the two fold into one step that computes
    ``adam``'s result bit for bit, ``update_`` included (torch.optim's fused kernel
    where it applies): the learning rate enters the bias correction before the
    division, as in torch.optim. Followed by anything else, it rescales the
    gradients into the direction, and its in-place form writes the state by the
    same operations as ``update``.

    Args:
        betas: Decay rates of the first and second moment averages; each a float or
            a ``[N]`` tensor of per-member values.
        eps: Added to the denominator; a float or a ``[N]`` tensor.
        amsgrad: Normalize by the running maximum of the second moment.

    Returns:
        A transform whose state is an [`AdamState`][funcensemble.optim.AdamState].

    Raises:
        ValueError: A hyperparameter out of range (``torch.optim.Adam``'s messages).

    Example:
        >>> import torch, funcensemble as fe
        >>> adam = fe.optim.scale_by_adam()
        >>> params = {"w": torch.zeros(3, 2)}
        >>> direction, state = adam.update({"w": torch.full((3, 2), 4.0)}, adam.init(params))
        >>> torch.allclose(direction["w"], torch.ones(3, 2)), state.count["w"].item()
        (True, 1.0)
    """
    where = "scale_by_adam"
    b1, b2 = _betas(where, betas)
    eps_ = hyperparameter(where, "eps", eps, label="epsilon value")
    return _adam_moments(where, b1, b2, eps_, _flag(where, "amsgrad", amsgrad))


def _check_leaves(
    where: str,
    spec: optree.PyTreeSpec,
    active: list[int],
    leaves: list[Any],
    grads: list[Any],
    counts: list[Any],
    moments: dict[str, list[Any]],
    gradient: str,
) -> None:
    """Check that each stepped leaf is a float tensor with a like gradient and state.

    One pass comparing (shape, dtype, device) keys: this runs on every step, and the
    per-field checks would cost as much as the fused kernel on small ensembles.
    """
    for i in active:
        p, c = leaves[i], counts[i]
        if not isinstance(p, Tensor) or not p.is_floating_point():
            raise TypeError(
                f"{where}: {leaf_name(spec, i)} has Adam state but is a "
                f"{type(p).__name__ if not isinstance(p, Tensor) else f'{p.dtype} tensor'}; "
                "pass the parameters the state was initialized with."
            )
        if not isinstance(c, Tensor) or not (
            c.dim() == 0 or (c.dim() == 1 and c.shape[0] == p.shape[0])
        ):
            raise ValueError(
                f"{where}: state.count for {leaf_name(spec, i)} must be a 0-dim tensor or "
                "one count per member, got "
                f"{type(c).__name__ if not isinstance(c, Tensor) else tuple(c.shape)}."
            )
        key = (p.shape, p.dtype, p.device)
        for what, xs in ((gradient, grads), *moments.items()):
            x = xs[i]
            if not isinstance(x, Tensor) or (x.shape, x.dtype, x.device) != key:
                check_like(
                    where,
                    what if what == gradient else f"state.{what}",
                    spec,
                    [i],
                    xs,
                    leaves,
                )


def _replaced(
    spec: optree.PyTreeSpec, tree: PyTree, indices: list[int], values: list[Tensor]
) -> PyTree:
    """``tree`` (shaped like ``spec``) with ``values`` at the leaves ``indices``.

    Module level, not nested in ``update``: the test run's type-checking decorator
    cannot be applied while torch.compile traces.
    """
    if len(indices) == spec.num_leaves:  # every leaf replaced: nothing to keep of `tree`
        return spec.unflatten(values)
    return spec.unflatten(scatter(spec.flatten_up_to(tree), indices, values))


class _Step(NamedTuple):
    """One checked call of an Adam step: aligned leaves, and which of them it steps."""

    spec: optree.PyTreeSpec
    params: list[Any]  # the parameters' leaves (the state's mu for update without params)
    grads: list[Any]
    counts: list[Any]
    moments: Moments  # the stepped leaves' state, in the order of `active`
    active: list[int]
    lr: Hyper


def _steps(
    where: str, lr: Hyper | Schedule, options: Options, lr_where: str
) -> tuple[Callable[..., tuple[PyTree, Any]], Callable[[PyTree, Any, PyTree], Any]]:
    """The pure ``update`` and the in-place form of Adam folded with its learning rate:
    the state is the pair (AdamState, the rate's state). Both compute torch.optim's step
    (``foreach_adam``, or the fused kernel in place)."""
    size, at = 2, 0
    per_member = [h for h in options[1:5] if is_per_member(h)]
    moment_fields = AdamState._fields[1:] if options.amsgrad else AdamState._fields[1:3]
    constant = isinstance(lr, Hyper)
    decays = is_per_member(options.weight_decay) or options.weight_decay.value != 0

    def check(grads: PyTree, state: Any, params: PyTree, words: tuple[str, str]) -> _Step:
        """Everything, with one wording per entry point, before anything is written."""
        if not isinstance(state, tuple) or len(state) != size:
            raise ValueError(not_the_chains_state(state, size))
        moments = state[at]
        check_state_type(where, moments, AdamState)
        if not constant:
            check_state_type(lr_where, state[-1], ScheduleState)
        if params is None:  # the pure update needs the parameters for weight decay only
            if decays:
                raise ValueError(
                    f"{where}: weight decay needs the parameters; call "
                    "update(grads, state, params)."
                )
            counts, spec = flatten(moments.count)
        else:
            leaves, spec = flatten(params)
            counts = leaves_like(where, "state.count", spec, moments.count)
        tree, gradient = words
        gs = leaves_like(where, tree, spec, grads)
        fields = {
            f: leaves_like(where, f"state.{f}", spec, getattr(moments, f)) for f in moment_fields
        }
        if params is None:
            leaves = fields["mu"]
        active = []
        for i, g in enumerate(gs):
            if g is not None:
                if not isinstance(g, Tensor) or g.layout is not torch.strided:
                    check_tensors(where, gradient, spec, gs)
                if counts[i] is not None:
                    active.append(i)
        _check_leaves(where, spec, active, leaves, gs, counts, fields, gradient)
        value = lr if constant else schedule_value(lr_where, "lr", lr(state[-1].count))
        for h in per_member:
            check_members(h, where, spec, leaves, active)
        check_members(value, lr_where, spec, leaves, active)
        mu, nu, *nu_max = ([xs[i] for i in active] for xs in fields.values())
        picked = Moments(mu, nu, nu_max[0] if nu_max else [], [counts[i] for i in active])
        return _Step(spec, leaves, gs, counts, picked, active, value)

    def update(grads: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        step = check(grads, state, params, ("updates", "the update"))
        active, spec = step.active, step.spec
        out: list[Any] = [None] * len(step.counts)
        new_state = list(state)
        with torch.no_grad():
            if active:
                new, updates = adam_step(
                    [step.params[i] for i in active],
                    [step.grads[i] for i in active],
                    step.moments,
                    options._replace(lr=step.lr),
                )
                out = scatter(out, active, updates)
                old = state[at]
                new_state[at] = AdamState(
                    _replaced(spec, old.count, active, new.counts),
                    _replaced(spec, old.mu, active, new.mu),
                    _replaced(spec, old.nu, active, new.nu),
                    _replaced(spec, old.nu_max, active, new.nu_max)
                    if options.amsgrad
                    else old.nu_max,
                )
            if not constant:
                new_state[-1] = ScheduleState(state[-1].count + 1)
        return spec.unflatten(out), tuple(new_state)

    def update_inplace(grads: PyTree, state: Any, params: PyTree) -> tuple[PyTree, Any]:
        step = check(grads, state, params, ("grads", "the gradient"))
        if step.active:
            adam_step_(
                [step.params[i] for i in step.active],
                [step.grads[i] for i in step.active],
                step.moments,
                options._replace(lr=step.lr),
            )
        if not constant:
            state[-1].count.add_(1)
        # The step is applied: nothing is left for the caller to add.
        return None, state

    return update, update_inplace


def _adam(
    where: str,
    lr: object,
    betas: object,
    eps: object,
    weight_decay: object,
    amsgrad: object,
    maximize: object,
    *,
    decoupled: bool,
) -> GradientTransformation:
    # Validate everything, in torch.optim.Adam's order, before building anything.
    lr_ = checked_learning_rate(where, lr)
    eps_ = hyperparameter(where, "eps", eps, label="epsilon value")
    b1, b2 = _betas(where, betas)
    wd = hyperparameter(where, "weight_decay", weight_decay, label="weight_decay value")
    amsgrad = _flag(where, "amsgrad", amsgrad)
    maximize = _flag(where, "maximize", maximize)

    # torch.optim negates the gradient first, then adds L2 decay to it (Adam) or shrinks
    # the weights by lr * weight_decay beside the step (AdamW): both inside Adam's step,
    # which folds the learning rate as torch.optim does. One state layout,
    # (AdamState, the learning rate's state), whatever the hyperparameters' values.
    return chain(
        _adam_moments(
            where, b1, b2, eps_, amsgrad, weight_decay=wd, maximize=maximize, decoupled=decoupled
        ),
        learning_rate(where, lr_),  # type: ignore[arg-type]
    )


@rebuildable
def adam(
    lr: float | PerMember | Schedule = 1e-3,
    betas: tuple[float | PerMember, float | PerMember] = (0.9, 0.999),
    eps: float | PerMember = 1e-8,
    *,
    weight_decay: float | PerMember = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
) -> GradientTransformation:
    """Adam, computing for each member what ``torch.optim.Adam`` computes for it alone.

    It is ``chain(scale_by_adam(betas, eps, amsgrad=amsgrad),
    scale_by_learning_rate(lr))`` with torch.optim's sign flip and L2 weight decay
    inside the folded step.

    Any of ``lr``, each beta, ``eps`` and ``weight_decay`` may be a ``[N]`` tensor
    giving each member its own value (e.g. ``lr=torch.logspace(-4, -2, N)``); it
    broadcasts over every parameter's leading member axis. Leaves that are not
    floating point (integer buffers) get no state and no update; a leaf whose
    gradient is None is skipped like ``torch.optim`` skips a parameter whose
    ``.grad`` is None (its moments and step count stay as they are). No step
    records autograd history.

    The arithmetic is torch.optim's: its operations in its order, with the bias
    corrections and step size in double precision as torch.optim's Python floats
    are. With float hyperparameters (a schedule included) on a device that has it,
    ``update_`` runs ``Adam(fused=True)``'s kernel on the parameters and state, and
    ``update`` runs it on fresh copies of the state, so its inputs stay untouched.
    The CPU kernel rounds a tensor's last ``numel % vector width`` elements in scalar
    code, unlike the others, so ``update`` pads a leaf whose size is not a multiple
    of 64 elements: the step a member gets then does not depend on how many members
    share its tensors (split across devices or selected, it steps alike; the
    gradients fed to it may differ by a rounding, see the scale-out how-to). On leaves of a
    multiple of 64 elements and without weight decay, ``update`` returns the kernel's
    own step, and ``apply_updates`` gives what ``update_`` gives, bit for bit in
    float32 and float64 (float16 and bfloat16 round the step to the parameter's
    dtype before it is added). With weight decay the updates are the kernel's new
    parameters minus the old ones, which ``apply_updates`` adds back exactly
    wherever the new value is within a factor 2 of the old (Sterbenz's lemma), and
    elsewhere (a value crossing zero) within a rounding or two of the larger of the
    two. With per-member values, under ``torch.compile`` (which cannot trace the
    fused kernel), inside a ``torch.func`` transform (``update``) or with
    non-contiguous tensors, both run multi-tensor (``torch._foreach_*``) kernels over
    those leaves at once, which read no value back to Python: ``update`` in
    ``Adam(foreach=True)``'s order, ``update_`` ending the step in the order
    torch.optim uses for tensor hyperparameters. Elementwise kernels may round
    differently on a stacked tensor than on one member's (SIMD lanes fall
    elsewhere), so in float32 a member can end a few ulps from torch.optim's run of
    it alone: after 1,000 steps the test suite allows 8 ulps (of the larger of the
    parameter and its total change) from ``Adam(fused=True)`` for the fused kernel,
    and no further from torch's for-loop Adam than ``Adam(fused=True)`` is; 4 ulps
    from ``Adam(foreach=True)`` for ``update``'s multi-tensor ops and 8 for
    ``update_``'s; and 1e-12 in float64. Those bounds are the test's, on a
    well-conditioned problem: each step differs by a rounding or two, but where weight
    decay feeds a parameter back into its gradient, or steps are far larger than a
    parameter's net change (``beta2=0``), such a difference can grow over the steps
    (to hundreds of those ulps in a randomized search), as any rounding difference
    would there. A NaN or inf in one member's
    gradient makes that member's parameters and state what torch.optim makes of them
    (NaN); every other member is untouched, bit for bit. In float16 ``eps=1e-8``
    rounds to 0 in torch's for-loop and foreach Adam, whose updates then turn NaN where
    a gradient is tiny; the fused kernel computes in float32 and stays finite, so
    ``update_`` and ``EnsembleOptimizer`` give ``Adam(fused=True)``'s numbers there.

    Args:
        lr: The learning rate: a float, a ``[N]`` tensor, or a schedule ``lr(count)``
            (see [`scale_by_learning_rate`][funcensemble.optim.scale_by_learning_rate]).
            A tensor's values enter the step in double precision, as a Python float
            does: ``lr=t`` steps as ``torch.optim.Adam(lr=float(t))`` (torch.optim
            given the float32 tensor itself computes its step size in float32, about
            1e-8 of it apart, on float64 parameters).
        betas: Decay rates of the first and second moment averages.
        eps: Added to the denominator for numerical stability.
        weight_decay: L2 penalty added to the gradient (after the sign flip of
            ``maximize``), as in ``torch.optim.Adam``.
        amsgrad: Use the AMSGrad variant (normalize by the running maximum of the
            second moment).
        maximize: Maximize the objective instead of minimizing it.

    Returns:
        A [`GradientTransformation`][funcensemble.optim.GradientTransformation] whose
        state is the pair ``(AdamState, lr state)``: the
        [`AdamState`][funcensemble.optim.AdamState] holds the moments, the second
        entry is an [`EmptyState`][funcensemble.optim.EmptyState] for a constant
        ``lr`` or a [`ScheduleState`][funcensemble.optim.ScheduleState] for a
        schedule. The layout does not depend on the other hyperparameters'
        values (weight decay, amsgrad, maximize, floats or per-member tensors),
        so a saved state loads into an optimizer built with other values.

    Raises:
        ValueError: A hyperparameter out of range, with ``torch.optim``'s wording
            (``Invalid learning rate: -1.0``), or a per-member tensor not shaped ``[N]``.
        TypeError: A hyperparameter of the wrong type.

    Example:
        >>> import torch, funcensemble as fe
        >>> fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 1) for _ in range(4)])
        >>> opt = fe.optim.adam(lr=torch.tensor([0.1, 0.1, 0.0, 0.0]))  # per member
        >>> state = opt.init(params)
        >>> grads = {k: torch.ones_like(v) for k, v in params.items()}
        >>> updates, state = opt.update(grads, state, params)
        >>> new = fe.optim.apply_updates(params, updates)
        >>> step = torch.tensor([[-0.1], [-0.1], [0.0], [0.0]])
        >>> torch.allclose(new["bias"] - params["bias"], step)
        True
    """
    return _adam("adam", lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=False)


@rebuildable
def adamw(
    lr: float | PerMember | Schedule = 1e-3,
    betas: tuple[float | PerMember, float | PerMember] = (0.9, 0.999),
    eps: float | PerMember = 1e-8,
    *,
    weight_decay: float | PerMember = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
) -> GradientTransformation:
    """AdamW (decoupled weight decay), computing per member what ``torch.optim.AdamW`` does.

    Like [`adam`][funcensemble.optim.adam], except that weight decay shrinks the
    weights by ``lr * weight_decay`` beside the Adam step instead of entering the
    gradient. Its state has ``adam``'s layout, with or without weight decay.
    Everything else (per-member tensors, schedules, skipping, precision, non-finite
    gradients) is the same.

    Args:
        lr: The learning rate: a float, a ``[N]`` tensor, or a schedule ``lr(count)``.
        betas: Decay rates of the first and second moment averages.
        eps: Added to the denominator for numerical stability.
        weight_decay: Decoupled decay rate.
        amsgrad: Use the AMSGrad variant.
        maximize: Maximize the objective instead of minimizing it.

    Returns:
        A [`GradientTransformation`][funcensemble.optim.GradientTransformation].

    Raises:
        ValueError: A hyperparameter out of range (``torch.optim``'s wording), or a
            per-member tensor not shaped ``[N]``.
        TypeError: A hyperparameter of the wrong type.

    Example:
        >>> import torch, funcensemble as fe
        >>> opt = fe.optim.adamw(lr=0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(2, 3)}
        >>> updates, _ = opt.update({"w": torch.zeros(2, 3)}, opt.init(params), params)
        >>> torch.allclose(updates["w"], torch.full((2, 3), -0.05))  # -lr * wd * w
        True
    """
    return _adam("adamw", lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=True)
