"""The stacked MLP ops under a user's own vmap: each batch as its own call (float64)."""

import pytest
import torch

from funcensemble._kernels import mlp_op as _mlp_op

B, N, ROWS = 3, 4, 5
TOL = {"rtol": 1e-12, "atol": 1e-12}
HAS_BIAS, ACTS = [True, False], [1, 0]  # Linear(6, 7)-Tanh-Linear(7, 2, bias=False)


def args(batched_x: bool, shared_x: bool, batched_w: bool):
    torch.manual_seed(0)
    lead = (B,) if batched_w else ()
    weights = [torch.randn(*lead, N, 7, 6).double(), torch.randn(*lead, N, 2, 7).double()]
    biases = [torch.randn(*lead, N, 7).double()]
    x_shape = (ROWS, 6) if shared_x else (N, ROWS, 6)
    x = torch.randn(*((B,) if batched_x else ()), *x_shape).double()
    return x, weights, biases


@pytest.mark.parametrize("batched_x", [True, False])
@pytest.mark.parametrize("shared_x", [True, False])
@pytest.mark.parametrize("batched_w", [True, False])
@pytest.mark.parametrize("need_x", [True, False])
def test_vmap_of_the_stacked_ops_is_a_loop_over_the_batch(batched_x, shared_x, batched_w, need_x):
    if not (batched_x or batched_w):
        pytest.skip("nothing batched")
    x, weights, biases = args(batched_x, shared_x, batched_w)
    x_dim, w_dim = (0 if batched_x else None), (0 if batched_w else None)

    def forward(x, weights, biases):
        return _mlp_op.mlp_forward(x, weights, biases, HAS_BIAS, ACTS)

    got = torch.func.vmap(forward, in_dims=(x_dim, w_dim, w_dim))(x, weights, biases)

    def pick(t, dim, i):
        return t if dim is None else t[i]

    for i in range(B):
        want = forward(
            pick(x, x_dim, i), [pick(w, w_dim, i) for w in weights], [pick(biases[0], w_dim, i)]
        )
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g[i], w, **TOL)
    grad = torch.randn(B, N, ROWS, 2).double()

    def backward(grad, out, x, weights, hidden):
        return _mlp_op.mlp_backward(grad, out, x, weights, hidden, HAS_BIAS, ACTS, need_x)

    found = torch.func.vmap(backward, in_dims=(0, 0, x_dim, w_dim, 0))(
        grad, got[0], x, weights, got[1:]
    )
    for i in range(B):
        want = backward(
            grad[i], got[0][i], pick(x, x_dim, i), [pick(w, w_dim, i) for w in weights],
            [h[i] for h in got[1:]],
        )  # fmt: skip
        if need_x:
            torch.testing.assert_close(found[0][i], want[0], **TOL)
        for g, w in zip(found[1:], want[1:], strict=True):
            torch.testing.assert_close(g[i], w, **TOL)
