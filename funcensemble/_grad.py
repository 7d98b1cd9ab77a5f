"""Per-member losses and gradients of all members in one call."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._vmap import InDims, Randomness, vmap


def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _inside_functorch_transform() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def _check_losses(losses: Any) -> Tensor:
    if not isinstance(losses, Tensor) or losses.dim() != 1:
        shape = tuple(losses.shape[1:]) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(
            f"value_and_grad: loss_fn must return one scalar per member, got {shape} per "
            "member. Reduce the loss (e.g. .mean()) inside loss_fn; with has_aux=True "
            "return (loss, aux)."
        )
    return losses


def _detach(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


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
    statistics in train mode) come back out.

    Every floating-point leaf of ``params`` is differentiated (as in
    ``torch.func.grad``); a parameter the loss does not use gets ``None``, exactly as
    ``torch.autograd.grad(..., allow_unused=True)`` gives, so optimizers skip it.
    Under ``torch.compile`` or inside another ``torch.func`` transform the gradients
    are computed with ``torch.func.grad``, where unused parameters get zeros instead.

    Args:
        loss_fn: The one-member loss.
        in_dims: How the batch arguments are split over members, as in
            [`vmap`][funcensemble.vmap] (``None``: shared, ``0``: one slice each).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back stacked.
        randomness: As in [`vmap`][funcensemble.vmap].
        chunk_size: As in [`vmap`][funcensemble.vmap].

    Returns:
        A function returning ``(losses, grads, buffers)``, or
        ``(losses, grads, buffers, aux)`` with ``has_aux``: ``losses`` has shape
        ``[N]``, ``grads`` is shaped like ``params``.

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
    mapped_loss = vmap(loss_fn, in_dims, randomness=randomness, chunk_size=chunk_size)

    def one_member(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> Any:
        # buffers go in as an argument, not a closure: torch.func.grad forbids in-place
        # updates (BatchNorm statistics) of captured tensors.
        def loss_and_aux(p: Any, b: Any) -> tuple[Tensor, Any]:
            out = loss_fn(p, b, *args, **kwargs)
            return out if has_aux else (out, ())

        return torch.func.grad_and_value(loss_and_aux, has_aux=True)(params, buffers)

    mapped_grad = vmap(one_member, in_dims, randomness=randomness, chunk_size=chunk_size)

    def with_grads(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        buffers = {k: v.clone() for k, v in buffers.items()}
        if torch.compiler.is_compiling() or _inside_functorch_transform():
            grads, (losses, aux) = mapped_grad(params, buffers, *args, **kwargs)
            losses = _check_losses(losses)
        else:
            # Autograd through one vectorized forward: cheaper than torch.func.grad at
            # small N, and it reports unused parameters as None like the loop would.
            with torch.enable_grad():
                leaves = {
                    k: v.detach().requires_grad_(_differentiable(v)) for k, v in params.items()
                }
                out = mapped_loss(leaves, buffers, *args, **kwargs)
                losses, aux = out if has_aux else (out, None)
                losses = _check_losses(losses)
                wrt = [k for k, v in leaves.items() if v.requires_grad]
                found = torch.autograd.grad(
                    losses.sum(), [leaves[k] for k in wrt], allow_unused=True
                )
            grads = dict.fromkeys(params)
            grads.update(zip(wrt, found, strict=True))
            losses, aux = losses.detach(), _detach(aux)
        return (losses, grads, buffers, aux) if has_aux else (losses, grads, buffers)

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
    both = value_and_grad(
        loss_fn, in_dims, has_aux=has_aux, randomness=randomness, chunk_size=chunk_size
    )

    def grads_only(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return both(params, buffers, *args, **kwargs)[1:]

    return grads_only
