"""fe.optim.polyak_update_ / polyak_update against a loop of p_t.mul_(1-tau).add_(tau*p_o)
(float64, to rounding: the library computes lerp, the half-precision tests compare with
the loop's lerp_ bit for bit)."""

import copy
import itertools
import math

import pytest
import torch
from helpers import assert_trees_equal, optim_net_members, runtime_typecheck_off
from torch import nn

import funcensemble as fe

N = 3
TOL = {"rtol": 1e-12, "atol": 1e-12}


def reference_(target: list[nn.Module], online: list[nn.Module], taus: list[float]) -> None:
    """The plain loop: per module, floating parameters and buffers; integer ones copied."""
    with torch.no_grad():
        for t, o, tau in zip(target, online, taus, strict=True):
            pairs = list(zip(t.parameters(), o.parameters(), strict=True))
            pairs += list(zip(t.buffers(), o.buffers(), strict=True))
            for p_t, p_o in pairs:
                if p_t.is_floating_point():
                    p_t.mul_(1 - tau).add_(tau * p_o)
                else:
                    p_t.copy_(p_o)


def trained(seed: int) -> list[nn.Module]:
    """Members whose buffers (BatchNorm statistics, counters) have moved off their init."""
    members = optim_net_members(N, seed=seed)
    for k, m in enumerate(members):
        for _ in range(k + seed + 1):
            m(torch.randn(5, 4, dtype=torch.float64))
    return members


