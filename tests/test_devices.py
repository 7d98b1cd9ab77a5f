"""fe.distributed.ShardedEnsemble (members over devices) and the member split rule.

Several CPU "devices" run exactly the logic that several GPUs run; results are compared
with the single-device ensemble bit for bit, and with a plain loop over ordinary modules
and torch.optim within float64 tolerances.
"""

import itertools
import subprocess
import sys

import pytest
import torch
from helpers import (
    ATOL,
    RTOL,
    ZOO,
    assert_trees_close,
    assert_trees_equal,
    clone_modules,
    runtime_typecheck_off,
)
from torch import nn

import funcensemble as fe
from funcensemble.distributed import PerShard, ShardedEnsemble, member_slices

CPU3 = ["cpu", "cpu", "cpu"]
# Each member runs the same kernels on a shard as in the whole ensemble; for these models
# the results are bitwise equal. Attention's batched matmuls may block their sums
# differently for another number of members, so the transformer agrees to rounding.
EXACT = {"mlp", "cnn", "tied", "int_buffers"}


def _close(a, b):
    assert_trees_close(a, b, rtol=RTOL, atol=ATOL)


# --- the split rule --------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 7, 128])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_member_slices_are_contiguous_balanced_and_never_empty(n, parts):
    if parts > n:
        with pytest.raises(ValueError, match="a part would hold no member"):
            member_slices(n, parts)
        return
    slices = member_slices(n, parts)
    assert len(slices) == parts
    assert slices[0].start == 0 and slices[-1].stop == n
    assert all(a.stop == b.start for a, b in itertools.pairwise(slices))
    sizes = [s.stop - s.start for s in slices]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # larger parts first
    assert all(s.step is None for s in slices)


def test_member_slices_examples_from_the_docs():
    assert [s.stop - s.start for s in member_slices(128, 4)] == [32, 32, 32, 32]
    assert [s.stop - s.start for s in member_slices(10, 4)] == [3, 3, 2, 2]
    assert [s.stop - s.start for s in member_slices(5, 4)] == [2, 1, 1, 1]


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((0, 1), ValueError, r"num_members must be a positive int \(expected an int >= 1, got 0"),
        ((4, 0), ValueError, r"parts must be a positive int \(expected an int >= 1, got 0"),
        ((3, 4), ValueError, "cannot split 3 member.s. into 4 parts"),
        (
            (4.0, 2),
            TypeError,
            r"num_members must be a positive int \(expected an int >= 1, got float",
        ),
        ((4, True), TypeError, r"parts must be a positive int \(expected an int >= 1, got bool"),
    ],
)
def test_member_slices_errors(args, error, match):
    with runtime_typecheck_off(), pytest.raises(error, match=match):
        member_slices(*args)


# --- forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["mlp", "cnn", "transformer", "tied", "int_buffers"])
@pytest.mark.parametrize("train", [False, True])
def test_forward_equals_the_single_device_ensemble_exactly(model, train):
    zoo = ZOO[model]
    members = zoo.members(5, train=train)
    ens = fe.Ensemble(members)
    sharded = ShardedEnsemble(members, CPU3)
    assert sharded.sizes == (2, 2, 1)
    x = zoo.input()
    same = assert_trees_equal if model in EXACT else _close
    same(sharded(x), ens(x))
    # Train-mode BatchNorm updates running statistics in place, on every shard.
    same(sharded.to_ensemble().stacked_buffers(), ens.stacked_buffers())


