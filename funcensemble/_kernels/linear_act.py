"""One stacked Linear and the activation after it, as an autograd.Function on kept buffers.

The MLP fast path (``_fastpath``) runs each layer feature-major: ``act(W @ h + b)`` with
``W: [N, out, in]`` and ``h: [N, in, rows]`` (or ``[in, rows]`` shared by all members).
Through plain autograd, every step allocates the layer's output, the gradient of its
pre-activation and the gradient of its input afresh; on CPU those are the megabyte
tensors that glibc serves from fresh pages (see ``_workspace``). Here the same kernels
(``addmm``/``baddbmm``, the activation in place, ``tanh_backward`` and kin, ``mm``/``bmm``)
write into workspace buffers instead, so a step's results are those of the plain ops.

Backward with ``create_graph=True`` runs the same formulas as differentiable ops on
fresh tensors (the saved input and output are connected to the graph), so double
backward sees what autograd's own ops give.
"""

from typing import Any

import torch
from torch import Tensor, nn

from .. import _torch_compat
from . import tanh as _tanh
from . import workspace as _workspace

# Activations whose derivative is a function of their output, applied in place.
ACTIVATIONS: dict[type, str] = {nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.ReLU: "relu"}

_IN_PLACE = {"tanh": _tanh.tanh_, "sigmoid": torch.sigmoid_, "relu": torch.relu_}


def _act_backward(act: str, g: Tensor, y: Tensor, out: Tensor | None) -> Tensor:
    """``dL/dz`` from ``dL/dy`` and ``y = act(z)``, the kernels autograd itself runs."""
    ops = torch.ops.aten
    if act == "tanh":
        return (
            ops.tanh_backward(g, y)
            if out is None
            else ops.tanh_backward.grad_input(g, y, grad_input=out)
        )
    if act == "sigmoid":
        return (
            ops.sigmoid_backward(g, y)
            if out is None
            else ops.sigmoid_backward.grad_input(g, y, grad_input=out)
        )
    # relu_'s derivative, as autograd records it for relu: zero where the output is <= 0.
    return (
        ops.threshold_backward(g, y, 0)
        if out is None
        else ops.threshold_backward.grad_input(g, y, 0, grad_input=out)
    )


def layer(h: Tensor, w: Tensor, b: Tensor | None, act: str | None) -> Tensor:
    """``act(W @ h + b)`` feature-major, written into a kept buffer: ``LinearAct``'s
    forward, and the whole layer where nothing needs a gradient (no graph to record:
    ``autograd.Function.apply`` cost more than the layer's own Python at inference)."""
    n, d_out, d_in = w.shape
    if h.dim() == 2:  # shared input: all members' weights as one [N * out, in] matrix
        z = _workspace.empty((n * d_out, h.shape[1]), h)
        w2 = w.reshape(n * d_out, d_in)
        if b is None:
            torch.mm(w2, h, out=z)
        else:
            torch.addmm(b.reshape(-1, 1), w2, h, out=z)
    else:
        z = _workspace.empty((n, d_out, h.shape[2]), h)
        if b is None:
            torch.bmm(w, h, out=z)
        else:
            torch.baddbmm(b.unsqueeze(2), w, h, out=z)
    if act is not None:
        _IN_PLACE[act](z)
    return z


def recorded(*tensors: Tensor | None) -> bool:
    """Whether autograd records a graph through a layer of these inputs."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class LinearAct(torch.autograd.Function):
    """``act(W @ h + b)`` feature-major; ``act`` one of ``ACTIVATIONS`` or None.

    ``forward`` takes ``ctx`` (no ``setup_context``): that form costs an
    ``inspect.signature`` per call, a third of a small ensemble's step. The fast path
    never applies it inside a ``torch.func`` transform, which would need the other form.
    """

    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, b: Tensor | None, act: str | None) -> Tensor:  # type: ignore[override]
        z = layer(h, w, b, act)
        # Only what the gradients asked for need, as torch's addmm saves: the weight for
        # the input's gradient, the input for the weight's, and the output where the
        # activation's derivative reads it. A tensor not saved stays free for the
        # caller's in-place ops between forward and backward, as in the loop (the
        # first layer's weight stepped between two backward passes, a bare layer's
        # output changed in place).
        need_h, need_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(
            h if need_w else None, w if need_h else None, z if act is not None else None
        )
        ctx.shapes = (tuple(h.shape), tuple(w.shape))
        ctx.act = act
        ctx.has_bias = b is not None
        return z

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        h, w, y = ctx.saved_tensors
        h_shape, (n, d_out, d_in) = ctx.shapes
        # With create_graph, fresh tensors only: the graph built here keeps them. Under a
        # transform (is_grads_batched, vectorized jacobians run the backward in vmap) the
        # out= kernels have no batching rule: fresh tensors too.
        reuse = (
            not torch.is_grad_enabled()
            and not _torch_compat.inside_transform()
            and not _torch_compat.is_legacy_batched(g)
        )
        if ctx.act is None:
            gz = g
        else:
            gz = _act_backward(
                ctx.act, g, y, _workspace.empty(tuple(y.shape), y) if reuse else None
            )
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = gw = gb = None
        if len(h_shape) == 2:
            if need_h:
                w2 = w.reshape(n * d_out, d_in)
                gh = (
                    w2.t().mm(gz)
                    if not reuse
                    else torch.mm(w2.t(), gz, out=_workspace.empty(h_shape, gz))
                )
            if need_w:
                gw = (
                    gz.mm(h.t())
                    if not reuse
                    else torch.mm(gz, h.t(), out=_workspace.empty((n * d_out, d_in), gz))
                ).view(n, d_out, d_in)
            if need_b and ctx.has_bias:
                gb = gz.sum(1).view(n, d_out)
        else:
            if need_h:
                gh = (
                    w.transpose(1, 2).bmm(gz)
                    if not reuse
                    else torch.bmm(w.transpose(1, 2), gz, out=_workspace.empty(h_shape, gz))
                )
            if need_w:
                gw = (
                    gz.bmm(h.transpose(1, 2))
                    if not reuse
                    else torch.bmm(
                        gz, h.transpose(1, 2), out=_workspace.empty((n, d_out, d_in), gz)
                    )
                )
            if need_b and ctx.has_bias:
                gb = gz.sum(2)
        return gh, gw, gb, None
