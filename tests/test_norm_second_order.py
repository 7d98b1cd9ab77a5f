"""Second derivatives through normalization layers, written per member with
``torch.func.grad`` inside ``fe.value_and_grad``, against the loop's double backward.

torch's batching rules for the LayerNorm/BatchNorm backward kernels give wrong second
derivatives under vmap (pytorch/functorch#534); funcensemble runs those norms as
elementary ops there (``_kernels/norm_decomposed.py``). Those agree with the loop in
float16 and bfloat16 too (outputs and gradients), and refuse what the loop refuses.
"""

import copy

import pytest
import torch
from torch import nn
from torch.func import grad
from torch.nn import functional as F

import funcensemble as fe

N = 3


def models() -> dict[str, callable]:
    return {
        "layernorm": lambda: nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4)),
        "layernorm-no-affine": lambda: nn.Sequential(
            nn.Linear(8, 6), nn.Tanh(), nn.LayerNorm(6, elementwise_affine=False), nn.Linear(6, 4)
        ),
        "layernorm-2d": lambda: nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4)),
        "batchnorm-batch-stats": lambda: nn.Sequential(
            nn.Linear(8, 4), nn.BatchNorm1d(4, track_running_stats=False)
        ),
        "batchnorm-eval": lambda: nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)).eval(),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(models()))
