"""CPU autocast's per-op policy inside vmap (``_kernels/autocast_policy.py``): each op of
its table, under ``torch.autocast("cpu", dtype=torch.bfloat16)``, in a member's forward,
in a function mapped by ``fe.vmap`` and in ``fe.value_and_grad``'s loss, gives the
loop's dtype and bits. ``p`` is a member's float32 parameter, ``x`` a shared float32
input and ``h = p @ x`` a bfloat16 activation (autocast runs ``mm`` in bfloat16)."""

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import funcensemble as fe
from funcensemble._core import vmap as _vmap
from funcensemble._kernels import autocast_policy

N = 3


def _h(p: Tensor, x: Tensor) -> Tensor:
    return p @ x


def _spd(p: Tensor, x: Tensor) -> Tensor:
    h = _h(p, x)
    return h @ h.T + 8 * torch.eye(8, dtype=h.dtype)


def _labels() -> Tensor:
    return torch.tensor([0, 3, 1, 7, 2, 5, 4, 6])


# name -> the member's computation, f(p, x).
CASES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    # lower precision
    "linalg.vecdot": lambda p, x: torch.linalg.vecdot(p, x),
    "prelu": lambda p, x: F.prelu(p * x, p[0, :1]),
    "Tensor.prelu": lambda p, x: (p * x).prelu(p[0]),
    "scaled_dot_product_attention": lambda p, x: F.scaled_dot_product_attention(
        p[None], x[None], x[None]
    ),
    # lower precision, rounded once
    "addmm": lambda p, x: torch.addmm(p[0], x, p),
    "Tensor.addmm": lambda p, x: p.addmm(x, x, beta=0.5, alpha=2.0),
    "baddbmm": lambda p, x: torch.baddbmm(p[None], x[None], p[None]),
    "Tensor.baddbmm": lambda p, x: p[None].baddbmm(x[None], p[None]),
    "linear": lambda p, x: F.linear(x, p, p[0]),
    "linear-3d": lambda p, x: F.linear(x.reshape(2, 4, 8), p, p[0]),
    "linear-1d": lambda p, x: F.linear(x[0], p),
    "conv1d": lambda p, x: F.conv1d(x[None], p[..., None], p[0]),
    "conv2d": lambda p, x: F.conv2d(x[None, None], p[None, None, :3, :3], p[0, :1]),
    "conv3d": lambda p, x: F.conv3d(
        x.reshape(1, 1, 4, 4, 4), p.reshape(1, 1, 4, 4, 4)[..., :2, :2, :2]
    ),
    "conv_transpose1d": lambda p, x: F.conv_transpose1d(x[None], p[..., None], p[0]),
    "conv_transpose2d": lambda p, x: F.conv_transpose2d(x[None, None], p[None, None, :3, :3]),
    "conv_transpose3d": lambda p, x: F.conv_transpose3d(
        x.reshape(1, 1, 4, 4, 4), p.reshape(1, 1, 4, 4, 4)[..., :2, :2, :2]
    ),
    # autocast off
    "mv": lambda p, x: torch.mv(p, x[0]),
    "Tensor.mv": lambda p, x: p.mv(x[0]),
    "dot": lambda p, x: torch.dot(p[0], x[0]),
    "Tensor.dot": lambda p, x: p[0].dot(x[0]),
    "vdot": lambda p, x: torch.vdot(p[0], x[0]),
    "Tensor.vdot": lambda p, x: p[0].vdot(x[0]),
    "addmv": lambda p, x: torch.addmv(p[1], p, x[0]),
    "Tensor.addmv": lambda p, x: p[1].addmv(p, x[0]),
    "inner": lambda p, x: torch.inner(p[0], x[0]),
    "Tensor.inner": lambda p, x: p[0].inner(x[0]),
    # float32
    "cross_entropy": lambda p, x: F.cross_entropy(_h(p, x), _labels()),
    "nll_loss": lambda p, x: F.nll_loss(_h(p, x), _labels()),
    "l1_loss": lambda p, x: F.l1_loss(_h(p, x), _h(x, p)),
    "binary_cross_entropy_with_logits": lambda p, x: F.binary_cross_entropy_with_logits(
        _h(p, x), x.sigmoid()
    ),
    "poisson_nll_loss": lambda p, x: F.poisson_nll_loss(_h(p, x), x.abs()),
    "hinge_embedding_loss": lambda p, x: F.hinge_embedding_loss(_h(p, x), x.sign()),
    "cosine_embedding_loss": lambda p, x: F.cosine_embedding_loss(_h(p, x), x, x[0].sign()),
    "trace": lambda p, x: torch.trace(_h(p, x)),
    "Tensor.trace": lambda p, x: _h(p, x).trace(),
    "max_pool3d": lambda p, x: F.max_pool3d(_h(p, x).reshape(1, 4, 4, 4), 2),
    "adaptive_avg_pool3d": lambda p, x: F.adaptive_avg_pool3d(_h(p, x).reshape(1, 4, 4, 4), 2),
    "cdist": lambda p, x: torch.cdist(_h(p, x), x),
    "pinverse": lambda p, x: torch.pinverse(_spd(p, x)),
    "Tensor.pinverse": lambda p, x: _spd(p, x).pinverse(),
    "linalg.solve": lambda p, x: torch.linalg.solve(_spd(p, x), x),
    "linalg.eigvalsh": lambda p, x: torch.linalg.eigvalsh(_spd(p, x)),
    "linalg.svdvals": lambda p, x: torch.linalg.svdvals(_spd(p, x)),
    **{
        f"fft.{name}": (lambda f: lambda p, x: f(_h(p, x)).abs())(getattr(torch.fft, name))
        for name in (
            *("fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2"),
            *("irfft2", "rfftn", "irfftn", "hfft", "ihfft"),
        )
    },
}


