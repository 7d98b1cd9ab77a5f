"""vmap rules for the stacked MLP ops, for a ``vmap`` around funcensemble's own.

The ops of ``_mlp_op`` take every member at once (weights ``[N, out, in]``). Under
``torch.compile`` a one-member call inside ``fe.value_and_grad`` or ``fe.vmap`` becomes
them (``_mlp_member_op``); a user's ``torch.func.vmap`` around that (over seeds, data
sets, ...) then batches the stacked ops too. Their rule folds the outer batch into the
member axis: ``B`` batches of ``N`` members are ``B * N`` members.
"""

from torch import Tensor

from . import mlp_op as _mlp_op


def _num_members(weight: Tensor, dim: int | None) -> int:
    """N, from a weight ``[N, out, in]`` batched at ``dim`` (or not batched)."""
    return weight.shape[0] if dim is None else weight.movedim(dim, 0).shape[1]


def _members(t: Tensor, dim: int | None, b: int, n: int) -> Tensor:
    """A ``[N, ...]`` tensor batched at ``dim`` (or shared: ``None``) as ``[B * N, ...]``."""
    t = t.expand(b, *t.shape) if dim is None else t.movedim(dim, 0)
    return t.reshape(b * n, *t.shape[2:])


def _input(x: Tensor, dim: int | None, b: int, n: int, *, keep_shared: bool) -> Tensor:
    """``x`` (``[rows, in]`` shared by the members, or ``[N, rows, in]``) for ``B * N``
    members: still 2-d if every member of every batch shares it and ``keep_shared``."""
    shared = x.dim() - (dim is not None) == 2
    if shared and dim is None and keep_shared:
        return x
    if dim is None:
        x = x.expand(b, *x.shape)
    else:
        x = x.movedim(dim, 0)
    if shared:  # [B, rows, in]: the same rows for every member of a batch
        x = x.unsqueeze(1).expand(b, n, *x.shape[1:])
    return x.reshape(b * n, *x.shape[2:])


@_mlp_op.mlp_forward.register_vmap
def _(info, in_dims, x, weights, biases, has_bias, acts):
    b = info.batch_size
    x_dim, w_dims, b_dims, _, _ = in_dims
    n = _num_members(weights[0], w_dims[0])
    outs = _mlp_op.mlp_forward(
        _input(x, x_dim, b, n, keep_shared=True),
        [_members(w, d, b, n) for w, d in zip(weights, w_dims, strict=True)],
        [_members(t, d, b, n) for t, d in zip(biases, b_dims, strict=True)],
        has_bias,
        acts,
    )
    return [o.view(b, n, *o.shape[1:]) for o in outs], [0] * len(outs)


@_mlp_op.mlp_backward.register_vmap
def _(info, in_dims, grad, out, x, weights, hidden, has_bias, acts, need_x):
    b = info.batch_size
    g_dim, o_dim, x_dim, w_dims, h_dims = in_dims[:5]
    n = _num_members(weights[0], w_dims[0])
    shared = x.dim() - (x_dim is not None) == 2
    found = _mlp_op.mlp_backward(
        _members(grad, g_dim, b, n),
        _members(out, o_dim, b, n),
        # A shared input's gradient is the sum over a batch's members, not over all B * N.
        _input(x, x_dim, b, n, keep_shared=not need_x),
        [_members(w, d, b, n) for w, d in zip(weights, w_dims, strict=True)],
        [_members(h, d, b, n) for h, d in zip(hidden, h_dims, strict=True)],
        has_bias,
        acts,
        need_x,
    )
    grad_x, rest = found[0], found[1:]
    if need_x:
        grad_x = grad_x.view(b, n, *grad_x.shape[1:])
        grad_x = grad_x.sum(1) if shared else grad_x
    rest = [g.view(b, n, *g.shape[1:]) for g in rest]
    return [grad_x, *rest], [0 if need_x else None] + [0] * len(rest)
