"""In-place steps over tensors that share memory (optim/_aliasing.py): refused before
anything changes, where the loop over members refuses them or computes otherwise.

Found by an audit: stacked views of one tensor (``base[:, 1:]`` and ``base[:, :4]``)
are not dense, so torch's own overlap check passes them, and the step read values it
had already written (sgd 0.36 off, rmsprop 962 off, with no error); each member's slice
is dense, and the loop's step refuses it.
"""

import optree
import pytest
import torch

import funcensemble as fe

F64 = torch.float64

OPTIMIZERS = {
    "sgd": lambda: fe.optim.sgd(lr=0.5),
    "sgd-momentum": lambda: fe.optim.sgd(lr=0.5, momentum=0.9, weight_decay=0.1),
    "adam": lambda: fe.optim.adam(lr=0.1),
    "adamw": lambda: fe.optim.adamw(lr=0.1, weight_decay=0.5),
    "rmsprop": lambda: fe.optim.rmsprop(lr=0.1),
    "identity": lambda: fe.optim.chain(),
}


def _snapshot(*trees):
    return [t.clone() for tree in trees for t in optree.tree_leaves(tree) if torch.is_tensor(t)]


def _refused_unchanged(opt, grads, state, params, match):
    before = _snapshot(grads, state, params)
    with pytest.raises(ValueError, match=match):
        opt.update_(grads, state, params)
    after = _snapshot(grads, state, params)
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_gradients_overlapping_their_parameters_are_refused(name):
    base = torch.arange(15, dtype=F64).reshape(3, 5)
    params, grads = {"w": base[:, 1:]}, {"w": base[:, :4]}
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        loop = base.clone()  # the loop's step on member 0's dense slices
        torch.optim.SGD([torch.nn.Parameter(loop[0, 1:])], lr=0.5)
        loop[0, 1:].add_(loop[0, :4], alpha=-0.5)
    opt = OPTIMIZERS[name]()
    _refused_unchanged(
        opt, grads, opt.init(params), params, r"grads\['w'\] shares memory with params\['w'\]"
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_gradients_that_are_the_parameters_or_another_members_are_refused(name):
    """The same tensor as gradient (adamw decays it before torch.optim reads it, where
    the fused kernel reads it first: 3e-10 apart), or each member's gradient being its
    neighbour's parameters (the loop reads a neighbour already stepped)."""
    opt = OPTIMIZERS[name]()
    w = torch.randn(3, 4, dtype=F64)
    _refused_unchanged(
        opt,
        {"w": w},
        opt.init({"w": w}),
        {"w": w},
        r"grads\['w'\] shares memory with params\['w'\]",
    )
    base = torch.randn(4, 4, dtype=F64)
    params, grads = {"w": base[1:]}, {"w": base[:3]}
    _refused_unchanged(
        opt, grads, opt.init(params), params, r"grads\['w'\] shares memory with params\['w'\]"
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_parameters_sharing_memory_are_refused(name):
    """One tensor under two names would be stepped twice; overlapping views of one
    tensor read what the other leaf's step wrote."""
    opt = OPTIMIZERS[name]()
    w = torch.randn(3, 4, dtype=F64)
    params = {"a": w, "b": w}
    grads = {"a": torch.ones(3, 4, dtype=F64), "b": torch.ones(3, 4, dtype=F64)}
    state = opt.init({"a": w.clone(), "b": w.clone()})
    _refused_unchanged(
        opt,
        grads,
        state,
        params,
        r"params\['a'\] and params\['b'\] are one tensor under two names.* Drop the second name",
    )
    base = torch.randn(4, 4, dtype=F64)
    params = {"a": base[:3], "b": base[1:]}
    _refused_unchanged(
        opt, grads, opt.init(params), params, r"params\['a'\] shares memory with params\['b'\]"
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("leaf", ["expanded", "inference"])
def test_a_parameter_torch_cannot_write_is_refused_before_any_leaf_steps(name, leaf):
    """Torch's own error came from the second leaf, after the first had stepped (and
    Adam's counts and moments had moved)."""
    opt = OPTIMIZERS[name]()
    if leaf == "expanded":
        b = torch.ones(1, 4, dtype=F64).expand(3, 4)
        match = r"params\['b'\] is an expanded view"
    else:
        with torch.inference_mode():
            b = torch.ones(3, 4, dtype=F64)
        match = r"params\['b'\] is an inference tensor"
    params = {"a": torch.ones(3, 4, dtype=F64), "b": b}
    grads = {"a": torch.ones(3, 4, dtype=F64), "b": torch.ones(3, 4, dtype=F64)}
    _refused_unchanged(opt, grads, opt.init({"a": params["a"], "b": b.clone()}), params, match)


def test_the_ensemble_optimizer_refuses_gradients_overlapping_its_parameters():
    base = torch.arange(15, dtype=F64).reshape(3, 5)
    w = torch.nn.Parameter(base[:, 1:])
    eo = fe.optim.EnsembleOptimizer({"w": w}, fe.optim.sgd(lr=0.5))
    w.grad = base[:, :4]
    with pytest.raises(
        ValueError,
        match=r"^EnsembleOptimizer.step: params\['w'\].grad shares memory with params\['w'\]",
    ):
        eo.step()
    assert torch.equal(base, torch.arange(15, dtype=F64).reshape(3, 5))


TORCH_OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9, weight_decay=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.5),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.1),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_views_of_one_tensor_with_no_element_in_common_step_as_the_loop(name):
    """Interleaved strided views (params the even columns, gradients the odd ones)
    share a storage but no element: stepped as torch.optim steps each member."""
    base = torch.randn(3, 8, dtype=F64)
    want = base.clone()
    for i in range(3):
        p = torch.nn.Parameter(want[i, ::2].clone())
        p.grad = want[i, 1::2].clone()
        if name == "identity":  # chain(): the gradients are the updates, added
            p.data += p.grad
        else:
            TORCH_OPTIMIZERS[name]([p]).step()
        want[i, ::2] = p.detach()
    opt = OPTIMIZERS[name]()
    params = {"w": base[:, ::2]}
    opt.update_({"w": base[:, 1::2]}, opt.init(params), params)
    torch.testing.assert_close(base, want, rtol=1e-12, atol=1e-12)


def test_polyak_refuses_target_leaves_sharing_memory_with_other_leaves():
    """Leaf by leaf, the loop's lerp_ reads what an earlier leaf's average wrote."""
    x = torch.randn(4, 3, dtype=F64)
    cases = [
        ({"a": torch.zeros(3, 3, dtype=F64), "b": x[1:]}, {"a": x[:3], "b": torch.ones(3, 3)}),
        ({"a": x[:3], "b": x[1:]}, {"a": torch.ones(3, 3, dtype=F64), "b": torch.ones(3, 3)}),
    ]
    for target, online in cases:
        online["b"] = online["b"].to(F64)
        before = _snapshot(target, online)
        with pytest.raises(ValueError, match=r"target\['\w'\] shares memory with"):
            fe.optim.polyak_update_(target, online, 0.3)
        assert all(
            torch.equal(b, a) for b, a in zip(before, _snapshot(target, online), strict=True)
        )
    same = {"a": x.clone(), "b": x.clone()}
    fe.optim.polyak_update_(same, same, 0.3)  # each leaf averaged with itself: allowed


def test_slices_of_one_fused_weight_step_as_the_loop():
    """q, k and v as row blocks of one fused [N, 3d, d] weight: their byte ranges
    overlap, their elements do not (compared run by run: element by element took
    seconds a step at d=512, and refused them above 16M elements)."""
    n, d = 3, 8
    fused = torch.randn(n, 3 * d, d, dtype=F64)
    params = {"q": fused[:, :d], "k": fused[:, d : 2 * d], "v": fused[:, 2 * d :]}
    grads = {name: torch.randn(n, d, d, dtype=F64) for name in params}
    want = {name: p - 0.5 * grads[name] for name, p in params.items()}
    opt = fe.optim.sgd(lr=0.5)
    opt.update_(grads, opt.init(params), params)
    for name, p in params.items():
        assert torch.equal(p, want[name])


@pytest.mark.parametrize("kinds", [("ordered", "dict"), ("dict", "ordered")])
def test_gradients_in_another_kind_of_dict_are_compared_too(kinds):
    """A dict and an OrderedDict hold the same leaves: the step took them, and the
    comparison was skipped on the differing container type."""
    from collections import OrderedDict

    make = {"ordered": OrderedDict, "dict": dict}
    base = torch.arange(15, dtype=F64).reshape(3, 5)
    params, grads = make[kinds[0]](w=base[:, 1:]), make[kinds[1]](w=base[:, :4])
    opt = fe.optim.sgd(lr=0.5)
    _refused_unchanged(opt, grads, opt.init(params), params, "shares memory with")


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_a_step_inside_vmap_on_strided_per_call_parameters_still_runs():
    """Inside torch.func.vmap the tensors are vmap's wrappers, whose memory is not
    compared (torch's overlap query has no batching rule: it raised)."""
    opt = fe.optim.rmsprop(lr=0.1)

    def step(w, g):
        opt.update_({"w": g}, opt.init({"w": w}), {"w": w})
        return w

    w = torch.randn(4, 3, 5, dtype=F64)
    want = w.clone()
    for i in range(3):
        want[:, i] = step(want[:, i].clone(), torch.ones(4, 5, dtype=F64))
    got = torch.func.vmap(step, in_dims=(1, 1))(w.clone(), torch.ones(4, 3, 5, dtype=F64))
    torch.testing.assert_close(got, want.transpose(0, 1), rtol=1e-12, atol=1e-12)


def test_first_clash_agrees_with_the_elements_each_view_reads():
    """Random strided views, several at once, against each view's element set: the
    pair found shares an element, and none is found where no written pair, nor a
    written and a read one, does."""
    import itertools

    from funcensemble.optim import _aliasing

    gen = torch.Generator().manual_seed(1)
    storage = torch.zeros(400, dtype=F64)

    def view() -> torch.Tensor:
        dims = int(torch.randint(1, 4, (), generator=gen))
        size = [int(s) for s in torch.randint(1, 6, (dims,), generator=gen)]
        stride = [max(1, int(s)) for s in torch.randint(0, 20, (dims,), generator=gen)]
        return storage.as_strided(size, stride, int(torch.randint(0, 200, (), generator=gen)))

    def elements(t: torch.Tensor) -> set[int]:
        return {t[i].data_ptr() for i in itertools.product(*map(range, t.shape))}

    found = 0
    for _ in range(1500):
        written = [view() for _ in range(int(torch.randint(1, 4, (), generator=gen)))]
        read = [view() for _ in range(int(torch.randint(0, 3, (), generator=gen)))]
        sets_w, sets_r = [elements(t) for t in written], [elements(t) for t in read]
        any_clash = any(
            sets_w[i] & sets_w[j] for i in range(len(written)) for j in range(i)
        ) or any(w & r for w in sets_w for r in sets_r)
        clash = _aliasing.first_clash(written, read)
        assert (clash is not None) == any_clash
        if clash is not None:
            i, j = clash
            other = sets_r[j] if j >= 0 else sets_w[-1 - j]
            assert sets_w[i] & other and (j >= 0 or i != -1 - j)
            found += 1
    assert 300 < found < 1400, found