@pytest.mark.parametrize("devices", [2, 7])
def test_float32_convolution_alone_on_a_device_agrees_to_rounding(devices):
    """The documented exception (scale-out.md): a float32 convolution that is the only
    member of its shard runs the ordinary kernel, not the grouped one of several
    members, and rounds differently; every member in a shard of two or more is exact."""
    ens = fe.Ensemble.from_factory(
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Flatten()),
        num_members=7,
        seed=0,
    )
    sharded = ShardedEnsemble(ens, ["cpu"] * devices)
    x = torch.randn(8, 2, 6, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = sharded(x), ens(x)
    if devices == 2:  # sizes (4, 3)
        assert_trees_equal(got, want)
    else:  # sizes (1, ..., 1)
        assert_trees_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert_trees_close(
        sharded.to_ensemble().stacked_buffers(), ens.stacked_buffers(), rtol=1e-5, atol=1e-6
    )


def test_forward_per_member_inputs_and_keywords():
    members = ZOO["mlp"].members(5, train=False)
    ens = fe.Ensemble(members)
    sharded = ShardedEnsemble(ens, ["cpu", "cpu"])
    xs = torch.randn(5, 7, 5, dtype=torch.float64)
    assert_trees_equal(sharded(xs, in_dims=0), ens(xs, in_dims=0))
    # A per-member input split along another dim, next to a shared one.
    x_t = xs.transpose(0, 1).contiguous()  # [batch, member, features]
    got = sharded.map(
        fe.vmap(lambda p, b, a, c: sharded.fmodel(p, b, a + c), in_dims=(1, None)),
        x_t,
        torch.ones(5, dtype=torch.float64),
        in_dims=(1, None),
    )
    want = ens(xs + 1, in_dims=0)
    assert_trees_equal(sharded.gather(got), want)


def test_outputs_gathered_or_left_sharded():
    members = ZOO["mlp"].members(5, train=False)
    sharded = ShardedEnsemble(members, CPU3)
    x = ZOO["mlp"].input()
    parts = sharded(x, gather=False)
    assert isinstance(parts, PerShard) and [p.shape[0] for p in parts] == [2, 2, 1]
    assert_trees_equal(sharded.gather(parts), sharded(x))
    assert_trees_equal(sharded(x, gather="cpu"), sharded(x))


def test_pytree_outputs_are_gathered_leaf_by_leaf():
    members = ZOO["mlp"].members(4, train=False)
    sharded = ShardedEnsemble(members, ["cpu", "cpu"])

    def two(p, b, x):
        out = sharded.fmodel(p, b, x)
        return {"out": out, "norm": out.norm()}

    x = ZOO["mlp"].input()
    got = sharded.gather(sharded.map(fe.vmap(two), x))
    want = fe.vmap(two)(*fe.stack(members)[1:], x)
    assert_trees_equal(got, want)


def test_state_is_copied_not_aliased():
    members = ZOO["mlp"].members(4, train=False)
    ens = fe.Ensemble(members)
    sharded = ShardedEnsemble(ens, ["cpu", "cpu"])
    before = {k: v.clone() for k, v in ens.stacked_params().items()}
    with torch.no_grad():
        for shard in sharded.params:
            for t in shard.values():
                t.add_(1.0)
    assert_trees_equal(ens.stacked_params(), before)
    assert all(t.requires_grad and t.is_leaf for s in sharded.params for t in s.values())


def test_to_ensemble_round_trip_and_options():
    members = ZOO["cnn"].members(5, train=True, dtype=torch.float64)
    ens = fe.Ensemble(members, chunk_size=2)
    sharded = ShardedEnsemble(ens, CPU3)
    assert sharded.chunk_size == 2 and sharded.randomness == "different"
    back = sharded.to_ensemble()
    assert isinstance(back, fe.Ensemble) and back.chunk_size == 2
    assert_trees_equal(back.state_dict(), ens.state_dict())
    assert back.training == ens.training
    assert sharded.eval() is sharded and not sharded.training
    assert sharded.train().training
    assert repr(sharded) == "ShardedEnsemble(num_members=5, cpu: 2, cpu: 2, cpu: 1)"
    assert len(sharded) == 5


# --- training --------------------------------------------------------------------------


def _mse(fmodel):
    def loss_fn(p, b, x, y):
        return torch.nn.functional.mse_loss(fmodel(p, b, x), y)

    return loss_fn


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_training_equals_single_device_exactly_and_the_loop(model):
    zoo = ZOO[model]
    members = zoo.members(5, train=True)
    x = zoo.input()
    fmodel, params, buffers = fe.stack(members)
    with torch.no_grad():  # a copy in eval mode: the members' statistics stay as they are
        y = torch.randn_like(clone_modules(members[:1])[0].eval()(x))
    opt = fe.optim.adam(1e-2)

    # The single-device functional reference.
    loss_fn = _mse(fmodel)
    step = fe.value_and_grad(loss_fn)
    state = opt.init(params)
    for _ in range(3):
        losses, grads, buffers = step(params, buffers, x, y)
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)

    sharded = ShardedEnsemble(members, CPU3)
    sharded_state = sharded.init_optimizer(opt)
    for _ in range(3):
        sharded_losses, sharded_state = sharded.step_(
            _mse(sharded.fmodel), opt, sharded_state, x, y
        )
    back = sharded.to_ensemble()
    assert_trees_equal(back.stacked_params(), params)
    assert_trees_equal(back.stacked_buffers(), buffers)
    assert_trees_equal(sharded.gather(sharded_losses), losses)
    # adam is chain(scale_by_adam, learning rate): its first state is the AdamState.
    assert_trees_equal(sharded.gather(PerShard(s[0].mu for s in sharded_state)), state[0].mu)

    # And the plain loop with torch.optim, member by member.
    loop = clone_modules(members)
    for i, m in enumerate(loop):
        torch_opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(3):
            torch_opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            torch_opt.step()
        # Adam divides by sqrt(v): rounding differences in near-zero gradients of the
        # first steps grow, so the loop agrees to 1e-7 rather than to RTOL.
        assert_trees_close(
            dict(m.named_parameters()),
            {k: v[i] for k, v in back.stacked_params().items()},
            rtol=1e-7,
            atol=1e-9,
        )


