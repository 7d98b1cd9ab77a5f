"""fe.optim.clip_by_global_norm against torch.nn.utils.clip_grad_norm_ run per member."""

import copy
import math

import optree
import pytest
import torch
from helpers import runtime_typecheck_off
from torch import nn

import funcensemble as fe

N = 3
STEPS = 4
# Member 0's loss is scaled down (its norm stays below max_norm: unclipped), member 1's
# up (always clipped), member 2's left as it is.
SCALES = (1e-3, 1e2, 1.0)
MAX_NORM = 1.0


def members(dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)
    out = []
    for _ in range(N):
        m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).to(dtype)
        m[2].bias.requires_grad_(False)  # a frozen leaf: no gradient, skipped
        out.append(m)
    return out


def loss(m: nn.Module, i: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + i)
    x = torch.randn(8, 4, generator=g, dtype=m[0].weight.dtype)
    return SCALES[i] * m(x).pow(2).mean()


def reference(modules: list[nn.Module], max_norm: list[float]) -> tuple[list, list]:
    """The loop: clip_grad_norm_ and torch.optim.Adam per member; its optimizers and
    the norms it saw."""
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in modules]
    norms = []
    for step in range(STEPS):
        row = []
        for i, (m, opt) in enumerate(zip(modules, opts, strict=True)):
            opt.zero_grad()
            loss(m, i, step).backward()
            row.append(nn.utils.clip_grad_norm_(m.parameters(), max_norm[i]).item())
            opt.step()
        norms.append(row)
    return opts, norms


