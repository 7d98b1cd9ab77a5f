"""Per-member losses and gradients of all members in one call."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import _torch_compat, _tree
from .._kernels.fastpath import refuse_inference_tensors
from .._structure import chunk_state as _chunk_state
from . import in_dims as _in_dims
from . import member_offset as _member_offset
from .in_dims import InDims
from .rollback import rollback_on_error
from .seeding import rng_state, set_rng_state
from .stack import _num_members, check_state_dicts
from .vmap import Randomness, check_options, mapped_call


def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _requires_grad(t: Tensor) -> bool:
    """``t.requires_grad``, read through ``torch.func`` wrappers to the tensor inside.

    A tensor batched by an enclosing ``torch.func.vmap`` reports ``requires_grad=False``
    at that level whatever the tensor it wraps says.
    """
    if t.requires_grad:
        return True
    if torch.compiler.is_compiling():
        return False
    inner = _torch_compat.unwrap_once(t)
    return inner is not None and _requires_grad(inner)


def _trainable(params: dict[str, Tensor], *, any_marked: bool | None = None) -> set[str]:
    """The names of the leaves to differentiate: see value_and_grad's docstring.

    ``any_marked``: whether any leaf of the whole ensemble requires grad, where
    ``params`` are one part of it (a ``HeteroEnsemble`` group); by default, of ``params``.
    """
    floating = {k for k, v in params.items() if _differentiable(v)}
    marked = {k for k in floating if _requires_grad(params[k])}
    if any_marked is None:
        any_marked = bool(marked)
    return marked if any_marked else floating


def any_marked(params: dict[str, Tensor]) -> bool:
    """Whether a floating-point leaf of ``params`` requires grad (see ``_trainable``)."""
    return any(_differentiable(v) and _requires_grad(v) for v in params.values())


def _check_losses(losses: Any) -> Tensor:
    if not isinstance(losses, Tensor) or losses.dim() != 1:
        shape = tuple(losses.shape[1:]) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(
            f"value_and_grad: loss_fn must return one scalar per member (expected shape () "
            f"per member, got {shape} per member). Reduce the loss (e.g. .mean()) inside "
            "loss_fn; with has_aux=True return (loss, aux)."
        )
    if not losses.is_floating_point():
        raise ValueError(
            f"value_and_grad: loss_fn returned a {str(losses.dtype).removeprefix('torch.')} "
            "loss (expected a real floating-point loss, which torch.autograd.grad "
            f"differentiates, got {str(losses.dtype).removeprefix('torch.')}). "
            + (
                "Reduce a complex value to a real loss (.abs(), .real) inside loss_fn."
                if losses.is_complex()
                else "An integer loss (argmax, a count) has no gradient: compute the loss "
                "from the outputs' values (e.g. cross-entropy), not from a count."
            )
        )
    return losses


def _split_aux(where: str, out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(loss, aux)`` from loss_fn's output, or a clear error if it is not a pair."""
    if not has_aux:
        return out, None
    if not isinstance(out, (tuple, list)):
        raise TypeError(
            f"{where}: with has_aux=True loss_fn must return a pair (loss, aux), got "
            f"a single {type(out).__name__}. Return (loss, aux), or pass has_aux=False."
        )
    if len(out) != 2:
        raise ValueError(
            f"{where}: with has_aux=True loss_fn must return a pair (loss, aux), got "
            f"a {type(out).__name__} of {len(out)} values. Return (loss, aux), with several "
            "aux values gathered in one tuple or dict."
        )
    return out[0], out[1]


def _detach(tree: Any) -> Any:
    return _tree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


