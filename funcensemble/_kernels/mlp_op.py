"""The MLP fast path as two opaque custom ops, for ``torch.compile``.

Eagerly, the fast path (``_fastpath``) runs BLAS products and in-place activations
that are already as lean as the hardware allows for small MLPs: the step is bound by
memory traffic. Traced by ``torch.compile``, the same code loses the in-place
activations to functionalization and gains nothing from inductor, which calls the same
BLAS products and fuses only the elementwise ops around them: the compiled step ended
up slower than the eager one. Under compilation the whole chain is therefore one
custom op (and its backward another): inductor keeps the eager kernels for the MLP
and still fuses everything around it (the loss, the optimizer update).

Like the eager fast path, the ops write their large results into buffers kept across
steps (``_workspace``), handed out again only once nothing holds them: without, each
compiled step paid a page fault per 4 KiB of every fresh output (938 a step at S, 128
members).

Chains with an activation whose derivative needs its input (GELU, SiLU, ...) are not
handled here; they keep the traced path.
"""

import torch
from torch import Tensor, nn

from . import tanh as _tanh
from . import workspace as _workspace

# Activation codes: how the op's integer list names what follows each Linear.
NONE, TANH, SIGMOID, RELU = 0, 1, 2, 3
_CODES = {nn.Tanh: TANH, nn.Sigmoid: SIGMOID, nn.ReLU: RELU}
_SKIPPED = (nn.Identity, nn.Dropout)  # run() refuses train-mode dropout with p > 0


def layers(steps: list) -> tuple[list[str], list[str | None], list[int]] | None:
    """``(weight names, bias names, activation codes)`` of a chain the op can run."""
    weights: list[str] = []
    biases: list[str | None] = []
    acts: list[int] = []
    for module, weight, bias in steps:
        kind = type(module)
        if weight is not None:
            weights.append(weight)
            biases.append(bias)
            acts.append(NONE)
        elif kind in _SKIPPED:
            continue
        elif kind in _CODES and acts and acts[-1] == NONE:
            acts[-1] = _CODES[kind]
        else:
            return None  # an activation before any Linear, two in a row, or another kind
    return weights, biases, acts


def _activate_(z: Tensor, act: int) -> Tensor:
    if act == TANH:
        return _tanh.tanh_(z)
    if act == SIGMOID:
        return z.sigmoid_()
    if act == RELU:
        return z.relu_()
    return z


def _activation_grad_(g: Tensor, y: Tensor, act: int) -> Tensor:
    """The gradient through the activation, written over ``g`` (a fresh intermediate of
    the backward, never an input): one 4 MiB allocation less per hidden layer at S."""
    if act == TANH:
        return torch.ops.aten.tanh_backward.grad_input(g, y, grad_input=g)
    if act == SIGMOID:
        return torch.ops.aten.sigmoid_backward.grad_input(g, y, grad_input=g)
    if act == RELU:
        return torch.ops.aten.threshold_backward.grad_input(g, y, 0, grad_input=g)
    return g


def _activation_grad(g: Tensor, y: Tensor, act: int) -> Tensor:
    if act == TANH:
        return torch.ops.aten.tanh_backward(g, y)
    if act == SIGMOID:
        return torch.ops.aten.sigmoid_backward(g, y)
    if act == RELU:
        return torch.ops.aten.threshold_backward(g, y, 0)
    return g


# The schemas are written out: torch < 2.7 cannot infer one from ``list[Tensor]``
# annotations (it accepts only ``typing.List``), and a written schema reads the same on
# every version.
@torch.library.custom_op(
    "funcensemble::mlp_forward",
    mutates_args=(),
    schema="(Tensor x, Tensor[] weights, Tensor[] biases, bool[] has_bias, int[] acts) -> Tensor[]",
)
def mlp_forward(
    x: Tensor, weights: list[Tensor], biases: list[Tensor], has_bias: list[bool], acts: list[int]
) -> list[Tensor]:
    """All members' MLP on ``x``: ``[rows, in]`` (shared) or ``[N, rows, in]``.

    Returns ``[out, *activations]``: the output ``[N, rows, out]`` and each hidden
    layer's activated output, feature-major ``[N, features, rows]`` (the backward's
    inputs). ``biases`` holds the present biases only, in order.
    """
    n = weights[0].shape[0]
    shared = x.dim() == 2
    h = x.t() if shared else x.transpose(1, 2)
    hidden: list[Tensor] = []
    b = iter(biases)
    for i, (w, with_bias, act) in enumerate(zip(weights, has_bias, acts, strict=True)):
        bias = next(b) if with_bias else None
        # Kept buffers (see _workspace): the op's outputs are the same values as fresh
        # ones, without a page fault per 4 KiB of each on every step.
        if i == 0 and shared:
            w2 = w.reshape(-1, w.shape[-1])
            z = _workspace.empty((w2.shape[0], h.shape[-1]), h)
            if bias is None:
                torch.mm(w2, h, out=z)
            else:
                torch.addmm(bias.reshape(-1, 1), w2, h, out=z)
            z = z.view(n, w.shape[1], z.shape[-1])  # sizes spelled out: rows may be 0
        else:
            z = _workspace.empty((n, w.shape[1], h.shape[-1]), h)
            if bias is None:
                torch.bmm(w, h, out=z)
            else:
                torch.baddbmm(bias.unsqueeze(2), w, h, out=z)
        h = _activate_(z, act)
        if i < len(weights) - 1:
            hidden.append(h)
    return [h.transpose(1, 2).contiguous(), *hidden]