def stacked(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    names = [k for k, _ in modules[0].named_parameters()]
    return {k: torch.stack([m.get_parameter(k).detach() for m in modules]) for k in names}


def grads(modules: list[nn.Module]) -> dict[str, torch.Tensor | None]:
    out = {}
    for k, p in modules[0].named_parameters():
        out[k] = None if p.grad is None else torch.stack([m.get_parameter(k).grad for m in modules])
    return out


# float32: the per-member norm sums in another order than torch's whole-tensor norm, so
# the clip factor agrees to rounding, and Adam carries that on.
TOLS = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


@pytest.mark.parametrize(
    ("in_place", "per_member", "dtype"),
    [
        (False, False, torch.float64),
        (True, False, torch.float64),
        (False, True, torch.float64),
        (True, True, torch.float64),
        (False, False, torch.float32),
        (True, True, torch.float32),
    ],
)
def test_matches_clip_grad_norm_and_adam_per_member(in_place, per_member, dtype):
    ref = members(dtype)
    ours = copy.deepcopy(ref)
    limits = [MAX_NORM, 2.0, 0.5] if per_member else [MAX_NORM] * N
    opts, norms = reference(ref, limits)
    ref_opts = list(zip(ref, opts, strict=True))
    # The case the test is about: one member never clipped, one always clipped.
    assert all(row[0] < limits[0] and row[1] > limits[1] for row in norms), norms

    max_norm = torch.tensor(limits, dtype=dtype) if per_member else MAX_NORM
    opt = fe.optim.chain(fe.optim.clip_by_global_norm(max_norm), fe.optim.adam(lr=0.01))
    params = stacked(ours)
    state = opt.init(params)
    for step in range(STEPS):
        for i, m in enumerate(ours):
            m.zero_grad(set_to_none=True)
            loss(m, i, step).backward()
        g = grads(ours)
        assert g["2.bias"] is None
        if in_place:
            state = opt.update_(g, state, params)
        else:
            updates, state = opt.update(g, state, params)
            params = fe.optim.apply_updates(params, updates)
        with torch.no_grad():
            for i, m in enumerate(ours):
                for k, p in m.named_parameters():
                    p.copy_(params[k][i])

    expected = stacked(ref)
    for k in expected:
        torch.testing.assert_close(params[k], expected[k], **TOLS[dtype])
    (adam_state,) = [
        s
        for s in optree.tree_leaves(state, is_leaf=lambda s: isinstance(s, fe.optim.AdamState))
        if isinstance(s, fe.optim.AdamState)
    ]
    for k, p in ref[0].named_parameters():
        if not p.requires_grad:
            assert adam_state.mu[k] is None or not adam_state.mu[k].any()
            continue
        torch_mu = torch.stack([opt.state[m.get_parameter(k)]["exp_avg"] for m, opt in ref_opts])
        torch.testing.assert_close(adam_state.mu[k], torch_mu, **TOLS[dtype])


def test_float32_matches_clip_grad_norm_():
    """One clip in float32 mixed with a float64 leaf: torch's arithmetic and dtypes (the
    per-member norm may round differently from torch's whole-tensor norm)."""
    torch.manual_seed(1)
    w = torch.randn(N, 5, 4) * torch.tensor(SCALES).reshape(N, 1, 1)
    b = torch.randn(N, 5, dtype=torch.float64)
    clip = fe.optim.clip_by_global_norm(0.7)
    updates, _ = clip.update({"w": w, "b": b, "frozen": None}, clip.init({"w": w, "b": b}))
    assert updates["frozen"] is None
    for i in range(N):
        pw, pb = nn.Parameter(w[i].clone()), nn.Parameter(b[i].clone())
        pw.grad, pb.grad = w[i].clone(), b[i].clone()
        nn.utils.clip_grad_norm_([pw, pb], 0.7)
        torch.testing.assert_close(updates["w"][i], pw.grad, rtol=1e-6, atol=0)
        torch.testing.assert_close(updates["b"][i], pb.grad, rtol=1e-6, atol=0)
    assert updates["w"].dtype == torch.float32 and updates["b"].dtype == torch.float64


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float64),
    ],
    ids=str,
)
def test_half_precision_leaves_are_scaled_as_clip_grad_norm_scales_them(dtypes):
    # clip_grad_norm_ multiplies a float16 gradient by its float32 (0-dim) factor in
    # float32 and rounds once; rounding the factor to float16 first is 1 ulp off.
    g = torch.Generator().manual_seed(0)
    grads = {
        "a": torch.randn(N, 7, 33, generator=g).to(dtypes[0]),
        "b": (2 * torch.randn(N, 7, 33, generator=g)).to(dtypes[1]),
    }
    clip = fe.optim.clip_by_global_norm(1.0)
    updates, _ = clip.update(grads, clip.init(grads))
    for i in range(N):
        ps = [nn.Parameter(v[i].clone()) for v in grads.values()]
        for p, v in zip(ps, grads.values(), strict=True):
            p.grad = v[i].clone()
        total = nn.utils.clip_grad_norm_(ps, 1.0)
        assert total > 1.0  # the factor is not 1: every leaf is scaled
        for p, k in zip(ps, grads, strict=True):
            assert updates[k].dtype == p.grad.dtype
            assert torch.equal(updates[k][i], p.grad), (k, i)


def test_ensemble_optimizer_clips_each_member_by_its_own_norm():
    ref = members(torch.float64)
    for m in ref:
        m[2].bias.requires_grad_(True)
    ens = fe.Ensemble(copy.deepcopy(ref))
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in ref]
    opt = fe.optim.EnsembleOptimizer(
        ens, fe.optim.chain(fe.optim.clip_by_global_norm(MAX_NORM), fe.optim.adam(lr=0.01))
    )
    x = torch.randn(8, 4, dtype=torch.float64)
    scales = torch.tensor(SCALES, dtype=torch.float64)
    for _ in range(STEPS):
        for i, (m, o) in enumerate(zip(ref, opts, strict=True)):
            o.zero_grad()
            (scales[i] * m(x).pow(2).mean()).backward()
            nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
            o.step()
        opt.zero_grad()
        (scales * ens(x).pow(2).mean(dim=(1, 2))).sum().backward()
        unclipped = {k: p.grad.clone() for k, p in ens.stacked_params().items()}
        opt.step()
    for k, p in ens.stacked_params().items():
        torch.testing.assert_close(p.detach(), stacked(ref)[k], rtol=1e-10, atol=1e-12)
        # The clip acts on the update: .grad keeps the unclipped gradient (the loop's
        # clip_grad_norm_ scales .grad in place), as training.md says.
        assert torch.equal(p.grad, unclipped[k]), k
        assert not torch.allclose(
            p.grad, torch.stack([dict(m.named_parameters())[k].grad for m in ref])
        )