class Member(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.p = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: Tensor) -> Tensor:
        return CASES[self.case](self.p, x)


def _members(case: str) -> list[Member]:
    torch.manual_seed(0)
    return [Member(case) for _ in range(N)]


def _autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


# Ops whose batching rule sums in another order than the loop's kernel, with or without
# autocast (vmap's dot is a batched mv; cross_entropy's mean): float32 rounding apart.
REORDERED = {"dot", "Tensor.dot", "vdot", "Tensor.vdot", "inner", "Tensor.inner", "cross_entropy"}


def _sdpa_loop_kernel_is_not_math() -> bool:
    """Whether a member's 3-d ``scaled_dot_product_attention`` under bfloat16 autocast,
    run alone, rounds otherwise than torch's math kernel, which a vectorized call runs
    (4-d batched inputs): torch 2.14 picks its CPU flash kernel there."""
    q = torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(2))
    with _autocast():
        default = F.scaled_dot_product_attention(q, q, q)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            math = F.scaled_dot_product_attention(q, q, q)
    return not torch.equal(default, math)


SDPA_LOOP_KERNEL_IS_NOT_MATH = _sdpa_loop_kernel_is_not_math()


def _assert_same(got: Tensor, want: Tensor, case: str) -> None:
    assert got.dtype == want.dtype
    if case in REORDERED:
        ulp = torch.finfo(torch.float32).eps * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=4 * ulp)
    elif case == "scaled_dot_product_attention" and SDPA_LOOP_KERNEL_IS_NOT_MATH:
        # Another kernel in the loop than vmap's: bfloat16 roundings apart (the gradient
        # carries two; test_sdpa_vectorized_runs_the_math_kernel shows which kernel).
        ulp = torch.finfo(torch.bfloat16).eps * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=2 * ulp)
    else:
        assert torch.equal(got, want), (got - want).abs().max()


def test_sdpa_vectorized_runs_the_math_kernel(x):
    """versions.md: a vectorized scaled_dot_product_attention under bfloat16 autocast
    gives the bits of the math kernel run member by member; torch 2.14's loop runs its
    CPU flash kernel for these 3-d inputs, one bfloat16 rounding away."""
    case = "scaled_dot_product_attention"
    members = _members(case)
    _, params, buffers = fe.stack(members)
    with _autocast():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            math = torch.stack([m(x) for m in members])
        loop = torch.stack([m(x) for m in members])
        got = fe.vmap(lambda p, b, x: CASES[case](p["p"], x))(params, buffers, x)
    assert torch.equal(got, math)
    newer = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
    assert newer == SDPA_LOOP_KERNEL_IS_NOT_MATH
    assert torch.equal(loop, math) != newer


@pytest.fixture
def x() -> Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", CASES)
def test_vmap_computes_in_the_loops_dtypes(case, x):
    members = _members(case)
    _, params, buffers = fe.stack(members)
    with _autocast():
        want = torch.stack([m(x) for m in members])
        got = fe.vmap(lambda p, b, x: CASES[case](p["p"], x))(params, buffers, x)
    _assert_same(got, want, case)