@pytest.mark.parametrize("per_member", [False, True])
def test_ensembles_match_the_loop(per_member):
    target_modules, online_modules = trained(1), trained(2)
    target, online = fe.Ensemble(target_modules), fe.Ensemble(online_modules)
    taus = [0.005, 0.3, 1.0] if per_member else [0.005] * N
    tau = torch.tensor(taus, dtype=torch.float64) if per_member else 0.005
    for _ in range(3):
        fe.optim.polyak_update_(target, online, tau)
        reference_(target_modules, online_modules, taus)
    for i, expected in enumerate(target_modules):
        got = target.member(i)
        for (name, a), b in zip(
            got.state_dict().items(), expected.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(a, b, **TOL, msg=name)
    # Integer buffers are copied from online.
    assert torch.equal(target.stacked.bn.num_batches_tracked, online.stacked.bn.num_batches_tracked)


@pytest.mark.parametrize("per_member", [False, True])
def test_dicts_match_the_loop(per_member):
    g = torch.Generator().manual_seed(0)
    target = {
        "w": torch.randn(N, 4, 3, generator=g, dtype=torch.float64),
        "s": torch.randn(N, generator=g, dtype=torch.float64),
        "nested": [torch.randn(N, 2, generator=g, dtype=torch.float32), None],
    }
    online = {
        "w": torch.randn(N, 4, 3, generator=g, dtype=torch.float64),
        "s": torch.randn(N, generator=g, dtype=torch.float64),
        "nested": [torch.randn(N, 2, generator=g, dtype=torch.float32), None],
    }
    taus = [0.1, 0.5, 0.9] if per_member else [0.1] * N
    tau = torch.tensor(taus) if per_member else 0.1
    expected = copy.deepcopy(target)
    with torch.no_grad():
        for leaf_t, leaf_o in [
            (expected["w"], online["w"]),
            (expected["s"], online["s"]),
            (expected["nested"][0], online["nested"][0]),
        ]:
            for i in range(N):
                leaf_t[i].mul_(1 - taus[i]).add_(taus[i] * leaf_o[i])
    pure = fe.optim.polyak_update(target, online, tau)
    fe.optim.polyak_update_(target, online, tau)
    tol = {"rtol": 1e-6, "atol": 1e-6}  # the float32 leaf
    torch.testing.assert_close(target, expected, **tol)
    torch.testing.assert_close(pure, expected, **tol)
    assert target["nested"][1] is None and pure["nested"][1] is None


def test_tau_zero_and_one():
    target = {"w": torch.randn(N, 3, dtype=torch.float64)}
    online = {"w": torch.randn(N, 3, dtype=torch.float64)}
    before = target["w"].clone()
    fe.optim.polyak_update_(target, online, 0.0)
    assert torch.equal(target["w"], before)
    fe.optim.polyak_update_(target, online, 1.0)
    assert torch.equal(target["w"], online["w"])


def test_tau_one_keeps_a_nan_or_infinite_target_value_as_the_loops_lerp_does():
    """The docstring: tau=1 gives online's values where the target is finite only."""
    target = torch.tensor([[math.nan, math.inf, -math.inf, 1.0]], dtype=torch.float64)
    online = torch.tensor([[2.0, 3.0, 4.0, 5.0]], dtype=torch.float64)
    loop = target.clone().lerp_(online, 1.0)
    fe.optim.polyak_update_({"w": target}, {"w": online}, 1.0)
    assert torch.equal(target[0, 3:], online[0, 3:])
    assert target[0, :3].isnan().all() and loop[0, :3].isnan().all()


# torch 2.10-2.12's profiler warns that it clears its events after each cycle.
@pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")
def test_in_place_update_is_one_foreach_kernel():
    target, online = fe.Ensemble(trained(1)), fe.Ensemble(trained(2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fe.optim.polyak_update_(target, online, 0.01)
    names = [e.name for e in prof.events()]
    assert names.count("aten::_foreach_lerp_") == 1
    assert "aten::mul_" not in names


def test_in_place_update_records_no_history_and_keeps_parameters():
    target, online = fe.Ensemble(trained(1)), fe.Ensemble(trained(2))
    weight = target.stacked.fc1.weight
    fe.optim.polyak_update_(target, online, 0.5)
    assert target.stacked.fc1.weight is weight and weight.is_leaf and weight.grad_fn is None


def test_pure_update_leaves_inputs_untouched_and_returns_fresh_leaves():
    _, target, _ = fe.stack([nn.Linear(3, 2) for _ in range(N)])
    _, online, _ = fe.stack([nn.Linear(3, 2) for _ in range(N)])
    target["count"] = torch.zeros(N, dtype=torch.int64)
    online["count"] = torch.ones(N, dtype=torch.int64)
    snapshot = copy.deepcopy((target, online))
    new = fe.optim.polyak_update(target, online, 0.25)
    assert_trees_equal((target, online), snapshot)
    assert new["weight"].requires_grad and new["weight"].is_leaf
    assert torch.equal(new["count"], online["count"]) and new["count"] is not online["count"]


# --- validation -------------------------------------------------------------------------


def pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return {"w": torch.zeros(N, 2)}, {"w": torch.ones(N, 2)}


@pytest.mark.parametrize("update", [fe.optim.polyak_update_, fe.optim.polyak_update])
@pytest.mark.parametrize(
    ("tau", "match"),
    [
        (-0.1, r"Invalid tau: -0\.1\. Expected 0 <= tau <= 1\."),
        (1.5, r"Invalid tau: 1\.5"),
        (float("nan"), r"Invalid tau: nan"),
        (torch.tensor([0.1, 0.2, 1.5]), r"Invalid tau: 1\.5 \(member 2 of the per-member tau\)"),
        (
            torch.tensor([0.1, 0.2]),
            r"tau has 2 per-member values but target\['w'\] has leading "
            r"size 3",
        ),
    ],
)
def test_invalid_tau(update, tau, match):
    target, online = pair()
    with pytest.raises(ValueError, match=match):
        update(target, online, tau)
    assert not target["w"].any()


@pytest.mark.parametrize("update", [fe.optim.polyak_update_, fe.optim.polyak_update])
def test_mismatched_trees(update):
    target, online = pair()
    with pytest.raises(ValueError, match=r"target and online differ in structure"):
        update(target, {"v": online["w"]}, 0.1)
    with pytest.raises(
        ValueError,
        match=r"target\['w'\] is \(3, 2\) torch.float32 on cpu in "
        r"target but \(3, 3\)",
    ):
        update(target, {"w": torch.ones(N, 3)}, 0.1)
    with pytest.raises(ValueError, match=r"torch.float64"):
        update(target, {"w": torch.ones(N, 2, dtype=torch.float64)}, 0.1)
    with runtime_typecheck_off(), pytest.raises(TypeError, match=r"must be a tensor in both"):
        update({"w": 1.0}, {"w": 2.0}, 0.1)
    with runtime_typecheck_off(), pytest.raises(TypeError, match=r"tau must be a float"):
        update(target, online, "0.1")
    assert not target["w"].any()


def test_mixed_kinds_and_ensembles_in_the_pure_form():
    ens = fe.Ensemble([nn.Linear(2, 2) for _ in range(N)])
    with runtime_typecheck_off():
        with pytest.raises(TypeError, match=r"both be Ensembles or both be pytrees"):
            fe.optim.polyak_update_(ens, ens.stacked_params(), 0.1)
        with pytest.raises(TypeError, match=r"use polyak_update_ to update an Ensemble in place"):
            fe.optim.polyak_update(ens, ens, 0.1)


def test_ensembles_of_different_architectures():
    a = fe.Ensemble([nn.Linear(2, 2) for _ in range(N)])
    b = fe.Ensemble([nn.Linear(2, 3) for _ in range(N)])
    before = a.stacked.weight.detach().clone()
    with pytest.raises(ValueError, match=r"target\['params'\]\['bias'\] is \(3, 2\)"):
        fe.optim.polyak_update_(a, b, 0.1)
    assert torch.equal(a.stacked.weight, before)


def test_a_per_member_tau_on_a_hetero_ensemble_names_the_per_group_route_which_works():
    def make():
        torch.manual_seed(0)
        return fe.HeteroEnsemble(
            [nn.Linear(3, 1), nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)), nn.Linear(3, 1)]
        )

    target, online = make(), make()
    with torch.no_grad():
        for p in online.parameters():
            p.add_(1.0)
    tau = torch.tensor([0.1, 0.2, 0.3])
    with pytest.raises(
        ValueError, match=r"tau\[list\(hens.group_members\[g\]\)\] with hens.groups"
    ):
        fe.optim.polyak_update_(target, online, tau)
    loop = [copy.deepcopy(target.member(i)) for i in range(3)]
    for g, members in enumerate(target.group_members):
        fe.optim.polyak_update_(target.groups[g], online.groups[g], tau[list(members)])
    for i, m in enumerate(loop):
        with torch.no_grad():
            for pt, po in zip(m.parameters(), online.member(i).parameters(), strict=True):
                pt.mul_(1 - tau[i]).add_(tau[i] * po)
        for pt, pe in zip(m.parameters(), target.member(i).parameters(), strict=True):
            torch.testing.assert_close(pe, pt)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_leaves_are_averaged_as_the_loop_averages_them(dtype):
    """Complex leaves were copied from online whatever tau (0.9 off at tau=0.1)."""
    target = {"w": torch.zeros(3, 2, dtype=dtype)}
    online = {"w": torch.randn(3, 2, dtype=dtype)}
    want = target["w"].clone()
    for i in range(3):
        want[i].lerp_(online["w"][i], 0.1)
    assert torch.equal(fe.optim.polyak_update(target, online, 0.1)["w"], want)
    fe.optim.polyak_update_(target, online, 0.1)
    assert torch.equal(target["w"], want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_per_member_tau_on_half_leaves_is_the_loops_float_tau(dtype):
    """A [N] tau was cast to the leaf's dtype (0.3 -> 0.30078125 in bfloat16): 6346 of
    16384 elements 1 ulp off the loop's t.lerp_(o, 0.3) after one step."""
    torch.manual_seed(0)
    tau = torch.tensor([0.3, 0.7, 0.1, 0.55])
    target = {"w": torch.randn(4, 64, 64).to(dtype)}
    online = {"w": torch.randn(4, 64, 64).to(dtype)}
    want = target["w"].clone()
    for i in range(4):
        want[i].lerp_(online["w"][i], float(tau[i]))
    assert torch.equal(fe.optim.polyak_update(target, online, tau)["w"], want)
    fe.optim.polyak_update_(target, online, tau)
    assert torch.equal(target["w"], want)


def _inference_zeros() -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(4, 3)


def test_a_target_sharing_part_of_its_memory_with_online_is_refused_before_any_change():
    """torch's lerp_ and copy_ raise on partly overlapping operands: they did so after
    the earlier leaves had been averaged. The same tensor in both stays allowed."""
    floats, ints = torch.zeros(8), torch.zeros(8, dtype=torch.long)
    for shared, online_leaf in ((floats, floats[2:8]), (ints, ints[2:8])):
        target = {"a": torch.zeros(4, 3), "z": shared[0:6]}
        online = {"a": torch.ones(4, 3), "z": online_leaf}
        with pytest.raises(ValueError, match=r"target\['z'\] shares part of its memory"):
            fe.optim.polyak_update_(target, online, 0.5)
        assert torch.equal(target["a"], torch.zeros(4, 3))
        assert not shared.any()
    same = {"a": torch.ones(4, 3)}
    fe.optim.polyak_update_(same, same, 0.5)  # the loop's t.lerp_(t, tau): a no-op
    assert torch.equal(same["a"], torch.ones(4, 3))
    square = torch.zeros(4, 4)  # the same memory read in another order, as torch sees it
    target = {"a": torch.zeros(2), "z": square}
    with pytest.raises(ValueError, match=r"target\['z'\] shares part of its memory"):
        fe.optim.polyak_update_(target, {"a": torch.ones(2), "z": square.t()}, 0.5)
    assert not target["a"].any()
    grid = torch.zeros(4, 4)  # disjoint halves of one tensor: allowed, as torch allows
    fe.optim.polyak_update_({"a": grid[:, :2]}, {"a": grid[:, 2:]}, 0.5)


@pytest.mark.parametrize(("target_cols", "online_cols"), [((1, 4), (0, 3)), ((0, 3), (1, 4))])
def test_strided_targets_sharing_elements_with_online_are_refused(target_cols, online_cols):
    """Each member's row slices of one tensor are dense, so the loop's lerp_ refuses
    them; the stacked views are not, and were averaged in place, reading elements
    already written (member 0 became [0.5, 1.25, 2.125], not [0.5, 1.5, 2.5])."""
    base = torch.arange(30, dtype=torch.float64).reshape(3, 10)
    target, online = base[:, slice(*target_cols)], base[:, slice(*online_cols)]
    loop = base.clone()
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        loop[0, slice(*target_cols)].lerp_(loop[0, slice(*online_cols)], 0.5)
    with pytest.raises(ValueError, match=r"target\['w'\] shares part of its memory"):
        fe.optim.polyak_update_({"w": target}, {"w": online}, 0.5)
    assert torch.equal(base, torch.arange(30, dtype=torch.float64).reshape(3, 10))


def test_strided_views_of_one_tensor_with_no_element_in_common_are_averaged_as_the_loop():
    base = torch.arange(24, dtype=torch.float64).reshape(3, 8)
    want = base.clone()
    for i in range(3):
        want[i, ::2].lerp_(want[i, 1::2], 0.25)
    fe.optim.polyak_update_({"w": base[:, ::2]}, {"w": base[:, 1::2]}, 0.25)
    assert torch.equal(base, want)


def test_partly_shared_agrees_with_the_elements_each_view_reads():
    """Random strided views of one storage against a set of each view's element
    offsets: partly shared exactly when the sets meet and the views differ."""
    from funcensemble import _torch_compat
    from funcensemble.optim import _aliasing

    gen = torch.Generator().manual_seed(0)
    storage = torch.zeros(200)

    def view() -> torch.Tensor:
        dims = int(torch.randint(1, 4, (), generator=gen))
        size = [int(s) for s in torch.randint(1, 5, (dims,), generator=gen)]
        stride = [int(s) for s in torch.randint(0, 12, (dims,), generator=gen)]
        stride = [s if s else 1 for s in stride]
        offset = int(torch.randint(0, 60, (), generator=gen))
        return storage.as_strided(size, stride, offset)

    def elements(t: torch.Tensor) -> set[int]:
        return {t[i].data_ptr() for i in itertools.product(*map(range, t.shape))}

    seen = {True: 0, False: 0}
    for _ in range(3000):
        a, b = view(), view()
        if _torch_compat.overlaps_itself(a) or _torch_compat.overlaps_itself(b):
            continue
        one_view = (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())
        want = bool(elements(a) & elements(b)) and not one_view
        assert _aliasing.partly_shared(a, b) == want, (a.shape, a.stride(), b.shape)
        seen[want] += 1
    assert min(seen.values()) > 100, seen


def test_wrapper_subclass_leaves_are_averaged():
    """A tensor subclass holding no memory of its own (DTensor, TwoTensor) passes the
    overlap check, which reads memory addresses, and is averaged as the loop's lerp_."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    target = TwoTensor(torch.randn(3, 2), torch.randn(3, 2))
    online = TwoTensor(torch.randn(3, 2), torch.randn(3, 2))
    want = (target.a.lerp(online.a, 0.5), target.b.lerp(online.b, 0.5))
    fe.optim.polyak_update_({"w": target}, {"w": online}, 0.5)
    assert torch.equal(target.a, want[0]) and torch.equal(target.b, want[1])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda: torch.zeros(1, 3).expand(4, 3), "an expanded view"),
        (lambda: torch.zeros(1, dtype=torch.long).expand(4), "an expanded view"),
        (_inference_zeros, "an inference tensor"),
    ],
    ids=["expanded-float", "expanded-int", "inference"],
)
def test_a_target_that_cannot_be_written_is_refused_before_any_leaf_changes(bad, message):
    """Earlier leaves were averaged before torch raised on a later one."""
    target = {"a": torch.zeros(4, 3), "z": bad()}
    online = {"a": torch.ones(4, 3), "z": torch.ones_like(target["z"].clone())}
    with pytest.raises(ValueError, match=rf"target\['z'\] is {message}"):
        fe.optim.polyak_update_(target, online, 0.5)
    assert torch.equal(target["a"], torch.zeros(4, 3))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_member", [False, True])
def test_each_member_gets_the_loops_lerp_bit_for_bit(dtype, per_member):
    """polyak_update_'s docstring: each member gets what t.lerp_(o, tau) gives it."""
    torch.manual_seed(0)
    taus = [0.005, 0.3, 0.9] if per_member else [0.005] * 3
    tau = torch.tensor(taus, dtype=torch.float64) if per_member else 0.005
    target = {"w": torch.randn(3, 8, 16).to(dtype), "b": torch.randn(3, 16).to(dtype)}
    online = {k: torch.randn_like(v) for k, v in target.items()}
    want = {k: v.clone() for k, v in target.items()}
    for _ in range(5):
        for k in want:
            for i in range(3):
                want[k][i].lerp_(online[k][i], taus[i])
        fe.optim.polyak_update_(target, online, tau)
    for k in want:
        assert torch.equal(target[k], want[k]), k


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_member", [False, True])
def test_both_forms_inside_torch_func_vmap_give_each_slice_the_loops_lerp(dtype, per_member):
    """torch.func.vmap over a leading axis (e.g. seeds, each an ensemble of 3): the
    multi-tensor kernels have no batching rule, and both forms raised torch's error."""
    torch.manual_seed(0)
    taus = [0.005, 0.3, 0.9] if per_member else [0.3] * 3
    tau = torch.tensor(taus, dtype=torch.float64) if per_member else 0.3
    target = {"w": torch.randn(2, 3, 8, 16).to(dtype), "n": torch.zeros(2, 3, dtype=torch.long)}
    online = {"w": torch.randn(2, 3, 8, 16).to(dtype), "n": torch.ones(2, 3, dtype=torch.long)}
    want = target["w"].clone()
    for s in range(2):
        for i in range(3):
            want[s, i].lerp_(online["w"][s, i], taus[i])

    def pure(t, o):
        return fe.optim.polyak_update(t, o, tau)

    got = torch.func.vmap(pure)(target, online)
    assert torch.equal(got["w"], want) and torch.equal(got["n"], online["n"])

    def in_place(t, o):
        t = {k: v.clone() for k, v in t.items()}
        fe.optim.polyak_update_(t, o, tau)
        return t

    got = torch.func.vmap(in_place)(target, online)
    assert torch.equal(got["w"], want) and torch.equal(got["n"], online["n"])


def test_an_expanded_target_inside_torch_func_vmap_is_refused_before_any_change():
    """The memory checks look through the transform's wrappers at the tensors beneath."""
    target = {"a": torch.zeros(2, 4, 3), "z": torch.zeros(2, 1, 3).expand(2, 4, 3)}
    online = {"a": torch.ones(2, 4, 3), "z": torch.ones(2, 4, 3)}
    with pytest.raises(ValueError, match=r"target\['z'\] is an expanded view"):
        torch.func.vmap(lambda t, o: fe.optim.polyak_update_(t, o, 0.5))(target, online)
    assert not target["a"].any()


def test_inside_vmap_a_target_not_mapped_where_online_is_or_sharing_memory_is_refused_first():
    """vmap cannot write a shared target from a mapped value: the earlier leaves were
    written before torch refused a later one. Slices of one tensor read per seed
    overlap where the tensor beneath does not look dense: they were averaged."""
    target = {"a": torch.zeros(2, 3, 4), "n": torch.zeros(3, dtype=torch.long)}
    online = {"a": torch.ones(2, 3, 4), "n": torch.ones(2, 3, dtype=torch.long)}
    update = torch.func.vmap(
        lambda t, o: fe.optim.polyak_update_(t, o, 0.5),
        in_dims=({"a": 0, "n": None}, 0),
        out_dims=None,
    )
    with pytest.raises(ValueError, match=r"target\['n'\] is not batched by every torch.func.vmap"):
        update(target, online)
    assert not target["a"].any() and not target["n"].any()
    base = torch.arange(20.0).reshape(2, 5, 2)
    grid = base.clone()
    with pytest.raises(ValueError, match=r"target\['w'\] shares part of its memory"):
        torch.func.vmap(
            lambda t, o: fe.optim.polyak_update_({"w": t}, {"w": o}, 0.5), out_dims=None
        )(grid[:, 1:], grid[:, :4])
    assert torch.equal(grid, base)


def test_under_torch_func_grad_a_captured_target_is_updated_as_before():
    """Only a missing batching rule sends the update to one op per leaf: under grad
    the multi-tensor kernel runs, as outside any transform."""
    target, online = {"w": torch.zeros(3, 2)}, {"w": torch.ones(3, 2)}

    def loss(x):
        fe.optim.polyak_update_(target, online, 0.3)
        return (x**2).sum()

    torch.func.grad(loss)(torch.randn(3))
    assert torch.equal(target["w"], torch.zeros(3, 2).lerp_(torch.ones(3, 2), 0.3))