@mlp_forward.register_fake
def _(x, weights, biases, has_bias, acts):
    n, rows = weights[0].shape[0], x.shape[-2]
    out = [x.new_empty(n, rows, weights[-1].shape[1])]
    return out + [x.new_empty(n, w.shape[1], rows) for w in weights[:-1]]


@torch.library.custom_op(
    "funcensemble::mlp_backward",
    mutates_args=(),
    schema="(Tensor grad, Tensor out, Tensor x, Tensor[] weights, Tensor[] hidden, "
    "bool[] has_bias, int[] acts, bool need_x) -> Tensor[]",
)
def mlp_backward(
    grad: Tensor,
    out: Tensor,
    x: Tensor,
    weights: list[Tensor],
    hidden: list[Tensor],
    has_bias: list[bool],
    acts: list[int],
    need_x: bool,
) -> list[Tensor]:
    """``[grad_x (empty unless need_x), *grad_weights, *grad_biases (present ones)]``."""
    shared = x.dim() == 2
    inputs = [x.t() if shared else x.transpose(1, 2), *hidden]
    outputs = [*hidden, out.transpose(1, 2)]
    g = grad.transpose(1, 2)  # feature-major, like the activations
    grad_w: list[Tensor] = [x.new_empty(0)] * len(weights)
    grad_b: list[Tensor] = []
    grad_x = x.new_empty(0)
    for i in reversed(range(len(weights))):
        w, h = weights[i], inputs[i]
        if i == len(weights) - 1:
            g = _activation_grad(g, outputs[i], acts[i])  # g is the caller's gradient
        else:
            g = _activation_grad_(g, outputs[i], acts[i])  # g: our bmm of the last iteration
        if has_bias[i]:
            grad_b.append(g.sum(-1))
        if i == 0 and shared:
            g2 = g.reshape(g.shape[0] * g.shape[1], g.shape[-1])  # [N * out, rows]
            gw = _workspace.empty((g2.shape[0], h.shape[0]), w)
            # g @ x as g @ (x^T, row-major)^T, the orientation the eager layers use: on
            # x itself MKL's narrow [N * out, in] product is 2.2x slower (S: 0.62 ms).
            grad_w[i] = torch.mm(g2, h.contiguous().t(), out=gw).view_as(w)
            if need_x:
                grad_x = torch.mm(g2.t(), w.reshape(-1, w.shape[-1]))  # [rows, in]
        else:
            gw = _workspace.empty(tuple(w.shape), w)
            grad_w[i] = torch.bmm(g, h.transpose(1, 2), out=gw)
            if i > 0:
                # Kept buffers, as in the forward; this one is overwritten in place by
                # the next layer's activation gradient and never leaves the op.
                gh = _workspace.empty((g.shape[0], w.shape[-1], g.shape[-1]), g)
                g = torch.bmm(w.transpose(1, 2), g, out=gh)
            elif need_x:
                grad_x = torch.bmm(w.transpose(1, 2), g).transpose(1, 2).contiguous()
    return [grad_x, *grad_w, *reversed(grad_b)]


@mlp_backward.register_fake
def _(grad, out, x, weights, hidden, has_bias, acts, need_x):
    grad_x = torch.empty_like(x) if need_x else x.new_empty(0)
    grad_b = [
        w.new_empty(w.shape[0], w.shape[1]) for w, b in zip(weights, has_bias, strict=True) if b
    ]
    return [grad_x, *[torch.empty_like(w) for w in weights], *grad_b]


def _setup_context(ctx, inputs, output):
    x, weights, _, has_bias, acts = inputs
    ctx.has_bias, ctx.acts = has_bias, acts
    ctx.num_weights = len(weights)
    ctx.save_for_backward(x, output[0], *weights, *output[1:])


def _backward(ctx, grads):
    x, out, *rest = ctx.saved_tensors
    weights, hidden = rest[: ctx.num_weights], rest[ctx.num_weights :]
    need_x = ctx.needs_input_grad[0]
    found = mlp_backward(
        grads[0], out, x, list(weights), list(hidden), ctx.has_bias, ctx.acts, need_x
    )
    grad_x = found[0] if need_x else None
    grad_w = found[1 : 1 + ctx.num_weights]
    grad_b = found[1 + ctx.num_weights :]
    return grad_x, list(grad_w), list(grad_b), None, None


mlp_forward.register_autograd(_backward, setup_context=_setup_context)