def _autograd_step(
    mapped_loss: Callable[..., Any],
    has_aux: bool,
    params: Any,
    buffers: Any,
    args: tuple[Any, ...],
    kwargs: Any,
    dims: tuple[Any, ...],
    trainable: set[str],
    where: str,
) -> tuple[Tensor, dict[str, Tensor | None], Any]:
    """Autograd through one vectorized forward; the graph is freed on return.

    ``mapped_loss`` is a ``_vmap.mapped_call``; ``dims`` the call's checked ``in_dims``.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{where}: called inside torch.inference_mode(), where no operation records "
            "autograd history, so there is no gradient to take (expected grad mode, or "
            "torch.no_grad(), which value_and_grad turns back on for its own call). Call "
            "it outside the inference_mode block."
        )
    with torch.enable_grad():
        # (Before requires_grad_, whose refusal is torch's words.)
        refuse_inference_tensors(where, params, recorded=trainable)
        leaves = {k: v.detach().requires_grad_(k in trainable) for k, v in params.items()}
        out = mapped_loss(leaves, buffers, args, kwargs, dims)
        losses, aux = _split_aux(where, out, has_aux)
        losses = _check_losses(losses)
        wrt = [k for k, v in leaves.items() if v.requires_grad]
        if wrt and not losses.requires_grad:
            raise ValueError(
                f"{where}: the loss depends on no trainable parameter (expected a loss "
                "computed from the params passed in; it has no autograd history, as "
                "torch.autograd.grad would also refuse). Check loss_fn for a .detach(), "
                ".item(), an integer result (argmax, a count) or a torch.no_grad() block."
            )
        found = (
            _torch_compat.grads_of(losses, [leaves[k] for k in wrt])
            if wrt
            else ()  # nothing to differentiate (a frozen HeteroEnsemble group)
        )
    grads: dict[str, Tensor | None] = dict.fromkeys(params)
    grads.update(zip(wrt, found, strict=True))
    for k in wrt:
        g = grads[k]
        if g is not None and not g.is_contiguous() and leaves[k].is_contiguous():
            # In the parameter's layout, as .grad gets it (autograd's layout contract):
            # a parameter concatenated along a later dim gets a strided view, which
            # update_'s fused Adam kernel would leave to the multi-tensor ops.
            grads[k] = g.contiguous()
    return losses.detach(), grads, _detach(aux) if has_aux else None


def _chunked_step(
    mapped_loss: Callable[..., Any],
    params: Any,
    buffers: Any,
    args: tuple[Any, ...],
    kwargs: Any,
    *,
    dims: tuple[Any, ...],
    randomness: Randomness,
    has_aux: bool,
    chunk_size: int,
    n: int,
    trainable: set[str],
    where: str,
) -> tuple[Tensor, dict[str, Tensor | None], Any]:
    """Forward AND backward of ``chunk_size`` members at a time, into ``[N, ...]`` results.

    Only one chunk's graph (the tensors saved for its backward) is alive at a time, so
    the memory of a step grows with ``chunk_size``, not N. Results are written into
    preallocated ``[N, ...]`` tensors rather than concatenated, which would briefly
    hold the gradients twice.
    """
    # As torch.func.vmap's own chunking does: with randomness="same" every chunk
    # replays one draw, so all members share it; with "different" the chunks draw in
    # turn, exactly the numbers vmap(..., chunk_size=k) draws.
    device = next(iter({**params, **buffers}.values())).device
    replay = rng_state(device) if randomness == "same" else None
    losses: list[Tensor] = []
    grads: dict[str, Tensor | None] = dict.fromkeys(params)
    aux_leaves: list[Tensor] = []
    aux_spec = None
    with _chunk_state.chunked(where) as attributes:
        for start in range(0, n, chunk_size):
            if start:  # every chunk starts from the call's attributes
                attributes.next_chunk()
            stop = min(start + chunk_size, n)
            if replay is not None:
                set_rng_state(device, replay)
            with _member_offset.starting_at(start):
                c_losses, c_grads, c_aux = _autograd_step(
                    mapped_loss,
                    has_aux,
                    {k: v[start:stop] for k, v in params.items()},
                    {k: v[start:stop] for k, v in buffers.items()},  # views: updates land in place
                    _in_dims.narrow(args, dims, start, stop),
                    kwargs,
                    dims,
                    trainable,
                    where,
                )
            losses.append(c_losses)
            for k, g in c_grads.items():
                full = grads[k]
                if g is None:
                    if full is not None:
                        full[start:stop].zero_()
                    continue
                if full is None:
                    # A parameter one chunk leaves unused cannot be used by another (the
                    # same function runs for all); if it were, its unused rows get zeros.
                    full = grads[k] = torch.empty_like(params[k])
                    full[:start].zero_()
                full[start:stop].copy_(g)
            if has_aux:
                leaves, aux_spec = _tree.flatten(c_aux)
                if not aux_leaves:
                    aux_leaves = [x.new_empty((n, *x.shape[1:])) for x in leaves]
                for full_aux, x in zip(aux_leaves, leaves, strict=True):
                    full_aux[start:stop].copy_(x)
            del c_losses, c_grads, c_aux
    aux = _tree.unflatten(aux_spec, aux_leaves) if aux_spec is not None else None
    return torch.cat(losses), grads, aux


def value_and_grad(
    loss_fn: Callable[..., Any],
    in_dims: InDims = None,
    *,
    has_aux: bool = False,
    randomness: Randomness = "different",
    chunk_size: int | None = None,
) -> Callable[..., tuple[Any, ...]]:
    """Per-member losses and gradients of every member, in one vectorized call.

    ``loss_fn(params, buffers, *batch, **kwargs)`` is written for ONE member and returns
    a scalar loss (or ``(loss, aux)`` with ``has_aux=True``). The returned function
    takes stacked ``params`` and ``buffers`` and computes, for all members at once, what
    ``torch.autograd.grad`` of each member's own loss would give. It is pure: the input
    ``buffers`` are not modified; buffers updated by the forward (BatchNorm running
    statistics in train mode) come back out, as values without autograd history.

    The floating-point leaves of ``params`` that require grad are differentiated;
    a frozen one (``requires_grad=False``, as [`stack`][funcensemble.stack] keeps a
    member's ``requires_grad_(False)``) gets ``None``, on every path (chunked,
    compiled, inside another ``torch.func`` transform, the MLP fast path), as the
    loop's ``torch.autograd.grad`` over its trainable parameters gives nothing for it:
    every ``fe.optim`` optimizer, ``EnsembleOptimizer`` and ``torch.optim`` then
    leave it and its state alone. If no leaf requires grad (plain tensors, such as
    detached copies), every floating-point leaf is differentiated, as
    ``torch.func.grad`` does: keep the flags ``stack`` gives (``apply_updates`` and
    ``update_`` keep them, ``load`` gives its template's) for frozen layers to stay
    frozen (members frozen whole look like such copies: every leaf is differentiated;
    do not step them). A trainable parameter the loss does not use gets ``None``, exactly as
    ``torch.autograd.grad(..., allow_unused=True)`` gives, so optimizers skip it;
    under ``torch.compile`` or inside another ``torch.func`` transform the gradients
    are computed with ``torch.func.grad``, where it gets zeros instead.

    Args:
        loss_fn: The one-member loss.
        in_dims: How the batch arguments are split over members, as in
            [`vmap`][funcensemble.vmap] (``None``: shared, ``0``: one slice each).
            Keyword arguments are shared by every member: pass a per-member target
            positionally (``step(params, buffers, x, ys)`` with ``in_dims=(None, 0)``,
            not ``y=ys``, which every member's loss would read whole).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back stacked.
        randomness: As in [`vmap`][funcensemble.vmap].
        chunk_size: Run the forward AND the backward of at most this many members
            at a time, so a step's memory for activations and the tensors saved for
            backward grows with ``chunk_size``, not N (the ``[N, ...]`` gradients
            are still whole); each chunk is one more call, so smaller chunks are
            slower. Results are the chunks' results in member order: the same
            values as without chunking to rounding (a kernel may round a member
            otherwise in a smaller stack), ``None`` gradients included; with
            ``randomness="different"`` the same draws as
            ``vmap(..., chunk_size=chunk_size)``, with ``"same"`` one draw shared by
            every chunk. Under ``torch.compile`` or another ``torch.func``
            transform the chunks run ``torch.func.grad`` (forward and backward)
            one after the other through [`vmap`][funcensemble.vmap]'s
            ``chunk_size``. ``None`` runs all members at once. See the how-to page
            "Chunking and memory".

    Returns:
        A function returning ``(losses, grads, buffers)``, or
        ``(losses, grads, buffers, aux)`` with ``has_aux``: ``losses`` has shape
        ``[N]``, ``grads`` is shaped like ``params``.

    Raises:
        TypeError: ``params`` or ``buffers`` not a dict of tensors, or with
            ``has_aux`` a ``loss_fn`` that does not return a pair.
        ValueError: A loss that is not one scalar per member, a ``(loss, aux)``
            tuple of another length, and [`vmap`][funcensemble.vmap]'s errors.

    Example:
        >>> import torch, funcensemble as fe
        >>> fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 1) for _ in range(4)])
        >>> def loss_fn(p, b, x, y):
        ...     return torch.nn.functional.mse_loss(fmodel(p, b, x), y)
        >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
        >>> losses, grads, buffers = fe.value_and_grad(loss_fn)(params, buffers, x, y)
        >>> losses.shape, grads["weight"].shape
        (torch.Size([4]), torch.Size([4, 1, 3]))
    """
    return _value_and_grad("value_and_grad", loss_fn, in_dims, has_aux, randomness, chunk_size)


def _value_and_grad(
    where: str,
    loss_fn: Callable[..., Any],
    in_dims: InDims,
    has_aux: bool,
    randomness: Randomness,
    chunk_size: int | None,
) -> Callable[..., tuple[Any, ...]]:
    """[`value_and_grad`][funcensemble.value_and_grad], with errors naming ``where``."""
    # The options and in_dims' type are checked here, once; each call checks its
    # arguments against in_dims once (_in_dims.per_argument), and nothing below again.
    check_options(where, loss_fn, randomness, chunk_size, name="loss_fn")
    _in_dims.check_type(where, in_dims)
    if has_aux:
        given_loss = loss_fn

        def loss_fn(*args: Any, **kwargs: Any) -> Any:
            # Checked per member, before vmap's own check of the outputs (which would
            # blame a non-tensor in a third value, not the missing pair).
            out = given_loss(*args, **kwargs)
            _split_aux(where, out, True)
            return out

        loss_fn._signature_of = given_loss  # type: ignore[attr-defined]  # for messages

    # The losses come back as fresh tensors without the mapped call's check of each
    # output against the inputs (a fifth of a small ensemble's call): the chunks' are
    # copied into new tensors, and the whole call's copied in run(). An aux is checked
    # by the mapped call (before the detach that hides what it views), except for outputs
    # an op saved: detached after the backward here, they need no copy.
    mapped_loss = mapped_call(
        loss_fn, randomness, chunk_size, where=where, fresh=has_aux, saved=False
    )

    def one_member(params: Any, buffers: Any, frozen: Any, *args: Any, **kwargs: Any) -> Any:
        # buffers go in as an argument, not a closure: torch.func.grad forbids in-place
        # updates (BatchNorm statistics) of captured tensors. Frozen parameters are an
        # argument too, one torch.func.grad does not differentiate.
        def loss_and_aux(p: Any, b: Any) -> tuple[Tensor, Any]:
            out = loss_fn({**p, **frozen}, b, *args, **kwargs)
            return _split_aux(where, out, True) if has_aux else (out, ())

        return torch.func.grad_and_value(loss_and_aux, has_aux=True)(params, buffers)

    chunk_loss = mapped_call(loss_fn, randomness, None, where=where, fresh=False)
    mapped_grad = mapped_call(one_member, randomness, chunk_size, where=where)

    def with_grads(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        check_state_dicts(where, params, buffers)
        return run(params, buffers, _trainable(params), args, kwargs)

    def run(
        params: Any, buffers: Any, trainable: set[str], args: tuple[Any, ...], kwargs: Any
    ) -> tuple[Any, ...]:
        n = _num_members(where, params, buffers, checked=True, computing=True)
        dims = _in_dims.per_argument(in_dims, args, n, where)
        buffers = {k: v.clone() for k, v in buffers.items()}
        if torch.compiler.is_compiling() or _torch_compat.inside_transform():
            grads, (losses, aux) = mapped_grad(
                {k: v for k, v in params.items() if k in trainable},
                buffers,
                ({k: v for k, v in params.items() if k not in trainable}, *args),
                kwargs,
                (0, *dims),
            )
            losses = _check_losses(losses)
            grads = {k: grads.get(k) for k in params}
            if torch.compiler.is_compiling():
                # As eagerly: results are not part of an autograd graph (which would
                # ask the compiled graph for second derivatives of every op).
                losses = losses.detach()
                grads = {k: None if g is None else g.detach() for k, g in grads.items()}
                aux = _detach(aux) if has_aux else aux
        elif chunk_size is not None and chunk_size < n:
            # One transaction over all chunks: a later chunk's failure puts back what
            # the earlier ones updated in place (their own transactions hand it here).
            with rollback_on_error({}):
                losses, grads, aux = _chunked_step(
                    chunk_loss,
                    params,
                    buffers,
                    args,
                    kwargs,
                    dims=dims,
                    randomness=randomness,
                    has_aux=has_aux,
                    chunk_size=chunk_size,
                    n=n,
                    trainable=trainable,
                    where=where,
                )
        else:
            # Autograd through one vectorized forward: cheaper than torch.func.grad at
            # small N, and it reports unused parameters as None like the loop would.
            # The checks of the losses and autograd run after the mapped call's own
            # transaction: a failure there puts back what it updated in place too.
            with rollback_on_error({}):
                losses, grads, aux = _autograd_step(
                    mapped_loss, has_aux, params, buffers, args, kwargs, dims, trainable, where
                )
            # loss_fn may return a parameter, buffer or input itself (or a view of one):
            # the caller gets tensors of its own, as the loop's torch.stack gives.
            losses = losses.clone()
        if not torch.compiler.is_compiling() and not _torch_compat.inside_transform():
            # A buffer the forward wrote a differentiable value into (snap.copy_(w * 2))
            # comes back as a value, as the losses do: its graph would otherwise grow
            # through every later step that starts from it.
            buffers = {k: v.detach() if v.requires_grad else v for k, v in buffers.items()}
        return (losses, grads, buffers, aux) if has_aux else (losses, grads, buffers)

    with_grads.run = run  # type: ignore[attr-defined]  # for HeteroEnsemble's groups
    return with_grads


def grad(
    loss_fn: Callable[..., Any],
    in_dims: InDims = None,
    *,
    has_aux: bool = False,
    randomness: Randomness = "different",
    chunk_size: int | None = None,
) -> Callable[..., tuple[Any, ...]]:
    """Gradients of every member's own loss, in one vectorized call.

    Like [`value_and_grad`][funcensemble.value_and_grad] without the losses.

    Returns:
        A function returning ``(grads, buffers)``, or ``(grads, buffers, aux)`` with
        ``has_aux``.

    Example:
        >>> import torch, funcensemble as fe
        >>> fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 1) for _ in range(4)])
        >>> loss_fn = lambda p, b, x: fmodel(p, b, x).pow(2).mean()
        >>> grads, buffers = fe.grad(loss_fn)(params, buffers, torch.randn(8, 3))
        >>> grads["bias"].shape
        torch.Size([4, 1])
    """
    both = _value_and_grad("grad", loss_fn, in_dims, has_aux, randomness, chunk_size)

    def grads_only(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return both(params, buffers, *args, **kwargs)[1:]

    return grads_only