def test_per_shard_optimizers_give_per_member_hyperparameters():
    members = ZOO["mlp"].members(5, train=True)
    x = ZOO["mlp"].input()
    y = torch.randn(7, 3, dtype=torch.float64)
    lr = torch.logspace(-3, -1, 5, dtype=torch.float64)

    fmodel, params, buffers = fe.stack(members)
    opt = fe.optim.adam(lr)
    state = opt.init(params)
    for _ in range(2):
        _, grads, buffers = fe.value_and_grad(_mse(fmodel))(params, buffers, x, y)
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)

    sharded = ShardedEnsemble(members, CPU3)
    opts = PerShard(fe.optim.adam(lr[s]) for s in sharded.slices)
    sharded_state = sharded.init_optimizer(opts)
    for _ in range(2):
        _, sharded_state = sharded.step_(_mse(sharded.fmodel), opts, sharded_state, x, y)
    assert_trees_equal(sharded.to_ensemble().stacked_params(), params)


def test_step_with_per_member_batches_and_aux():
    members = ZOO["mlp"].members(4, train=True)
    sharded = ShardedEnsemble(members, ["cpu", "cpu"])
    xs = torch.randn(4, 6, 5, dtype=torch.float64)
    ys = torch.randn(4, 6, 3, dtype=torch.float64)

    def loss_fn(p, b, x, y):
        out = sharded.fmodel(p, b, x)
        return torch.nn.functional.mse_loss(out, y), out.mean()

    opt = fe.optim.adam(1e-2)
    losses, _, aux = sharded.step_(
        loss_fn, opt, sharded.init_optimizer(opt), xs, ys, in_dims=0, has_aux=True
    )
    fmodel, params, buffers = fe.stack(members)
    want_losses, _, _, want_aux = fe.value_and_grad(
        lambda p, b, x, y: (
            torch.nn.functional.mse_loss(fmodel(p, b, x), y),
            fmodel(p, b, x).mean(),
        ),
        in_dims=0,
        has_aux=True,
    )(params, buffers, xs, ys)
    assert_trees_equal(sharded.gather(losses), want_losses)
    assert_trees_equal(sharded.gather(aux), want_aux)


def test_map_passes_per_shard_values_and_unzips():
    members = ZOO["mlp"].members(5, train=False)
    sharded = ShardedEnsemble(members, CPU3)
    tags = PerShard(["a", "b", "c"])
    got = sharded.map(
        lambda p, b, tag, *, scale: (tag, p["0.weight"].shape[0] * scale), tags, scale=10
    )
    names, counts = got.unzip()
    assert names == PerShard(["a", "b", "c"]) and counts == PerShard([20, 20, 10])