@pytest.mark.parametrize("case", CASES)
def test_ensemble_computes_in_the_loops_dtypes(case, x):
    members = _members(case)
    ens = fe.Ensemble(copy.deepcopy(members))
    with _autocast():
        want = torch.stack([m(x) for m in members])
        got = ens(x)
    _assert_same(got, want, case)


@pytest.mark.parametrize("case", CASES)
def test_value_and_grad_computes_in_the_loops_dtypes(case, x):
    members = _members(case)
    fmodel, params, buffers = fe.stack(members)

    def loss_fn(p, b, x):
        return fmodel(p, b, x).abs().sum()

    losses, grads = [], []
    with _autocast():
        for m in members:
            loss = m(x).abs().sum()
            losses.append(loss.detach())
            grads.append(torch.autograd.grad(loss, m.p)[0])
        got_losses, got_grads, _ = fe.value_and_grad(loss_fn)(params, buffers, x)
    _assert_same(got_losses, torch.stack(losses), case)
    _assert_same(got_grads["p"], torch.stack(grads), case)


@pytest.mark.parametrize("op", [torch.addbmm, Tensor.addbmm])
def test_addbmm_is_refused(op):
    members = _members("addmm")
    _, params, buffers = fe.stack(members)
    b1, b2 = torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    with _autocast(), pytest.raises(ValueError, match=r"^vmap: addbmm under CPU torch\.autocast"):
        fe.vmap(lambda p, b: op(p["p"], b1, b2))(params, buffers)
    # The advice: one addmm per batch, the loop's values.
    with _autocast():
        want = torch.stack([torch.addbmm(m.p, b1, b2) for m in members])
        got = fe.vmap(lambda p, b: torch.addmm(torch.addmm(p["p"], b1[0], b2[0]), b1[1], b2[1]))(
            params, buffers
        )
    _assert_same(got, want, "addmm")


def test_calls_without_autocast_do_not_enter_the_mode(monkeypatch, x):
    entered = []

    class Spy(autocast_policy.CpuAutocastPolicy):
        def __enter__(self):
            entered.append(self.where)
            return super().__enter__()

    monkeypatch.setattr(_vmap, "CpuAutocastPolicy", Spy)
    fmodel, params, buffers = fe.stack(_members("addmm"))
    fe.vmap(fmodel)(params, buffers, x)
    fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())(params, buffers, x)
    assert entered == []
    with _autocast():
        fe.vmap(fmodel)(params, buffers, x)
    assert entered == ["vmap"]


@pytest.mark.parametrize("face", ["ensemble", "vmap"])
def test_a_global_3d_pool_layer_computes_in_float32_as_the_loop(face):
    # nn.AdaptiveAvgPool3d(1) is rewritten into a mean inside vmap (_kernels/rewrites),
    # before the policy sees the call: it stayed in bfloat16 where the loop's ran in
    # float32 (adaptive_avg_pool3d is on CPU autocast's float32 list).
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Conv3d(2, 3, 1), nn.AdaptiveAvgPool3d(1)) for _ in range(N)]
    x = torch.randn(2, 2, 4, 4, 4)
    with _autocast():
        want = torch.stack([m(x) for m in members])
        if face == "ensemble":
            got = fe.Ensemble(copy.deepcopy(members))(x)
        else:
            fmodel, params, buffers = fe.stack(copy.deepcopy(members))
            got = fe.vmap(fmodel)(params, buffers, x)
    assert want.dtype == torch.float32
    _assert_same(got, want, "adaptive_avg_pool3d")


LINEAR_INPUTS: dict[str, Callable[[Tensor], Tensor]] = {
    # input [6, 4, 300] -> what reaches F.linear; torch fuses some into one addmm
    "2d": lambda x: x[0],
    "3d": lambda x: x,
    "3d-transposed": lambda x: x.transpose(0, 1),
    "4d": lambda x: x.reshape(2, 3, 4, 300),
    "4d-transposed": lambda x: x.reshape(2, 3, 4, 300).transpose(1, 2),
    "1d": lambda x: x[0, 0],
}


class _Linear(nn.Module):
    def __init__(self, view: str, bias_dims: int) -> None:
        super().__init__()
        self.view, self.bias_dims = view, bias_dims
        self.weight = nn.Parameter(torch.randn(8, 300) / 17)
        self.bias = nn.Parameter(torch.randn(*[4] * (bias_dims - 1), 8))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(LINEAR_INPUTS[self.view](x), self.weight, self.bias)


