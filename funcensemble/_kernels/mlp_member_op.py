"""One member's plain MLP as a call that ``torch.func`` transforms turn into the stacked ops.

Under ``torch.compile`` the functional face (``fe.value_and_grad``, or any
``torch.func.vmap``/``grad`` around ``fmodel``) calls ``fmodel`` once per member inside
``vmap(grad(...))``. Dynamo traces through those transforms, so the fast path's eager
batching rule (``_fastpath._batched_call``, which unwraps functorch's tensors by hand)
cannot run there. Instead the one-member chain is [`member_mlp`][], an
``autograd.Function`` whose ``vmap`` rule runs the stacked op of ``_mlp_op``
(``funcensemble::mlp_forward``) on the members' weights as stacked, and whose backward
(under ``torch.func.grad``) is another ``autograd.Function`` whose ``vmap`` rule runs
``funcensemble::mlp_backward``. The rules call the stacked ops through
``autograd.Function`` s of their own, whose autograd also runs under a
``torch.func.grad`` around the ``vmap`` (a custom op's registered autograd cannot).
``torch.compiler.allow_in_graph`` keeps Dynamo from inlining them (it would trace the
one-member forward and drop the rules); AOTAutograd then runs the transforms' rules,
and the compiled graph holds the two stacked ops, which run the eager kernels. Second
derivatives through them are refused with a clear error.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import mlp_op as _mlp_op
from . import mlp_op_vmap as _mlp_op_vmap  # noqa: F401 (registers the stacked ops' vmap rules)


def _stacked(t: Tensor, dim: int | None, size: int) -> Tensor:
    """``t`` with its member dim first; a tensor all members share is expanded (a view)."""
    return t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)


def _all_stacked(ts: Sequence[Tensor], dims: Sequence[int | None], size: int) -> list[Tensor]:
    return [_stacked(t, d, size) for t, d in zip(ts, dims, strict=True)]


def _save_for_backward(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    """The forwards' ``setup_context``: the input, the output, the weights and the hidden
    activations (which are for backward only, not differentiable outputs)."""
    x, has_bias, acts, num_w, *params = inputs
    ctx.has_bias, ctx.acts, ctx.num_w = has_bias, acts, num_w
    ctx.save_for_backward(x, output[0], *params[:num_w], *output[1:])
    ctx.mark_non_differentiable(*output[1:])


def _backward_by(backward: type[torch.autograd.Function], ctx: Any, grad: Tensor) -> tuple:
    """The forwards' ``backward``: ``backward.apply`` on what ``_save_for_backward`` kept."""
    x, out, *rest = ctx.saved_tensors
    weights, hidden = rest[: ctx.num_w], rest[ctx.num_w :]
    need_x = ctx.needs_input_grad[0]
    found = backward.apply(
        grad, out, x, ctx.has_bias, ctx.acts, need_x, ctx.num_w, *weights, *hidden
    )
    return (found[0] if need_x else None, None, None, None, *found[1:])


class _StackedForward(torch.autograd.Function):
    """``_mlp_op.mlp_forward`` with an autograd that ``torch.func.grad`` can run (a
    ``torch.func.grad`` around the vmap that reached the stacked op): a custom op's
    registered autograd cannot run under it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, has_bias: list[bool], acts: list[int], num_w: int, *params: Tensor):
        outs = _mlp_op.mlp_forward(x, list(params[:num_w]), list(params[num_w:]), has_bias, acts)
        return tuple(outs)

    setup_context = staticmethod(_save_for_backward)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        return _backward_by(_StackedBackward, ctx, grad)


class _StackedBackward(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(grad, out, x, has_bias, acts, need_x, num_w, *rest):
        weights, hidden = list(rest[:num_w]), list(rest[num_w:])
        return tuple(_mlp_op.mlp_backward(grad, out, x, weights, hidden, has_bias, acts, need_x))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        _refuse_second_derivatives()


def _refuse_second_derivatives() -> None:
    raise RuntimeError(
        "funcensemble: second derivatives through a plain MLP's fast path under "
        "torch.compile are not supported (expected first derivatives only, got a "
        "derivative of the gradient). Compute them without torch.compile."
    )


class _Forward(torch.autograd.Function):
    """``(x [rows, in], *weights [out, in], *biases [out]) -> (out [rows, out], *hidden)``,
    ``hidden`` each hidden layer's activated output ``[features, rows]`` (for backward)."""

    @staticmethod
    def forward(x: Tensor, has_bias: list[bool], acts: list[int], num_w: int, *params: Tensor):
        weights, biases = params[:num_w], params[num_w:]
        outs = _mlp_op.mlp_forward(
            x, [w.unsqueeze(0) for w in weights], [b.unsqueeze(0) for b in biases], has_bias, acts
        )
        return tuple(o.squeeze(0) for o in outs)

    setup_context = staticmethod(_save_for_backward)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        return _backward_by(_Backward, ctx, grad)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x, has_bias, acts, num_w, *params):
        n = info.batch_size
        x_dim, _, _, _, *p_dims = in_dims
        # An input all members share stays 2-d: the stacked op's first layer is then
        # one matrix product over all members' weights.
        x = x if x_dim is None else x.movedim(x_dim, 0)
        outs = _StackedForward.apply(x, has_bias, acts, num_w, *_all_stacked(params, p_dims, n))
        return outs, (0,) * len(outs)


class _Backward(torch.autograd.Function):
    """``(grad, out, x, *weights, *hidden) -> (grad_x, *grad_weights, *grad_biases)``,
    one member's; ``grad_x`` is empty unless ``need_x``."""

    @staticmethod
    def forward(grad, out, x, has_bias, acts, need_x, num_w, *rest):
        weights, hidden = rest[:num_w], rest[num_w:]
        found = _mlp_op.mlp_backward(
            grad.unsqueeze(0),
            out.unsqueeze(0),
            x,
            [w.unsqueeze(0) for w in weights],
            [h.unsqueeze(0) for h in hidden],
            has_bias,
            acts,
            need_x,
        )
        return (found[0], *(g.squeeze(0) for g in found[1:]))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        _refuse_second_derivatives()

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], grad, out, x, has_bias, acts, need_x, num_w, *rest
    ):
        n = info.batch_size
        g_dim, o_dim, x_dim, _, _, _, _, *r_dims = in_dims
        if x_dim is not None:
            x = x.movedim(x_dim, 0)
        elif need_x:
            # For a 2-d input the stacked op sums the gradient over members; vmap asks
            # for each member's own.
            x = x.expand(n, *x.shape)
        found = _StackedBackward.apply(
            _stacked(grad, g_dim, n),
            _stacked(out, o_dim, n),
            x,
            has_bias,
            acts,
            need_x,
            num_w,
            *_all_stacked(rest, r_dims, n),
        )
        return found, (0 if need_x else None,) + (0,) * (len(found) - 1)


@torch.compiler.allow_in_graph
def member_mlp(
    x: Tensor,
    weights: list[Tensor],
    biases: list[Tensor],
    has_bias: list[bool],
    acts: list[int],
) -> Tensor:
    """One member's MLP on ``x: [rows, in]``: ``[rows, out]``.

    ``weights[i]: [out_i, in_i]``; ``biases`` the present biases only, in order;
    ``has_bias`` and ``acts`` as for ``_mlp_op.mlp_forward``.
    """
    return _Forward.apply(x, has_bias, acts, len(weights), *weights, *biases)[0]