def test_gradient_penalty_through_a_norm_matches_the_loops_double_backward(name, dtype):
    torch.manual_seed(0)
    members = [models()[name]().to(dtype) for _ in range(N)]
    fmodel, params, buffers = fe.stack(members)
    x = torch.randn(*((2,) if name == "layernorm-2d" else ()), 5, 8, dtype=dtype)
    y = torch.randn(N, *x.shape[:-1], 4, dtype=dtype)

    def penalty(p, b, target):  # one member: the squared norm of its loss gradient
        g = grad(lambda q: ((fmodel(q, b, x) - target) ** 2).mean())(p)
        return sum((v**2).sum() for v in g.values())

    losses, got, _ = fe.value_and_grad(penalty, in_dims=(0,))(params, buffers, y)
    tol = {"rtol": 1e-9, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    for i, m in enumerate(members):
        loss = ((m(x) - y[i]) ** 2).mean()
        gs = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        value = sum((v**2).sum() for v in gs)
        want = torch.autograd.grad(value, list(m.parameters()))
        torch.testing.assert_close(losses[i], value.detach(), **tol)
        for (k, _), w in zip(m.named_parameters(), want, strict=True):
            scale = w.abs().max().clamp(min=1.0)
            torch.testing.assert_close(got[k][i] / scale, w / scale, **tol)


def _per_member_grads_and_outputs(fmodel, params, buffers, x):
    """Each member's output and the gradient of its summed squares, with ``torch.func.grad``
    inside ``fe.vmap`` (where the norms run decomposed)."""

    def one(p, b):
        def loss(q):
            out = fmodel(q, b, x)
            return out.float().square().sum(), out

        return grad(loss, has_aux=True)(p)

    return fe.vmap(one)(params, buffers)


def _low_precision_net(kind: str, dtype: torch.dtype, float32_norm: bool) -> nn.Module:
    if kind == "layernorm":
        norm = nn.LayerNorm(16)
    else:
        norm = nn.BatchNorm1d(16, track_running_stats=False)
    net = nn.Sequential(nn.Linear(8, 16, bias=False), norm, nn.Linear(16, 4)).to(dtype)
    if float32_norm:  # the parameter dtype torch's kernels also take for these inputs
        net[1].float()
    return net


@pytest.mark.parametrize("float32_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["layernorm", "batchnorm"])
def test_low_precision_norms_compute_in_float32_as_the_loop(kind, dtype, float32_norm):
    # torch's norm kernels normalize a float16/bfloat16 input in float32; squaring the
    # centered input in float16 overflows past |x - mean| ~ 256.
    torch.manual_seed(0)
    members = [_low_precision_net(kind, dtype, float32_norm) for _ in range(N)]
    x = (torch.randn(32, 8) * 1000).to(dtype)
    h = members[0][0](x).float()
    assert (h - h.mean(-1 if kind == "layernorm" else 0, keepdim=True)).abs().max() > 1000

    fmodel, params, buffers = fe.stack(members)
    grads, outs = _per_member_grads_and_outputs(fmodel, params, buffers, x)

    ulp = torch.finfo(dtype).eps
    for i, m in enumerate(members):
        want = m(x)
        assert outs[i].dtype == want.dtype == dtype
        atol = 2 * ulp * want.float().abs().max().item()
        torch.testing.assert_close(outs[i].float(), want.float(), rtol=0, atol=atol)
        loop = torch.autograd.grad(want.float().square().sum(), list(m.parameters()))
        for (name, p), w in zip(m.named_parameters(), loop, strict=True):
            assert grads[name][i].dtype == p.dtype, name
            atol = 4 * ulp * w.float().abs().max().item()
            torch.testing.assert_close(grads[name][i].float(), w.float(), rtol=0, atol=atol)


def _raises_as_the_loop(members, x, error, match):
    """The loop raises ``error``; so does each member's ``torch.func.grad`` inside
    ``fe.vmap``, with a message matching ``match``."""
    with pytest.raises(error):
        members[0](x)
    fmodel, params, buffers = fe.stack(members)

    def per_member(p, b):
        return grad(lambda q: fmodel(q, b, x).sum())(p)

    with pytest.raises(error, match=match):
        fe.vmap(per_member)(params, buffers)


@pytest.mark.parametrize(
    "norm",
    [
        lambda: nn.LayerNorm(1),
        lambda: nn.LayerNorm(1, elementwise_affine=False),
        lambda: nn.LayerNorm((7,), elementwise_affine=False),
        lambda: nn.LayerNorm((2, 5)),
    ],
)
def test_layer_norm_of_another_shape_than_the_input_is_refused_as_in_the_loop(norm):
    members = [nn.Sequential(nn.Linear(4, 5), norm(), nn.Linear(5, 1)).double() for _ in range(N)]
    x = torch.randn(6, 4, dtype=torch.float64)
    match = r"LayerNorm `1`: the input does not end in normalized_shape=.*got \[6, 5\]"
    _raises_as_the_loop(members, x, RuntimeError, match)


@pytest.mark.parametrize("kind", ["layernorm", "batchnorm"])
def test_norm_parameters_of_another_dtype_than_the_input_are_refused_as_in_the_loop(kind):
    norm = nn.LayerNorm(5) if kind == "layernorm" else nn.BatchNorm1d(5, track_running_stats=False)
    members = [nn.Sequential(copy.deepcopy(norm), nn.Linear(5, 1).double()) for _ in range(N)]
    x = torch.randn(6, 5, dtype=torch.float64)  # float32 norm parameters
    match = r"weight of dtype torch.float32 does not go with an input of dtype torch.float64"
    _raises_as_the_loop(members, x, RuntimeError, match)


def test_batch_norm_of_one_value_per_channel_in_training_is_refused_as_in_the_loop():
    members = [
        nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5, track_running_stats=False)).double()
        for _ in range(N)
    ]
    x = torch.randn(1, 4, dtype=torch.float64)
    match = r"Expected more than 1 value per channel when training, got input size "
    _raises_as_the_loop(members, x, ValueError, match + r"torch.Size\(\[1, 5\]\)")