def test_params_and_buffers_can_be_replaced_with_checks():
    sharded = ShardedEnsemble(ZOO["mlp"].members(4, train=False), ["cpu", "cpu"])
    new = PerShard({k: v.detach() * 0 for k, v in s.items()} for s in sharded.params)
    sharded.params = new
    assert all(float(t.abs().sum()) == 0 for s in sharded.params for t in s.values())
    with pytest.raises(
        ValueError,
        match=r"params do not come one dict per shard \(expected 2 dicts, .*got list of 1\)",
    ):
        sharded.params = [new[0]]
    with pytest.raises(ValueError, match="shard 1 must map the names"):
        sharded.buffers = [{}, {"x": torch.zeros(1)}]


# --- errors ----------------------------------------------------------------------------


def test_construction_errors():
    members = ZOO["mlp"].members(2, train=False)
    with pytest.raises(ValueError, match=r"cannot split 2 member\(s\) into 3 parts"):
        ShardedEnsemble(members, CPU3)
    with pytest.raises(
        ValueError, match=r"devices is empty \(expected at least one device, got 0\)"
    ):
        ShardedEnsemble(members, [])
    with runtime_typecheck_off(), pytest.raises(TypeError, match="devices must be a list of"):
        ShardedEnsemble(members, "cpu")
    with pytest.raises(ValueError, match="'nonsense' is not a device name"):
        ShardedEnsemble(members, ["nonsense"])
    with pytest.raises(ValueError, match="meta device holds no values"):
        ShardedEnsemble(members, ["meta"])
    with runtime_typecheck_off(), pytest.raises(ValueError, match="randomness must be"):
        ShardedEnsemble(members, ["cpu"], randomness="sometimes")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="asks for CUDA, but CUDA is not available"):
            ShardedEnsemble(members, ["cuda:0"])


def test_map_and_gather_errors():
    sharded = ShardedEnsemble(ZOO["mlp"].members(5, train=False), ["cpu", "cpu"])
    forward = fe.vmap(sharded.fmodel, in_dims=0)
    with pytest.raises(ValueError, match=r"ShardedEnsemble.map: argument 0 has size 4 along"):
        sharded.map(forward, torch.randn(4, 7, 5, dtype=torch.float64), in_dims=0)
    with pytest.raises(ValueError, match="PerShard of 3 values; this ensemble has 2 shards"):
        sharded.map(lambda p, b, s: s, PerShard([1, 2, 3]))
    with pytest.raises(
        ValueError, match=r"its in_dims entry must be None \(expected None, got 0\)"
    ):
        sharded.map(lambda p, b, s: s, PerShard([1, 2]), in_dims=0)
    with pytest.raises(ValueError, match="in_dims has 2 entries but the call passed 1"):
        sharded.map(forward, torch.randn(5, 7, 5), in_dims=(0, 0))
    with (
        runtime_typecheck_off(),
        pytest.raises(TypeError, match=r"fn is not callable \(expected a callable, got int\)"),
    ):
        sharded.map(3)
    with pytest.raises(
        ValueError,
        match=r"outputs do not come one per shard \(expected 2 outputs, .*got PerShard of 1\)",
    ):
        sharded.gather(PerShard([torch.zeros(3)]))
    with pytest.raises(TypeError, match="leaf 0 of shard 0's output is a str"):
        sharded.gather(PerShard(["a", "b"]))
    with pytest.raises(ValueError, match="leaf 0 of shard 1's output has leading size 3"):
        sharded.gather(PerShard([torch.zeros(3), torch.zeros(3)]))
    with pytest.raises(ValueError, match="shard 1's output has structure"):
        sharded.gather(PerShard([torch.zeros(3), {"a": torch.zeros(2)}]))
    with pytest.raises(ValueError, match="every shard's value must be a tuple of one length"):
        PerShard([(1, 2), (3,)]).unzip()


def test_step_errors():
    sharded = ShardedEnsemble(ZOO["mlp"].members(4, train=False), ["cpu", "cpu"])
    opt = fe.optim.adam(1e-3)
    state = sharded.init_optimizer(opt)
    loss_fn = _mse(sharded.fmodel)
    x, y = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    with (
        runtime_typecheck_off(),
        pytest.raises(
            TypeError,
            match=r"optimizer 0 is a SGD, not a GradientTransformation \(expected one such as",
        ),
    ):
        sharded.step_(loss_fn, torch.optim.SGD([torch.zeros(1)], lr=0.1), state, x, y)
    with pytest.raises(
        ValueError,
        match=r"optimizer does not come one per shard \(expected 2 optimizers, .*got 3\)",
    ):
        sharded.step_(loss_fn, PerShard([opt] * 3), state, x, y)
    with (
        runtime_typecheck_off(),
        pytest.raises(TypeError, match="state must be the PerShard returned by init_optimizer"),
    ):
        sharded.step_(loss_fn, opt, list(state), x, y)


