"""Layers whose calls vmap cannot batch as written (see ``_rewrites``), against the loop.

Parametrized modules (``torch.nn.utils.parametrizations``: weight_norm, spectral_norm,
orthogonal) and global average pooling of ``channels_last`` tensors: outputs, gradients,
buffers and several ``torch.optim.Adam`` steps equal the plain loop over the members.
"""

import copy
import functools

import pytest
import torch
from helpers import assert_trees_close, clone_modules, stacked_state, vmap_batches_matrix_exp
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations as P
from torch.utils._python_dispatch import TorchDispatchMode

import funcensemble as fe


def _loss(out: Tensor) -> Tensor:
    return out.pow(2).mean()


def _train_both(modules: list[nn.Module], inputs: list[Tensor], *, rtol: float, atol: float):
    """Adam steps on an Ensemble and on the loop; compare outputs, grads, state each step."""
    reference = clone_modules(modules)
    ens = fe.Ensemble(modules)
    opt = torch.optim.Adam(ens.parameters(), lr=1e-2)
    ref_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in reference]
    names = list(ens.stacked_params())
    for x in inputs:
        opt.zero_grad()
        out = ens(x)
        # Summing per-member losses gives each member exactly its own gradient.
        torch.stack([_loss(o) for o in out]).sum().backward()
        expected_out = []
        for module, ref_opt in zip(reference, ref_opts, strict=True):
            ref_opt.zero_grad()
            y = module(x)
            _loss(y).backward()
            expected_out.append(y)
        assert_trees_close(out, torch.stack(expected_out), rtol=rtol, atol=atol)
        grads = {k: p.grad for k, p in ens.stacked_params().items()}
        expected_grads = {
            k: torch.stack([dict(m.named_parameters())[k].grad for m in reference]) for k in names
        }
        assert_trees_close(grads, expected_grads, rtol=rtol, atol=atol)
        opt.step()
        for ref_opt in ref_opts:
            ref_opt.step()
    expected_params, expected_buffers = stacked_state(reference)
    assert_trees_close(ens.stacked_params(), expected_params, rtol=rtol, atol=atol)
    assert_trees_close(ens.stacked_buffers(), expected_buffers, rtol=rtol, atol=atol)
    return ens, reference


PARAMETRIZATIONS = {
    "weight_norm": P.weight_norm,
    "weight_norm_dim1": lambda m: P.weight_norm(m, dim=1),
    "weight_norm_whole": lambda m: P.weight_norm(m, dim=None),
    "spectral_norm": P.spectral_norm,
    "orthogonal_matrix_exp": lambda m: P.orthogonal(m, orthogonal_map="matrix_exp"),
    "orthogonal_cayley": lambda m: P.orthogonal(m, orthogonal_map="cayley"),
    "orthogonal_householder": lambda m: P.orthogonal(m, orthogonal_map="householder"),
    "orthogonal_no_trivialization": lambda m: P.orthogonal(m, use_trivialization=False),
}