@pytest.mark.parametrize("bias_dims", [1, 2])
@pytest.mark.parametrize("view", LINEAR_INPUTS)
def test_linear_over_long_inner_products_rounds_as_the_loops_kernel(view, bias_dims):
    # torch's linear is one addmm (one rounding) for some layouts and matmul then add
    # (two roundings) for others; 300 inputs make the two differ in bfloat16.
    if bias_dims == 2 and view != "2d":
        pytest.skip("a [4, 8] bias is one row per sample of a 2-d input only")
    torch.manual_seed(0)
    members = [_Linear(view, bias_dims) for _ in range(N)]
    x = torch.randn(6, 4, 300, generator=torch.Generator().manual_seed(1))
    with _autocast():
        want = torch.stack([m(x) for m in members])
        got = fe.Ensemble(copy.deepcopy(members), chunk_size=2)(x)
    _assert_same(got, want, view)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_float64_members_are_left_alone_as_autocast_leaves_them(chunk_size):
    # The policy rounded every result to bfloat16, float64 ones too: the next float64
    # layer then failed ("expected scalar type Float but found Double").
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2)).double() for _ in range(N)
    ]
    x = torch.randn(5, 2, 6, dtype=torch.float64)
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))

    def loss_fn(p, b, x):
        return fmodel(p, b, x).pow(2).sum()

    with _autocast():
        want = torch.stack([m(x) for m in members])
        got = fe.Ensemble(copy.deepcopy(members), chunk_size=chunk_size)(x)
        losses, grads, _ = fe.value_and_grad(loss_fn, chunk_size=chunk_size)(params, buffers, x)
        loop_grads = [torch.autograd.grad(m(x).pow(2).sum(), m[0].weight)[0] for m in members]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(losses, want.pow(2).sum((1, 2)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads["0.weight"], torch.stack(loop_grads), rtol=1e-12, atol=1e-12)


def test_integer_operands_and_out_arguments_run_as_written():
    # Integer addmm came back in bfloat16 with wrong values; an out= tensor was cast,
    # and the op wrote into the copy.
    members = _members("addmm")
    _, params, buffers = fe.stack(members)
    a = torch.randint(-50, 50, (2, 3))
    b = torch.randint(-50, 50, (3, 2))
    c = torch.randint(-50, 50, (2, 2))
    with _autocast():
        got = fe.vmap(lambda p, buf: torch.addmm(c, a, b) + 0 * p["p"][0, 0].long())(
            params, buffers
        )
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.addmm(c, a, b).expand(N, 2, 2))
    out = torch.zeros(2, 2)
    x, y, z = torch.randn(2, 3), torch.randn(3, 2), torch.randn(2, 2)
    with _autocast():
        fe.vmap(lambda p, buf: p["p"].sum() + torch.addmm(z, x, y, out=out).sum())(params, buffers)
        want = torch.zeros(2, 2)
        torch.addmm(z, x, y, out=want)
    assert torch.equal(out, want) and out.abs().sum() > 0


@pytest.mark.parametrize("case", ["addmm", "baddbmm", "linear", "conv2d", "mv", "cross_entropy"])
def test_float16_autocast_gives_the_loops_dtypes_and_values_to_a_rounding(case, x):
    # training.md: under dtype=torch.float16 the dtypes are the loop's and the values
    # agree to a float16 rounding (the one rounding from float32 is bfloat16's rule).
    members = _members(case)
    ens = fe.Ensemble(copy.deepcopy(members))
    with torch.autocast("cpu", dtype=torch.float16):
        want = torch.stack([m(x) for m in members])
        got = ens(x)
    assert got.dtype == want.dtype
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=2 * torch.finfo(torch.float16).eps * scale)


@pytest.mark.parametrize(
    "norm",
    [lambda: nn.LayerNorm(8), lambda: nn.GroupNorm(2, 8), lambda: nn.BatchNorm1d(8)],
    ids=["LayerNorm", "GroupNorm", "BatchNorm1d"],
)
def test_a_float64_norm_after_an_autocast_layer_is_refused_as_the_loop_refuses_it(norm):
    # unsupported.md: under autocast the norm kernels' dtype rule applies (the loop's
    # kernel raises "mixed dtype" for a bfloat16 input and float64 parameters).
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), norm().double()) for _ in range(N)]
    x = torch.randn(5, 4)
    ens = fe.Ensemble(copy.deepcopy(members))
    with _autocast():
        with pytest.raises(RuntimeError, match="mixed dtype"):
            members[0](x)
        with pytest.raises((RuntimeError, ValueError), match=r"of dtype torch\.float64"):
            ens(x)