def test_step_names_the_users_argument_and_itself():
    """A per-member batch of the wrong size was reported as `ShardedEnsemble.map:
    argument 2` (counting step_'s own optimizer and state arguments)."""
    sharded = ShardedEnsemble(ZOO["mlp"].members(4, train=False), ["cpu", "cpu"])
    opt = fe.optim.adam(1e-3)
    state = sharded.init_optimizer(opt)
    x, y = torch.randn(3, 5, 5, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    before = [{k: v.clone() for k, v in shard.items()} for shard in sharded.params]
    with pytest.raises(
        ValueError, match=r"ShardedEnsemble.step_: argument 0 has size 3 along its member dim 0"
    ):
        sharded.step_(_mse(sharded.fmodel), opt, state, x, y, in_dims=0)
    for shard, was in zip(sharded.params, before, strict=True):
        assert all(torch.equal(shard[k], v) for k, v in was.items())


def test_the_state_setters_check_every_shards_tensors():
    """The params/buffers setters checked only the names: a shard holding another
    shard's members (sizes still reporting the old split) or too few members was taken,
    and to_ensemble then reordered or lost members."""
    sharded = ShardedEnsemble(ZOO["mlp"].members(5, train=False), ["cpu", "cpu"])  # 3 + 2
    params = sharded.params
    with pytest.raises(
        ValueError,
        match=r"shard 0's `0.weight` does not fit the shard \(expected shape \(3, 16, 5\) "
        r"on cpu: its 3 members first, got shape \(2, 16, 5\) on cpu\)",
    ):
        sharded.params = [params[1], params[0]]
    with pytest.raises(ValueError, match=r"shard 1's `0.bias` does not fit the shard"):
        sharded.params = [params[0], {**params[1], "0.bias": params[1]["0.bias"][:1]}]
    assert sharded.params is params  # nothing replaced
    sharded.params = [{k: v + 1 for k, v in p.items()} for p in params]  # same layout: fine
    assert torch.equal(sharded.params[0]["0.bias"], params[0]["0.bias"] + 1)


def test_a_hetero_ensemble_is_refused_clearly():
    hens = fe.HeteroEnsemble([nn.Linear(3, 2), nn.Linear(3, 4)])
    with runtime_typecheck_off(), pytest.raises(TypeError, match=r"ShardedEnsemble: got a Hetero"):
        ShardedEnsemble(hens, ["cpu"])


def test_a_later_shards_failure_puts_back_the_earlier_shards_statistics():
    """Shards run one after another: shard 1's refusal of its input came after shard
    0's BatchNorm had updated its statistics (running_mean 0.059 off, counts [2, 2, 1,
    1] against [1, 1, 1, 1]); one Ensemble's failed call changes nothing."""
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))  # noqa: E731
    sharded = ShardedEnsemble([make() for _ in range(4)], ["cpu", "cpu"])
    x = torch.randn(8, 3)
    sharded(x)
    before = [{k: v.clone() for k, v in b.items()} for b in sharded.buffers]
    with pytest.raises(ValueError, match="expects 3 input features"):
        sharded(PerShard([x, torch.randn(8, 4)]))
    for k, buffers in enumerate(sharded.buffers):
        for name, value in buffers.items():
            assert torch.equal(value, before[k][name]), (k, name)