def _parametrized_net(parametrize, dtype: torch.dtype) -> nn.Module:
    return nn.Sequential(parametrize(nn.Linear(4, 6)), nn.Tanh(), parametrize(nn.Linear(6, 3))).to(
        dtype
    )


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("name", sorted(PARAMETRIZATIONS))
def test_parametrized_modules_match_the_loop(name: str, train: bool) -> None:
    if name == "orthogonal_matrix_exp" and not vmap_batches_matrix_exp():
        pytest.skip(f"torch {torch.__version__}: vmap has no matrix_exp rule (see versions.md)")
    torch.manual_seed(0)
    modules = [
        _parametrized_net(PARAMETRIZATIONS[name], torch.float64).train(train) for _ in range(3)
    ]
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(5, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    ens, reference = _train_both(modules, inputs, rtol=1e-9, atol=1e-12)
    # The stacked tensors are the parametrizations' originals (and spectral_norm's u, v).
    assert any(".original" in k for k in ens.stacked_params())
    if name == "spectral_norm" and train:
        # The power iteration updated every member's own u in place, as the loop did.
        u = ens.stacked_buffers()["0.parametrizations.weight.0._u"]
        assert not torch.equal(
            u, torch.stack([m[0].parametrizations.weight[0]._u for m in modules])
        )
    # Members come back out as ordinary parametrized modules computing the same.
    x = inputs[0]
    for i, module in enumerate(reference):
        member = ens.member(i)
        assert type(member[0]).__name__ == "ParametrizedLinear"
        torch.testing.assert_close(member(x), module(x), rtol=1e-12, atol=1e-12)


def test_parametrized_conv_in_float32_and_through_value_and_grad() -> None:
    torch.manual_seed(0)
    modules = [
        nn.Sequential(
            P.weight_norm(nn.Conv2d(2, 3, 3)), nn.ReLU(), P.spectral_norm(nn.Conv2d(3, 2, 3))
        )
        for _ in range(4)
    ]
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(2, 2, 7, 7, generator=gen) for _ in range(3)]
    _train_both(clone_modules(modules), inputs, rtol=1e-4, atol=1e-5)
    # The pure path: fe.stack + fe.value_and_grad equals torch.autograd.grad per member.
    fmodel, params, buffers = fe.stack(modules)
    losses, grads, new_buffers = fe.value_and_grad(lambda p, b, x: _loss(fmodel(p, b, x)))(
        params, buffers, inputs[0]
    )
    for i, module in enumerate(modules):
        loss = _loss(module(inputs[0]))
        expected = torch.autograd.grad(loss, list(module.parameters()))
        torch.testing.assert_close(losses[i], loss, rtol=1e-5, atol=1e-6)
        for (k, _), g in zip(module.named_parameters(), expected, strict=True):
            torch.testing.assert_close(grads[k][i], g, rtol=1e-4, atol=1e-6)
        for k, b in module.named_buffers():  # spectral_norm's u, v after one power step
            torch.testing.assert_close(new_buffers[k][i], b, rtol=1e-5, atol=1e-6)


def test_export_and_import_of_parametrized_members() -> None:
    torch.manual_seed(0)
    modules = [_parametrized_net(P.weight_norm, torch.float64) for _ in range(3)]
    ens = fe.Ensemble(modules)
    state_dicts = fe.export_state_dicts(ens)
    plain = _parametrized_net(P.weight_norm, torch.float64)
    plain.load_state_dict(state_dicts[2])
    x = torch.randn(4, 4, dtype=torch.float64)
    torch.testing.assert_close(plain(x), modules[2](x))
    other = fe.Ensemble.from_factory(lambda: _parametrized_net(P.weight_norm, torch.float64), 3)
    fe.import_state_dicts(other, [m.state_dict() for m in modules])
    torch.testing.assert_close(other(x), ens(x))


# --- global average pooling of channels_last tensors ----------------------------------


def _pool_net(spatial: int, pool: nn.Module) -> nn.Module:
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[spatial]
    return nn.Sequential(conv(3, 4, 3), nn.ReLU(), pool, nn.Flatten(), nn.Linear(4, 2)).double()


_FORMAT = {2: torch.channels_last, 3: torch.channels_last_3d}