def test_all_none_and_empty_updates():
    clip = fe.optim.clip_by_global_norm(1.0)
    updates, state = clip.update({"w": None}, clip.init({"w": torch.zeros(2, 3)}))
    assert updates == {"w": None} and state == fe.optim.EmptyState()


@pytest.mark.parametrize(
    ("max_norm", "error", "match"),
    [
        (-1.0, ValueError, "Invalid max_norm: -1.0"),
        (torch.tensor([1.0, -2.0]), ValueError, "member 1"),
        (torch.ones(2, 2), ValueError, r"shape \[N\]"),
        ("1", TypeError, "max_norm must be a float"),
        (torch.tensor([1, 2]), TypeError, "floating point"),
    ],
)
def test_invalid_max_norm_is_refused_at_construction(max_norm, error, match):
    with runtime_typecheck_off(), pytest.raises(error, match=match):
        fe.optim.clip_by_global_norm(max_norm)


def test_per_member_size_and_member_axis_are_checked():
    clip = fe.optim.clip_by_global_norm(torch.ones(3))
    with pytest.raises(ValueError, match="3 per-member values"):
        clip.init({"w": torch.zeros(2, 4)})
    clip = fe.optim.clip_by_global_norm(1.0)
    with pytest.raises(
        ValueError,
        match=(
            r"params\['w'\] has leading size 2, unlike params\['b'\] "
            r"\(expected leading size 3, got leading size 2\)"
        ),
    ):
        clip.update({"w": torch.zeros(2, 4), "b": torch.zeros(3)}, fe.optim.EmptyState())


@pytest.mark.parametrize("norm_type", [1.0, 3.0, float("inf")], ids=["l1", "l3", "inf"])
def test_other_norms_match_clip_grad_norm_per_member(norm_type):
    """clip_grad_norm_'s norm_type (the inf norm for one) had no counterpart."""
    torch.manual_seed(3)
    modules = [
        nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double() for _ in range(N)
    ]
    x = torch.randn(N, 8, 4, dtype=torch.float64)
    scales = torch.tensor([1e-3, 1.0, 1e3][:N] + [1.0] * max(0, N - 3), dtype=torch.float64)
    for i, m in enumerate(modules):
        (scales[i] * m(x[i]).pow(2).sum()).backward()
    grads = {
        k: torch.stack([dict(m.named_parameters())[k].grad for m in modules])
        for k, _ in modules[0].named_parameters()
    }
    clip = fe.optim.clip_by_global_norm(0.5, norm_type=norm_type)
    clipped, _ = clip.update(grads, clip.init(grads))
    for i, m in enumerate(modules):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, norm_type=norm_type)
        for k, p in m.named_parameters():
            torch.testing.assert_close(clipped[k][i], p.grad, rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match=r"norm_type must be positive .*got 0\.0"):
        fe.optim.clip_by_global_norm(1.0, norm_type=0.0)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, 0.5, float("inf")])