# --- CUDA (skipped without a GPU) ------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_shards_match_cpu_and_launch_without_synchronizing():
    count = torch.cuda.device_count()
    devices = [f"cuda:{k % count}" for k in range(2)]
    members = ZOO["mlp"].members(6, train=True, dtype=torch.float32)
    ens = fe.Ensemble(clone_modules(members))
    sharded = ShardedEnsemble(members, devices)
    x = torch.randn(7, 5)
    y = torch.randn(7, 3)
    torch.testing.assert_close(sharded(x, gather="cpu"), ens(x), rtol=1e-5, atol=1e-6)

    opt = fe.optim.adam(1e-2)
    state = sharded.init_optimizer(opt)
    # Batches already on each shard's device: nothing in the step needs the host.
    xs = PerShard(x.to(d) for d in sharded.devices)
    ys = PerShard(y.to(d) for d in sharded.devices)
    loss_fn = _mse(sharded.fmodel)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronization raises
    try:
        for _ in range(3):
            losses, state = sharded.step_(loss_fn, opt, state, xs, ys)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [t.device for t in losses] == list(sharded.devices)
    assert all(t.device.type == "cuda" for s in sharded.params for t in s.values())


def _wide_members(num: int, width: int = 1024, depth: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])
        for _ in range(num)
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_forward_launches_without_waiting_and_gathers_only_arrived_values():
    count = torch.cuda.device_count()
    devices = [f"cuda:{k % count}" for k in range(2)]
    members = _wide_members(6)
    ens = fe.Ensemble(clone_modules(members))  # on the CPU: the reference
    sharded = ShardedEnsemble(members, devices)
    x = torch.randn(512, 1024)
    with torch.no_grad():
        want = ens(x)
        pinned = x.pin_memory()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host-device synchronization raises
        try:
            parts = sharded(pinned, gather=False)  # copies in, launches: nothing waits
            on_gpu = sharded.gather(parts)  # to cuda:0, ordered on the streams
        finally:
            torch.cuda.set_sync_debug_mode(0)
        # Read on the host at once, while the GPUs may still be busy: gather to the CPU
        # must have waited for every copy.
        on_cpu = sharded.gather(sharded(pinned, gather=False), device="cpu")
        copied = on_cpu.clone()
    assert on_gpu.device == torch.device(devices[0]) and on_cpu.device.type == "cpu"
    torch.testing.assert_close(copied, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(copied, on_gpu.cpu(), rtol=1e-6, atol=1e-6)
    back = sharded.to_ensemble(device="cpu")
    assert torch.equal(back.stacked[0].weight, ens.stacked[0].weight)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_compute_at_the_same_time():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sharded = ShardedEnsemble(_wide_members(8), ["cuda:0", "cuda:1"])
    # Milliseconds of GPU work per shard, far more than the launches take in Python:
    # otherwise each GPU would finish its kernels as soon as they are launched.
    xs = PerShard(torch.randn(16384, 1024, device=d) for d in sharded.devices)
    with torch.no_grad():
        sharded(xs, gather=False)  # warm up: cuBLAS handles, kernels chosen
        for d in sharded.devices:
            torch.cuda.synchronize(d)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                sharded(xs, gather=False)
            for d in sharded.devices:
                torch.cuda.synchronize(d)
    spans: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA and event.device_index in spans:
            spans[event.device_index].append((event.time_range.start, event.time_range.end))
    assert spans[0] and spans[1], "the profiler recorded no kernels on one of the GPUs"

    def union(intervals):
        merged = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return merged

    busy = [union(spans[0]), union(spans[1])]
    both = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in busy[0] for b0, b1 in busy[1])
    alone = min(sum(e - s for s, e in b) for b in busy)
    # Launched one after another, the devices would never run at once (both = 0).
    assert both > 0.5 * alone, (both, alone)


def test_models_with_unused_parameters_train_on_shards():
    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(3, 1)
            self.unused = nn.Linear(3, 1)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    members = [Partly().double() for _ in range(3)]
    sharded = ShardedEnsemble(members, ["cpu", "cpu"])
    opt = fe.optim.adam(1e-2)
    before = sharded.to_ensemble().stacked.unused.weight.clone()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    sharded.step_(_mse(sharded.fmodel), opt, sharded.init_optimizer(opt), x, y)
    assert torch.equal(sharded.to_ensemble().stacked.unused.weight, before)


