"""Per-member losses and gradients of a ``HeteroEnsemble``: ``value_and_grad`` per group."""

from collections.abc import Callable
from typing import Any

from .._core import in_dims as _in_dims
from .._core.call_arguments import arguments_error, refuse_an_ensemble
from .._core.grad import _trainable, _value_and_grad, any_marked
from .._core.in_dims import InDims
from .._core.rollback import rollback_on_error
from .._core.stack import check_state_dicts
from . import group_errors
from .grouping import regroup

_LEADING = ("fmodel", "params", "buffers")  # what loss_fn is given before the inputs
_LOSS_FIX = (
    "Every member's loss (and aux) is stacked in member order: return one shape and "
    "dtype from every member (e.g. cast with .to(torch.float64), or pad the aux)."
)


def grouped_value_and_grad(
    hens: Any, loss_fn: Callable[..., Any], in_dims: InDims, has_aux: bool
) -> Callable[..., tuple[Any, ...]]:
    """``HeteroEnsemble.value_and_grad`` (see there): one ``value_and_grad`` per group."""
    where = "HeteroEnsemble.value_and_grad"
    if not callable(loss_fn):
        raise TypeError(
            f"{where}: loss_fn must be callable (expected a function returning one loss per "
            f"member, got {type(loss_fn).__name__}). Pass the loss function itself."
        )
    refuse_an_ensemble(where, "loss_fn", loss_fn, with_fmodel=True)
    _in_dims.check_type(where, in_dims)

    def for_group(ens: Any) -> Callable[..., tuple[Any, ...]]:
        fmodel = ens.fmodel

        def group_loss(p: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return loss_fn(fmodel, p, b, *args, **kwargs)
            except TypeError as error:  # (a loss written without fmodel: say so)
                unfit = arguments_error(where, loss_fn, args, kwargs, _LEADING)
                if unfit is None:
                    raise
                raise unfit.with_traceback(error.__traceback__) from None

        return _value_and_grad(
            where,
            group_loss,
            in_dims,
            has_aux,
            ens.randomness,
            ens.chunk_size,
        ).run

    per_group = [for_group(ens) for ens in hens.groups]

    def with_grads(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        p_parts = hens._split(where, "params", params, "params")
        b_parts = hens._split(where, "buffers", buffers, "buffers")
        dims = hens._dims(where, in_dims, args)
        # Which leaves are trainable is decided over the whole ensemble, as the loop's
        # torch.autograd.grad over its trainable parameters: a group of frozen members
        # gets None gradients, not the "no leaf marked: every leaf" of a lone ensemble.
        marked = any_marked(params)
        results = []
        # One transaction over the groups: a later group's failure (or the losses'
        # refusal to stack) puts back what an earlier group wrote in place into the
        # params given (Embedding(max_norm)'s renormalised rows), as for one ensemble.
        with rollback_on_error({}):
            for g, (fn, p, b) in enumerate(zip(per_group, p_parts, b_parts, strict=True)):
                check_state_dicts(where, p, b)
                trainable = _trainable(p, any_marked=marked)
                members = hens.group_members[g]
                with group_errors.naming(where, g, members, len(per_group)):
                    results.append(fn(p, b, trainable, hens._inputs(g, args, dims), kwargs))
            members = hens.group_members
            losses = regroup(where, "loss", [r[0] for r in results], members, _LOSS_FIX)
            aux = (
                regroup(where, "aux", [r[3] for r in results], members, _LOSS_FIX)
                if has_aux
                else None
            )
        grads = hens._join([r[1] for r in results])
        new_buffers = hens._join([r[2] for r in results])
        if not has_aux:
            return losses, grads, new_buffers
        return losses, grads, new_buffers, aux

    return with_grads