class _EvalWithoutStatistics(nn.Module):
    """``F.batch_norm`` in eval mode without running statistics, which torch refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(5, track_running_stats=False)

    def forward(self, x):
        return F.batch_norm(x, None, None, self.bn.weight, self.bn.bias, training=False)


def test_batch_norm_in_eval_mode_without_statistics_is_refused_as_in_the_loop():
    members = [_EvalWithoutStatistics().double() for _ in range(N)]
    x = torch.randn(6, 5, dtype=torch.float64)
    _raises_as_the_loop(members, x, RuntimeError, "running_mean must be defined in evaluation")


_LOW = [torch.float16, torch.bfloat16]


def _norm(kind: str, track: bool) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(5)
    if kind == "groupnorm":
        return nn.GroupNorm(1, 5)
    return nn.BatchNorm1d(5, track_running_stats=track)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize(
    ("kind", "track"),
    [("layernorm", True), ("groupnorm", True), ("batchnorm", True), ("batchnorm", False)],
)
@pytest.mark.parametrize(
    ("norm_dtype", "input_dtype"),
    [
        (torch.float32, torch.float64),
        (torch.float64, torch.float32),
        (torch.float16, torch.float32),
    ],
)
def test_norm_dtypes_the_loop_refuses_are_refused_by_a_plain_forward(
    kind, track, train, norm_dtype, input_dtype
):
    # Without a gradient transform vmap's own rules promote (a float64 result where
    # the loop raises "mixed dtype"); the kernels' rule is applied instead.
    members = [_norm(kind, track).to(norm_dtype).train(train) for _ in range(N)]
    x = torch.randn(6, 5, dtype=input_dtype)
    with pytest.raises(RuntimeError):
        members[0](x)
    ens = fe.Ensemble(members)
    before = copy.deepcopy(ens.stacked.state_dict())
    layer = {"layernorm": "LayerNorm", "groupnorm": "GroupNorm"}.get(kind, "BatchNorm1d")
    with pytest.raises(RuntimeError, match=rf"{layer}: \w+ of dtype .* does not go with an input"):
        ens(x)
    fmodel, params, buffers = fe.stack(members)
    with pytest.raises(RuntimeError, match="does not go with an input"):
        fe.vmap(fmodel)(params, buffers, x)
    for k, v in ens.stacked.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing updated before the error


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize(
    ("kind", "track"),
    [("layernorm", True), ("groupnorm", True), ("batchnorm", True), ("batchnorm", False)],
)
@pytest.mark.parametrize("dtype", _LOW)
def test_float32_norms_of_a_low_precision_input_run_as_the_loop(kind, track, train, dtype):
    # The loop's kernels compute in float32 and return the input's dtype, updating
    # float32 running statistics; vmap's rules returned float32 (or raised).
    torch.manual_seed(0)
    members = [_norm(kind, track).train(train) for _ in range(N)]
    for m in members:
        for p in m.parameters():
            p.data.normal_()
        if kind == "batchnorm" and track:
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    x = (torch.randn(6, 5) * 3 + 1).to(dtype)
    loop = copy.deepcopy(members)
    want = torch.stack([m(x) for m in loop])
    ens = fe.Ensemble(members)
    got = ens(x)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    state = ens.stacked.state_dict()
    for i, m in enumerate(loop):
        for k, v in m.state_dict().items():
            assert state[k][i].dtype == v.dtype, k
            torch.testing.assert_close(state[k][i], v, rtol=1e-6, atol=1e-7)


def test_norm_tensors_of_two_dtypes_are_refused_as_in_the_loop():
    # float16 input: a float32 weight and a float16 bias are each allowed, not together.
    ln = nn.LayerNorm(5)
    ln.bias.data = ln.bias.data.half()
    members = [copy.deepcopy(ln) for _ in range(N)]
    x = torch.randn(6, 5, dtype=torch.float16)
    with pytest.raises(RuntimeError):
        members[0](x)
    match = r"LayerNorm: bias of dtype torch.float16 does not go with weight of dtype torch.float32"
    with pytest.raises(RuntimeError, match=match):
        fe.Ensemble(members)(x)
    _raises_as_the_loop(members, x, RuntimeError, "does not go with weight")


def test_a_group_norm_beside_decomposed_norms_is_checked_too():
    # With a LayerNorm decomposed under the grad transform, the dtype check was skipped
    # for the other norm layers: a float64 GroupNorm ran where the loop raises.
    members = [
        nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.GroupNorm(1, 4).double())
        for _ in range(N)
    ]
    x = torch.randn(6, 5)
    _raises_as_the_loop(members, x, RuntimeError, r"GroupNorm `2`: weight of dtype torch.float64")