@pytest.mark.parametrize("face", ["forward", "step_"])
def test_randomness_same_gives_every_shard_one_draw(face):
    """randomness="same": every member draws the same dropout mask, on shards of one
    device as in one Ensemble (each shard drew anew before: a mask per shard)."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(6, 64), nn.Dropout(0.5)) for _ in range(5)]
    for m in members:
        nn.init.zeros_(m[0].weight)
        nn.init.ones_(m[0].bias)  # every output 1 before dropout: the mask shows
    sharded = ShardedEnsemble(members, CPU3, randomness="same")
    x = torch.randn(8, 6)
    start = torch.get_rng_state()
    if face == "forward":
        out = sharded(x)
    else:

        def loss_fn(p, b, x):
            out = sharded.fmodel(p, b, x)
            return out.sum(), out

        opt = fe.optim.sgd(0.0)
        _, _, outs = sharded.step_(loss_fn, opt, sharded.init_optimizer(opt), x, has_aux=True)
        out = sharded.gather(outs)
    assert out.shape[0] == 5
    for member in out[1:]:
        assert torch.equal(member != 0, out[0] != 0)
    assert 0 < (out[0] != 0).float().mean() < 1
    torch.set_rng_state(start)  # the shards replay the first one's draw: one device's
    whole = fe.Ensemble(members, randomness="same")(x)
    assert torch.equal(out.detach(), whole.detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_randomness_same_on_several_devices_is_refused():
    members = [nn.Linear(3, 2) for _ in range(2)]
    with pytest.raises(ValueError, match="randomness='same' shares one draw among all members"):
        ShardedEnsemble(members, ["cpu", "cuda:0"], randomness="same")


_CUDA_SEED_SCRIPT = """
import torch
from torch import nn
import funcensemble as fe

def make():
    return nn.Linear(5, 3, device="cuda")

assert not torch.cuda.is_initialized()
a = fe.Ensemble.from_factory(make, num_members=3, seed=1)  # the factory starts CUDA
cuda = torch.cuda.get_rng_state()
b = fe.Ensemble.from_factory(make, num_members=2, seed=1)  # CUDA already started
assert torch.equal(torch.cuda.get_rng_state(), cuda)  # the global generator left alone
assert torch.equal(a.stacked_params()["weight"][:2], b.stacked_params()["weight"])
assert not torch.equal(a.member(0).weight, a.member(1).weight)
print("ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_members_built_on_cuda_come_from_their_seed():
    """from_factory(seed=) seeded only the CPU generator: a factory building on CUDA drew
    from CUDA's, at torch's default seed in every process (MemberShard's ranks built the
    same members), and members were not reproducible from (seed, i). In a fresh process:
    CUDA must start inside the factory."""
    done = subprocess.run(
        [sys.executable, "-c", _CUDA_SEED_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_a_narrow_linear_member_agrees_with_the_whole_to_rounding(dtype):
    """scale-out.md's third exception: members that are one narrow Linear run as one
    product of N * out rows, whose BLAS kernel may depend on N; split, they agree with
    the one-device ensemble to rounding (documented: 2.2e-16 in float64, 9e-8 in
    float32 outputs)."""
    ens = fe.Ensemble.from_factory(lambda: nn.Linear(9, 1).to(dtype), num_members=7, seed=0)
    x = torch.randn(33, 9, dtype=dtype)
    whole = ens(x)
    tol = {"rtol": 0, "atol": 1e-15} if dtype == torch.float64 else {"rtol": 0, "atol": 1e-6}
    for devices in (["cpu"] * 2, CPU3, ["cpu"] * 7):
        torch.testing.assert_close(ShardedEnsemble(ens, devices)(x), whole, **tol)
    torch.testing.assert_close(ens.select([0, 1])(x), whole[:2], **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_randomness_with_chunks_replays_the_cuda_draw():
    """torch's chunked vmap replays only the CPU generator: with randomness="same" and
    chunk_size, a CUDA ensemble's dropout drew a new mask for every chunk, so members
    did not share one draw (fe.value_and_grad, which replays CUDA's, shared it)."""
    members = [nn.Sequential(nn.Linear(6, 64), nn.Dropout(0.5)).cuda() for _ in range(5)]
    for m in members[1:]:
        m.load_state_dict(members[0].state_dict())
    x = torch.randn(8, 6, device="cuda")
    outs = {}
    for chunk_size in (None, 2):
        ens = fe.Ensemble(members, randomness="same", chunk_size=chunk_size)
        torch.manual_seed(0)
        outs[chunk_size] = ens(x)
    assert torch.equal(outs[2], outs[None])
    assert all(torch.equal(outs[2][i], outs[2][0]) for i in range(5))