@pytest.mark.parametrize(
    ("spatial", "pool", "layout"),
    [
        (2, nn.AdaptiveAvgPool2d(1), "both"),
        (2, nn.AdaptiveAvgPool2d((1, 1)), "weights"),
        (2, nn.AdaptiveAvgPool2d((1, None)), "input"),
        (3, nn.AdaptiveAvgPool3d(1), "both"),
        (1, nn.AdaptiveAvgPool1d(1), "none"),
    ],
)
def test_global_average_pool_of_channels_last_matches_the_loop(
    spatial: int, pool: nn.Module, layout: str
) -> None:
    torch.manual_seed(0)
    modules = [_pool_net(spatial, pool) for _ in range(3)]
    gen = torch.Generator().manual_seed(3)
    shape = (2, 3) + (6,) * spatial if not isinstance(pool.output_size, tuple) else (2, 3, 6, 3)
    inputs = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    if spatial in _FORMAT and layout in ("weights", "both"):
        modules = [m.to(memory_format=_FORMAT[spatial]) for m in modules]
    if spatial in _FORMAT and layout in ("input", "both"):
        inputs = [x.to(memory_format=_FORMAT[spatial]) for x in inputs]
    _train_both(modules, inputs, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("layout", ["both", "weights", "input"])
def test_group_norm_after_a_channels_last_conv_matches_the_loop(groups: int, layout: str) -> None:
    # Found by an audit: a UNet's Conv2d -> GroupNorm in channels_last raised torch's
    # "NYI: querying is_contiguous inside of vmap", where the loop runs.
    torch.manual_seed(0)
    modules = [
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(groups, 4), nn.SiLU(), nn.Flatten()).double()
        for _ in range(3)
    ]
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, 3, 6, 6, generator=gen, dtype=torch.float64) for _ in range(3)]
    if layout in ("weights", "both"):
        modules = [m.to(memory_format=torch.channels_last) for m in modules]
    if layout in ("input", "both"):
        inputs = [x.to(memory_format=torch.channels_last) for x in inputs]
    _train_both(modules, inputs, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("pool", [nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d])
def test_global_average_pool_takes_the_input_ranks_the_loop_takes(pool: type, rank: int) -> None:
    # adaptive_avg_pool1d takes [C, L] or [N, C, L]; the 2d/3d kinds to size 1, any more dims.
    torch.manual_seed(0)
    modules = [nn.Sequential(nn.Linear(6, 6), pool(1)).double() for _ in range(3)]
    x = torch.randn(*(2, 4, 3, 2, 3)[: rank - 1], 6, dtype=torch.float64)
    try:
        expected = torch.stack([m(x) for m in modules])
    except (RuntimeError, IndexError) as error:
        with pytest.raises(type(error)):
            fe.Ensemble(modules)(x)
        return
    torch.testing.assert_close(fe.Ensemble(modules)(x), expected, rtol=1e-12, atol=1e-12)


class FunctionalPool(nn.Module):
    def __init__(self, use_mean: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.use_mean = use_mean

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)
        return h.mean((-2, -1), keepdim=True) if self.use_mean else F.adaptive_avg_pool2d(h, 1)


def test_functional_global_pool_in_own_forward_gets_advice_that_works() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    modules = [
        FunctionalPool(use_mean=False).to(memory_format=torch.channels_last) for _ in range(2)
    ]
    with pytest.raises(
        RuntimeError,
        match=r"aten::as_strided_ has no vmap batching rule.*channels_last.*"
        r"x\.mean\(\(-2, -1\), keepdim=True\)",
    ):
        fe.Ensemble(modules)(x)
    # The advice, followed, runs and equals the loop.
    for m in modules:
        m.use_mean = True
    expected = torch.stack([m(x) for m in modules])
    torch.testing.assert_close(fe.Ensemble(modules)(x), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["conv2d-groupnorm", "conv1d-transpose", "linear-layernorm"])
def test_autocast_convolutions_and_norms_compute_in_the_loops_dtypes(kind, dtype):
    # Under vmap the convolutions ran below autocast, in float32 (bfloat16 weight
    # gradients 4.96 off the loop's, of 15.9), and a norm after them then returned
    # float32 where the loop's returns the autocast dtype.
    torch.manual_seed(0)
    make = {
        "conv2d-groupnorm": lambda: nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.ReLU(), nn.GroupNorm(2, 4)
        ),
        "conv1d-transpose": lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.ConvTranspose1d(4, 2, 3)),
        "linear-layernorm": lambda: nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4)),
    }[kind]
    members = [make() for _ in range(3)]
    x = torch.randn(2, 3, 8, 8) if kind == "conv2d-groupnorm" else torch.randn(2, 3, 8)
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members)
    with torch.autocast("cpu", dtype=dtype):
        want = torch.stack([m(x) for m in loop])
        got = ens(x)
    assert got.dtype == want.dtype == dtype
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(
        got.float(), want.float(), rtol=0, atol=4 * ulp * want.abs().max().item()
    )
    weights = torch.randn(want.shape)
    (want.float() * weights).sum().backward()
    (got.float() * weights).sum().backward()
    loop_grad = torch.stack([m[0].weight.grad for m in loop])
    atol = 4 * ulp * loop_grad.abs().max().item()
    torch.testing.assert_close(ens.stacked[0].weight.grad, loop_grad, rtol=0, atol=atol)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"affine": True},
        {"affine": True, "track_running_stats": True},
        {"track_running_stats": True},
    ],
    ids=["affine", "affine-tracked", "tracked"],
)
def test_instance_norm_under_autocast_computes_in_the_loops_dtypes(kwargs, train):
    """InstanceNorm with a float32 weight after a bfloat16 convolution: vmap's rule
    promoted it to float32 (216 of 216 elements off, 3.3e-2 of 3.8), or, keeping running
    statistics, raised torch's "expected scalar type BFloat16 but found Float" where the
    loop runs; its kernel computes in float32 and rounds once, as here now."""
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Conv1d(4, 4, 1), nn.InstanceNorm1d(4, **kwargs)).train(train)
        for _ in range(3)
    ]
    for m in members:
        if m[1].weight is not None:
            with torch.no_grad():
                m[1].weight.uniform_(0.5, 3.0)
                m[1].bias.uniform_(-1.0, 1.0)
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members)
    x = torch.randn(6, 4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.stack([m(x) for m in loop])
        got = ens(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    for name, b in ens.stacked_buffers().items():
        assert torch.equal(b, stacked_state(loop)[1][name]), name


@pytest.mark.parametrize(
    ("name", "make", "x"),
    [
        (
            "batch_norm",
            lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
            torch.randn(6, 4),
        ),
        (
            "layer_norm",
            lambda: nn.Sequential(nn.BatchNorm1d(4), nn.LayerNorm(4)),
            torch.randn(6, 4),
        ),
        (
            "embedding",
            lambda: nn.Sequential(nn.Embedding(5, 4), nn.ReLU()),
            torch.tensor([0, 1, 4]),
        ),
        ("relu", lambda: nn.Sequential(nn.BatchNorm1d(4), nn.ReLU()), torch.randn(6, 4)),
    ],
)
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("kind", ["function", "partial", "callable"])
def test_a_replaced_function_runs_once_per_call_as_in_the_loop(
    monkeypatch, name, make, x, train, kind
):
    """A user's replacement of F.batch_norm (F.layer_norm, F.embedding, F.relu, ...):
    torch's own function hands a torch function mode the function under its own name,
    the replacement, which our modes under vmap then called again (exactly +1.0 off
    with a replacement adding 1; the replacement ran 2-3 times where the loop's ran
    once). The modes run the torch function it replaced."""
    torch.manual_seed(0)
    members = [make().double().train(train) for _ in range(3)]
    loop = copy.deepcopy(members)
    ens = fe.Ensemble(members)
    calls = []
    original = getattr(F, name)

    def replacement(*args, shift=1.0, **kwargs):
        calls.append(1)
        return original(*args, **kwargs) + shift

    class Replacement:
        def __call__(self, *args, **kwargs):
            return replacement(*args, **kwargs)

    made = {
        "function": replacement,
        "partial": functools.partial(replacement, shift=1.0),
        "callable": Replacement(),
    }[kind]
    monkeypatch.setattr(F, name, made)
    x = x.double() if x.is_floating_point() else x
    want = torch.stack([m(x) for m in loop])
    in_loop = len(calls)
    got = ens(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(calls) - in_loop == in_loop // len(loop)  # once per call of the layer
    for k, b in ens.stacked_buffers().items():
        torch.testing.assert_close(b, stacked_state(loop)[1][k], rtol=1e-12, atol=1e-12)


_REPLACED_BEFORE_IMPORT = """
import torch
from torch import nn
from torch.nn import functional as F
original = F.batch_norm
F.batch_norm = lambda *a, **k: original(*a, **k) + 1.0  # before funcensemble is imported
import funcensemble as fe
ens = fe.Ensemble([nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(2)])
before = {k: v.clone() for k, v in ens.state_dict().items()}
try:
    ens(torch.randn(6, 4))
except RuntimeError as error:
    assert "functional.batch_norm was replaced before funcensemble" in str(error), error
    assert all(torch.equal(v, before[k]) for k, v in ens.state_dict().items())
    print("refused")
"""


def test_a_function_replaced_before_import_is_refused_under_the_modes():
    """Its torch original is gone by the time funcensemble is imported: the replacement
    would run twice; refused, naming it, with nothing changed."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _REPLACED_BEFORE_IMPORT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stderr[-2000:]


def test_attention_under_autocast_is_refused():
    members = [nn.MultiheadAttention(8, 2, batch_first=True) for _ in range(2)]
    ens = fe.Ensemble(members)
    x = torch.randn(2, 5, 8)
    refused = pytest.raises(RuntimeError, match=r"MultiheadAttention under torch\.autocast")
    with torch.autocast("cpu", dtype=torch.bfloat16), refused:
        ens(x, x, x)
    ens(x, x, x)  # without autocast, as before
    # training.md: "and the transformer layers holding it"
    layers = [nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True) for _ in range(2)]
    encoder = fe.Ensemble(layers)
    with torch.autocast("cpu", dtype=torch.bfloat16), refused:
        encoder(x)
    encoder(x)


class _NormTimesTwo(torch.overrides.TorchFunctionMode):
    """A user's function mode changing what F.layer_norm and F.batch_norm return."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2.0 if func in (F.layer_norm, F.batch_norm) else out


class _Observing(TorchDispatchMode):
    """A user's dispatch mode that only looks."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("norm", ["layer", "batch"])
def test_norms_computed_as_elementary_ops_under_a_users_mode_are_refused(norm):
    """Inside a grad transform LayerNorm (and BatchNorm without kept statistics) run as
    elementary ops, which a user's mode saw instead of the F.layer_norm call the loop
    makes (input gradients 4.18 off, of 5.86): refused. Without a grad transform the
    mode sees F.layer_norm itself, as in the loop."""
    layer = nn.LayerNorm(4) if norm == "layer" else nn.BatchNorm1d(4, track_running_stats=False)
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(4, 4), nn.Tanh(), copy.deepcopy(layer), nn.Linear(4, 1)).double()
        for _ in range(3)
    ]
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))
    x = torch.randn(5, 4, dtype=torch.float64)

    def input_grad(p, b, x):
        return torch.func.grad(lambda xx: fmodel(p, b, xx).pow(2).sum())(x)

    refused = pytest.raises(RuntimeError, match=rf"computes F\.{norm}_norm as elementary ops")
    with _NormTimesTwo(), refused:
        fe.vmap(input_grad)(params, buffers, x)
    with _Observing():  # a dispatch mode sees aten ops either way: not refused
        got = fe.vmap(input_grad)(params, buffers, x)
    for i, m in enumerate(members):
        xx = x.clone().requires_grad_()
        want = torch.autograd.grad(m(xx).pow(2).sum(), xx)[0]
        torch.testing.assert_close(got[i], want, rtol=1e-10, atol=1e-12)
    with _NormTimesTwo():
        got = fe.vmap(fmodel)(params, buffers, x)
        want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_users_dispatch_mode_sees_the_ops_vmap_runs():
    """unsupported.md: a dispatch mode of the user's sees vmap's aten ops for all members
    (layer_norm with per-member weights runs without them, then their product): one
    that observes works, one that changes values computes something else."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    class LayerNormTimesTwo(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return (
                (out[0] * 2, *out[1:]) if func is torch.ops.aten.native_layer_norm.default else out
            )

    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).double() for _ in range(3)]
    for m in members:
        with torch.no_grad():
            m[1].weight.uniform_(0.5, 2.0)
            m[1].bias.uniform_(-1.0, 1.0)
    ens = fe.Ensemble(copy.deepcopy(members))
    x = torch.randn(5, 4, dtype=torch.float64)
    with Counting() as counting:
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    assert torch.ops.aten.native_layer_norm.default in counting.ops
    with LayerNormTimesTwo():
        want = torch.stack([m(x) for m in members])
        got = ens(x)
    assert (got - want).abs().max() > 0.1  # the affine step came after the doubling
