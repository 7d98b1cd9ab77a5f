"""The fast path's float32 CPU tanh (``_tanh``: NumPy's SIMD kernel, in place): its
accuracy, its specials, its gradient, and a member's numbers on every route."""

import copy
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcensemble as fe
from funcensemble._kernels import mlp_op as _mlp_op
from funcensemble._kernels import tanh as _tanh
from funcensemble._kernels import workspace as _workspace

# Measured over every finite float32 (2**32 values): at most 1.3736 ulp (MKL's tanh: 0.51),
# on NumPy 2.4 with AVX-512 (2026-11-28).
MAX_ULP = 2.0


def _ulps(got: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|got - tanh(x)| in units of the float32 spacing at the correctly rounded tanh."""
    exact = torch.tanh(x.double())
    rounded = exact.float()
    spacing = (torch.nextafter(rounded.abs(), torch.tensor(float("inf"))) - rounded.abs()).double()
    return (got.double() - exact).abs() / spacing


def _fast(x: torch.Tensor) -> torch.Tensor:
    with _tanh.forced(True):
        return _tanh.tanh_(x.clone())


def test_within_2_ulp_of_the_exact_tanh_over_the_float32_range():
    # Every 512th bit pattern of the non-negative finite floats, both signs, and a
    # dense grid where tanh bends (the exhaustive sweep took minutes: done once).
    bits = torch.arange(0, 0x7F800000, 512, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.cat([x, -x, torch.linspace(-10, 10, 2_000_001)])
    ulps = _ulps(_fast(x), x)
    assert ulps.max().item() <= MAX_ULP
    assert ulps.mean().item() < 0.5


def test_specials_are_tanhs_own():
    x = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-38, -1e-45, 88.0, -1e30]
    )
    got, want = _fast(x), torch.tanh(x)
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(got[keep], want[keep])
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 stays -0.0


def test_replaces_only_cpu_float32_and_follows_the_cpu():
    with _tanh.forced(True):
        assert _tanh.replaces(torch.zeros(3))
        assert not _tanh.replaces(torch.zeros(3, dtype=torch.float64))
        assert not _tanh.replaces(torch.zeros(3, dtype=torch.bfloat16))
        assert not _tanh.replaces(torch.zeros(3, device="meta"))
    with _tanh.forced(False):
        assert not _tanh.replaces(torch.zeros(3))
        z = torch.randn(100)
        assert torch.equal(_tanh.tanh_(z.clone()), torch.tanh(z))
    assert _tanh.replaces(torch.zeros(3)) == (_tanh._slow_mkl_tanh() and _tanh._numpy_simd_tanh())


def test_strided_and_inference_tensors_get_the_contiguous_numbers():
    """A strided tensor is computed in contiguous memory (NumPy's strided loop may round
    otherwise), and an inference tensor works without a version counter."""
    torch.manual_seed(0)
    x = torch.randn(64, 96) * 3
    want = _fast(x)
    strided = x.clone().t()  # the same values, column-major
    with _tanh.forced(True):
        _tanh.tanh_(strided)
    assert torch.equal(strided.t(), want)
    with torch.inference_mode():
        z = x.clone()
        with _tanh.forced(True):
            _tanh.tanh_(z)
    assert torch.equal(z, want)


def test_an_in_place_change_is_seen_by_autograd():
    """NumPy writes the tensor's memory; its version counter moves as torch's in-place
    ops move it, so autograd refuses a backward through a tensor saved before."""
    w = torch.randn(5, requires_grad=True)
    z = w * 2
    saved = z * w  # saves z for w's gradient
    version = z._version
    with _tanh.forced(True):
        _tanh.tanh_(z.detach())  # as a kept buffer is written: behind autograd
    assert z._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_traced_calls_keep_torch_tanh_in_the_graph():
    """NumPy's work is invisible to torch's tracers: under ``make_fx`` and
    ``torch.jit.trace`` the tanh runs as ``torch.tanh``, so the traced graph computes
    it (a one-member ensemble without grad once traced to Linear-Linear: 0.44 off)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    ens = fe.Ensemble(_heads(1)).eval()
    x, fresh = torch.randn(256, 8), torch.randn(256, 8)
    with _tanh.forced(True), torch.no_grad():
        graph = make_fx(lambda x: ens(x))(x)
        want = ens(fresh)
    with torch.no_grad():
        torch.testing.assert_close(graph(fresh), want, rtol=1e-5, atol=1e-6)
    assert any("tanh" in str(node.target) for node in graph.graph.nodes)
    # torch.jit.trace (its sizes are traced tensors, which this test run's type checks
    # refuse, so the ensemble itself is traced in a check outside it): no NumPy there.
    seen = []

    def probe(z: torch.Tensor) -> torch.Tensor:
        seen.append(_tanh.replaces(z))
        return z * 2

    with _tanh.forced(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch >= 2.9 deprecates torch.jit.trace
        torch.jit.trace(probe, torch.zeros(3), check_trace=False)
    assert seen and not any(seen)


_FULLGRAPH_SCRIPT = textwrap.dedent(
    """
    import copy, sys, warnings
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch")
    import torch
    from torch import nn
    import funcensemble as fe
    from funcensemble._kernels import tanh as _tanh

    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4), nn.GELU())
        for _ in range(2)
    ]
    x = torch.randn(256, 8)
    want = torch.stack([m(x) for m in members])
    for enabled in (True, False):
        torch._dynamo.reset()
        ens = fe.Ensemble(copy.deepcopy(members))
        with _tanh.forced(enabled):
            out = torch.compile(ens, fullgraph=True, backend="aot_eager")(x)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    print("ok")
    """
)


@pytest.mark.slow  # compiles twice, in a fresh interpreter (no runtime type checks)
def test_fullgraph_compile_of_a_chain_the_mlp_op_leaves_to_plain_ops():
    """A float32 chain the compiled MLP op does not take (a GELU after the last Linear)
    runs the plain-op chain under Dynamo: ``torch.compile(ens, fullgraph=True)``, as
    docs/how-to/compile.md promises, traces it without a break (Dynamo once stopped at
    the tanh route's checks: CPU vendor, modes) and computes the loop's numbers."""
    result = subprocess.run(
        [sys.executable, "-c", _FULLGRAPH_SCRIPT],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=Path(__file__).parent.parent,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_make_fx_with_grad_traces_the_plain_ops_at_every_size():
    """Under ``make_fx`` with grad enabled, 64 members (whose outputs would take the
    kept buffers) run the plain ops: the out= kernels there crashed the trace."""
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    members = _heads(64)
    ens = fe.Ensemble(copy.deepcopy(members))
    x, fresh = torch.randn(256, 8), torch.randn(256, 8)
    with _tanh.forced(True):
        ens(x).sum().backward()  # an eager step first: the pool now holds buffers
        graph = make_fx(lambda x: ens(x))(x)
    with torch.no_grad():
        want = torch.stack([m(fresh) for m in members])
        torch.testing.assert_close(graph(fresh), want, rtol=1e-5, atol=1e-6)


def _linear_act_nodes(out: torch.Tensor) -> int:
    """How many ``LinearAct`` backward nodes the graph of ``out`` holds."""
    seen, stack, count = set(), [out.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "LinearAct" in type(node).__name__
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return count


def test_kept_buffers_step_aside_under_a_mode():
    """Under a dispatch mode the 64-member chain runs the plain ops (what a tracer can
    record), with the same numbers as the kept-buffer layers outside it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    ens = fe.Ensemble(_heads(64))
    x = torch.randn(256, 8)
    kept = ens(x)
    with Passing():
        plain = ens(x)
    assert _linear_act_nodes(kept) > 0
    assert _linear_act_nodes(plain) == 0
    torch.testing.assert_close(plain, kept, rtol=1e-5, atol=1e-6)


def test_modes_and_subclasses_keep_torch_tanh():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _tanh.forced(True):
        assert _tanh.replaces(torch.zeros(3))
        with Passing():
            assert not _tanh.replaces(torch.zeros(3))
        with torch.device("cpu"):  # a torch function mode
            assert not _tanh.replaces(torch.zeros(3))
        assert not _tanh.replaces(nn.Parameter(torch.zeros(3)))


def test_fast_tanh_is_differentiated_as_autograd_differentiates_tanh():
    torch.manual_seed(0)
    x = torch.randn(6, 40, requires_grad=True)
    g = torch.randn(6, 40)
    with _tanh.forced(True):
        y = _tanh.FastTanh.apply(x * 1.0)  # a fresh intermediate, as in the chain
    assert torch.equal(y.detach(), _fast(x.detach()))
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(gx, torch.ops.aten.tanh_backward(g, y.detach()))
    # Second derivatives: through tanh_backward of the saved output, as torch.tanh's.
    with _tanh.forced(True):
        y = _tanh.FastTanh.apply(x * 1.0)
    (gx,) = torch.autograd.grad(y, x, g, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), x)
    yd = y.detach()
    assert torch.allclose(ggx, -2 * yd * (1 - yd**2) * g, rtol=1e-5, atol=1e-6)


def _heads(n: int, dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4)
        ).to(dtype)
        for _ in range(n)
    ]


def _steps(members: list[nn.Module], x: torch.Tensor, y: torch.Tensor, steps: int = 3):
    ens = fe.Ensemble(copy.deepcopy(members))
    opt = torch.optim.Adam(ens.parameters(), lr=1e-2)
    outs = []
    for _ in range(steps):
        out = ens(x)
        outs.append(out.detach().clone())
        loss = F.mse_loss(out, y, reduction="none").mean(dim=(1, 2)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return outs, ens.stacked.state_dict()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_member_gets_the_same_numbers_alone_and_among_many(enabled, monkeypatch):
    """One member alone runs the plain-op chain (``FastTanh``), among 64 the kept-buffer
    layers (its outputs pass the pool's threshold): bit for bit the same outputs and
    parameters, with the replacement on and off."""
    monkeypatch.setattr(_workspace, "MIN_BYTES", 64 * 1024)
    members = _heads(64)
    x = torch.randn(256, 8)
    y = torch.randn(64, 256, 4)
    with _tanh.forced(enabled):
        many_out, many_state = _steps(members, x, y)
        one_out, one_state = _steps(members[5:6], x, y[5:6])
    for a, b in zip(many_out, one_out, strict=True):
        assert torch.equal(a[5:6], b)
    for k, v in one_state.items():
        assert torch.equal(many_state[k][5:6], v), k


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("n", [1, 64])
def test_training_matches_the_loop_in_float32(enabled, n):
    members = _heads(n)
    loop = copy.deepcopy(members)
    x = torch.randn(256, 8)
    y = torch.randn(n, 256, 4)
    opt = torch.optim.Adam([p for m in loop for p in m.parameters()], lr=1e-2)
    want = []
    for _ in range(3):
        out = torch.stack([m(x) for m in loop])
        want.append(out.detach().clone())
        loss = torch.stack([F.mse_loss(out[i], y[i]) for i in range(n)]).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with _tanh.forced(enabled):
        got, state = _steps(members, x, y)
    # Adam at lr 1e-2 turns rounding differences of the gradient into parameter
    # differences of up to a few 1e-6 (the batched GEMMs round unlike the loop's too).
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    loop_state = fe.stack(loop)[1]
    for k, v in state.items():
        torch.testing.assert_close(v, loop_state[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("n", [1, 64])
def test_functional_steps_match_the_loop_gradients_and_adam_state(enabled, n):
    """The functional face (value_and_grad + adam's update_) against the loop with
    torch.optim.Adam: losses and gradients at every step, then the parameters and both
    Adam moments, with NumPy's tanh on and off."""
    members = _heads(n)
    loop = copy.deepcopy(members)
    x = torch.randn(256, 8)
    y = torch.randn(n, 256, 4)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in loop]
    fmodel, params, buffers = fe.stack(members)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    opt = fe.optim.adam(lr=1e-2)
    state = opt.init(params)
    with _tanh.forced(enabled):
        value_and_grad = fe.value_and_grad(loss_fn, in_dims=(None, 0))
        for _ in range(3):
            losses, grads, buffers = value_and_grad(params, buffers, x, y)
            state = opt.update_(grads, state, params)
            want_losses = []
            for i, (m, o) in enumerate(zip(loop, opts, strict=True)):
                loss = F.mse_loss(m(x), y[i])
                want_losses.append(loss.detach())
                o.zero_grad()
                loss.backward()
                for k, p in m.named_parameters():
                    torch.testing.assert_close(grads[k][i], p.grad, rtol=1e-4, atol=1e-6)
                o.step()
            torch.testing.assert_close(losses, torch.stack(want_losses), rtol=1e-5, atol=1e-7)
    moments = state[0]
    for k, v in params.items():
        for i, (m, o) in enumerate(zip(loop, opts, strict=True)):
            p = m.get_parameter(k)
            torch.testing.assert_close(v[i], p.detach(), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(
                moments.mu[k][i], o.state[p]["exp_avg"], rtol=1e-4, atol=1e-6
            )
            torch.testing.assert_close(
                moments.nu[k][i], o.state[p]["exp_avg_sq"], rtol=1e-4, atol=1e-9
            )


def test_float64_is_torch_tanh_bit_for_bit():
    members = _heads(64, torch.float64)
    x = torch.randn(256, 8, dtype=torch.float64)
    with _tanh.forced(True):
        on = fe.Ensemble(members)(x)
    with _tanh.forced(False):
        off = fe.Ensemble(members)(x)
    assert torch.equal(on, off)


def test_the_compiled_op_and_inference_compute_what_the_eager_layers_do():
    """``mlp_op.mlp_forward`` (what compiled code runs), the kept-buffer layers and the
    plain-op chain without grad give one member the same output bit for bit."""
    members = _heads(64)
    x = torch.randn(256, 8)
    params = fe.stack(members)[1]
    weights = [params[f"{i}.weight"].detach() for i in (0, 2, 4)]
    biases = [params[f"{i}.bias"].detach() for i in (0, 2, 4)]
    acts = [_mlp_op.TANH, _mlp_op.TANH, _mlp_op.NONE]
    with _tanh.forced(True), torch.no_grad():
        eager = fe.Ensemble(members)(x)
        alone = fe.Ensemble(members[5:6])(x)
        op = _mlp_op.mlp_forward(x, weights, biases, [True] * 3, acts)
    assert torch.equal(eager, op[0])
    assert torch.equal(eager[5:6], alone)
    with _tanh.forced(False), torch.no_grad():
        assert not torch.equal(fe.Ensemble(members)(x), eager)  # the replacement ran


def test_chunked_value_and_grad_gives_the_unchunked_numbers():
    """One member at a time (the plain-op chain) gives the same values bit for bit as
    all members at once (the kept-buffer layers), replacement on."""
    members = _heads(64)
    fmodel, params, buffers = fe.stack(members)
    x = torch.randn(256, 8)
    y = torch.randn(64, 256, 4)

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    with _tanh.forced(True):
        whole = fe.value_and_grad(loss_fn, in_dims=(None, 0))(params, buffers, x, y)
        chunked = fe.value_and_grad(loss_fn, in_dims=(None, 0), chunk_size=1)(params, buffers, x, y)
    assert torch.equal(whole[0], chunked[0])
    for k, g in whole[1].items():
        assert torch.equal(g, chunked[1][k]), k


def test_inside_another_torch_func_transform_tanh_is_torchs():
    """Documented: eager calls inside other ``torch.func`` transforms run ``torch.tanh``,
    so forcing the replacement on changes nothing there."""
    members = _heads(8)
    xs = torch.randn(3, 256, 8)
    ens = fe.Ensemble(members)
    with _tanh.forced(True):
        on = torch.func.vmap(ens)(xs)
    with _tanh.forced(False):
        off = torch.func.vmap(ens)(xs)
        plain = torch.stack([ens(x) for x in xs])
    assert torch.equal(on, off)
    torch.testing.assert_close(on, plain, rtol=1e-5, atol=1e-6)