def test_float32_norms_of_large_leaves_are_clip_grad_norm_s_bit_for_bit(norm_type):
    # Found by an audit: a batched float32 reduction for p=1 and 3 summed in another
    # order than torch's over each member's tensor (7e-6 off on a 300x257 leaf), and
    # member 0's result depended on the member count.
    torch.manual_seed(4)
    grads = {"w": torch.randn(4, 300, 257), "b": torch.randn(257, 4).t() * 10}
    clip = fe.optim.clip_by_global_norm(0.5, norm_type=norm_type)
    clipped, _ = clip.update(grads, clip.init(grads))
    alone = {k: v[:1] for k, v in grads.items()}
    first, _ = clip.update(alone, clip.init(alone))
    for i in range(4):
        params = {k: nn.Parameter(v[i].clone()) for k, v in grads.items()}
        for k, p in params.items():
            p.grad = grads[k][i].clone()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5, norm_type=norm_type)
        for k, p in params.items():
            assert torch.equal(clipped[k][i], p.grad), (k, i)
    for k in grads:
        assert torch.equal(first[k][0], clipped[k][0])


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, 0.5, math.inf])
@pytest.mark.parametrize("leaves,n", [(3, 6), (40, 16)])
def test_float32_norms_over_several_leaves_are_clip_grad_norm_s_bit_for_bit(norm_type, leaves, n):
    # Found by an audit: the leaves' norms were reduced across a strided axis, so for
    # p=2 some members' total norm (4 of 120) rounded otherwise than clip_grad_norm_'s.
    # Then: summed in optree's sorted key order ('p10' before 'p2'), not in the order
    # of the loop's parameters(), and a transposed leaf's rows read strided.
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        grads = {
            f"p{j}": torch.randn(
                n, *[int(s) for s in torch.randint(1, 9, (j % 3,), generator=g)], generator=g
            )
            * 3
            for j in range(leaves)
        }
        grads["p1"] = torch.randn(50, n, generator=g).t() * 3  # rows not contiguous
        clip = fe.optim.clip_by_global_norm(0.1, norm_type=norm_type)
        clipped, _ = clip.update(grads, clip.init(grads))
        for i in range(n):
            params = [nn.Parameter(v[i].clone()) for v in grads.values()]
            for p, v in zip(params, grads.values(), strict=True):
                p.grad = v[i].clone()
            torch.nn.utils.clip_grad_norm_(params, 0.1, norm_type=norm_type)
            for k, p in zip(grads, params, strict=True):
                assert torch.equal(clipped[k][i], p.grad), (seed, k, i)


@pytest.mark.parametrize(
    "transform",
    [
        lambda: fe.optim.chain(fe.optim.clip_by_global_norm(1.0), fe.optim.adam(0.1)),
        lambda: fe.optim.chain(fe.optim.add_decayed_weights(0.1), fe.optim.sgd(0.1)),
        lambda: fe.optim.clip_by_global_norm(1.0),
    ],
)
@pytest.mark.parametrize("form", ["update", "update_"])
def test_an_integer_gradient_inside_a_chain_is_refused_before_any_step(transform, form):
    """The first transform took it for no gradient: that parameter silently skipped its
    step while the others stepped (adam alone refuses it)."""
    params = {
        "w": torch.randn(3, 4, dtype=torch.float64),
        "b": torch.randn(3, 2, dtype=torch.float64),
    }
    grads = {"w": torch.randn(3, 4, dtype=torch.float64), "b": torch.ones(3, 2, dtype=torch.int64)}
    t = transform()
    state = t.init(params)
    before = {k: v.clone() for k, v in params.items()}
    with pytest.raises(ValueError, match=r"params\['b'\] has .*dtype torch\.int64"):
        getattr(t, form)(grads, state, params)
    for k, v in params.items():
        assert torch.equal(v, before[k]), k


def test_a_meta_gradient_beside_real_ones_is_named():
    # Found by an audit: torch's "Cannot copy out of meta tensor" from the norm.
    grads = {"w": torch.ones(3, 4), "d": torch.ones(3, 2, device="meta")}
    clip = fe.optim.clip_by_global_norm(1.0)
    with pytest.raises(
        ValueError, match=r"params\['d'\] is on the meta device.*unlike params\['w'\]"
    ):
        clip.update(grads, clip.init(grads))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0])
def test_clip_runs_under_vmap_as_it_runs_eagerly(norm_type):
    # A review found norm_type 1 and 3 failing under vmap after the per-member norms
    # moved to torch._foreach_norm, which has no batching rule.
    torch.manual_seed(5)
    grads = {"w": torch.randn(2, 4, 30, 7), "b": torch.randn(2, 4, 7)}  # 2 seeds x 4 members
    clip = fe.optim.clip_by_global_norm(0.5, norm_type=norm_type)
    mapped = torch.func.vmap(lambda g: clip.update(g, fe.optim.EmptyState())[0])(grads)
    for seed in range(2):
        one = {k: v[seed] for k, v in grads.items()}
        eager, _ = clip.update(one, fe.optim.EmptyState())
        for k in grads:
            assert torch.equal(mapped[k][seed], eager[k])
