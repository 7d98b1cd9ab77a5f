"""The in-place step ``update_``: against N torch.optim optimizers and the pure path, in float64.

``fe.optim.adam``'s dedicated step (``funcensemble/_adam_step.py``) runs torch's fused
Adam kernel when every hyperparameter is one float, and in-place multi-tensor ops
otherwise; other transforms get the generic step derived from ``update``.
"""

import copy
import itertools
from typing import Any

import optree
import pytest
import torch
from test_optim import (
    PER_MEMBER,
    STEPS,
    N,
    adam_state,
    assert_matches_torch,
    per_member_case,
    run,
    small_tree,
)

import funcensemble as fe

CLOSE = {"rtol": 1e-12, "atol": 1e-14}


def torch_cls(kind: str) -> type[torch.optim.Optimizer]:
    return torch.optim.Adam if kind == "adam" else torch.optim.AdamW


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many leaves each call of torch's fused Adam/AdamW kernel stepped."""
    calls: list[int] = []
    for name in ("_fused_adam_", "_fused_adamw_"):
        kernel = getattr(torch, name)

        def counted(params: list, *args: Any, _kernel: Any = kernel, **kwargs: Any) -> None:
            calls.append(len(params))
            _kernel(params, *args, **kwargs)

        monkeypatch.setattr(torch, name, counted)
    return calls


GRID = list(itertools.product(["adam", "adamw"], [0.0, 1e-2], [False, True], [False, True]))


@pytest.mark.parametrize(("kind", "weight_decay", "amsgrad", "maximize"), GRID)
def test_fused_step_matches_torch_optim(kind, weight_decay, amsgrad, maximize, fused_calls):
    options = dict(weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
    transform = getattr(fe.optim, kind)(1e-2, (0.9, 0.999), **options)
    r = run(
        transform,
        lambda i, p: (torch_cls(kind)(p, lr=1e-2, **options), None),
        in_place=True,
    )
    assert_matches_torch(r, amsgrad=amsgrad)
    assert fused_calls and max(fused_calls) == 6  # every parameter with a gradient


def test_fused_step_in_float32_matches_torch_fused(fused_calls):
    r = run(
        fe.optim.adamw(1e-2, amsgrad=True),
        lambda i, p: (torch.optim.AdamW(p, lr=1e-2, amsgrad=True, fused=True), None),
        dtype=torch.float32,
        in_place=True,
    )
    assert fused_calls
    assert_matches_torch(r, amsgrad=True, tol={"rtol": 1e-6, "atol": 1e-7})


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("which", [*PER_MEMBER, "all"])
def test_per_member_step_matches_separate_torch_optimizers(kind, which, fused_calls):
    transform, torch_opt = per_member_case(kind, which, amsgrad=True, maximize=True)
    assert_matches_torch(run(transform, torch_opt, in_place=True), amsgrad=True)
    assert not fused_calls


def test_zero_per_member_lr_leaves_that_member_unchanged():
    params = small_tree()
    before = optree.tree_map(torch.clone, params)
    opt = fe.optim.adamw(torch.tensor([1e-2, 0.0, 1e-3], dtype=torch.float64))
    state = opt.update_(small_tree(), opt.init(params), params)
    assert torch.equal(params["w"][1], before["w"][1])
    assert not torch.equal(params["w"][0], before["w"][0])
    assert adam_state(state).count["w"].item() == 1


@pytest.mark.parametrize(
    "schedule",
    [
        lambda count: 1e-2 * 0.8**count,  # a 0-dim tensor: still the fused kernel
        lambda count: 1e-2 if count < 4 else 1e-2 * 0.8**4,  # a float
    ],
    ids=["tensor", "float"],
)
@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_schedule_step_matches_lambda_lr(kind, schedule, fused_calls):
    transform = getattr(fe.optim, kind)(schedule, amsgrad=True)

    def torch_opt(i, params):
        opt = torch_cls(kind)(params, lr=1.0, amsgrad=True)
        factor = [float(schedule(torch.tensor(e))) for e in range(STEPS + 1)]
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda e: factor[e])

    r = run(transform, torch_opt, in_place=True)
    assert_matches_torch(r, amsgrad=True)
    assert r.state[-1].count.item() == STEPS  # advanced on the all-None step too
    assert fused_calls


def test_per_member_schedule_step():
    lrs = PER_MEMBER["lr"]

    def torch_opt(i, params):
        opt = torch.optim.Adam(params, lr=float(lrs[i]))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)

    r = run(fe.optim.adam(lambda c: lrs * 0.5**c), torch_opt, in_place=True)
    assert_matches_torch(r, amsgrad=False)


# --- against the pure path ---------------------------------------------------------------

LR = torch.tensor([1e-2, 3e-3, 1e-3], dtype=torch.float64)
OPTIONS = list(
    itertools.product(
        ["adam", "adamw"],
        [1e-2, LR, lambda c: 1e-2 * 0.9**c],
        [0.0, 0.1, PER_MEMBER["weight_decay"]],
        [0.9, PER_MEMBER["beta1"]],
        [False, True],
        [False, True],
    )
)


def grads_at(step: int, *, transposed: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + step)
    w = torch.randn(N, 2, 4, generator=g, dtype=torch.float64).transpose(1, 2)
    return {
        "w": w if transposed else w.contiguous(),
        "b": None if step == 1 else torch.randn(N, 2, generator=g, dtype=torch.float64),
        "steps": None,
    }


def int_tree() -> dict[str, Any]:
    return {**small_tree(), "steps": torch.arange(N)}


@pytest.mark.parametrize(("kind", "lr", "wd", "b1", "amsgrad", "maximize"), OPTIONS)
def test_update_in_place_equals_update_then_apply_updates(kind, lr, wd, b1, amsgrad, maximize):
    opt = getattr(fe.optim, kind)(
        lr, (b1, 0.999), weight_decay=wd, amsgrad=amsgrad, maximize=maximize
    )
    pure, mutated = int_tree(), int_tree()
    pure_state, state = opt.init(pure), opt.init(mutated)
    ints = mutated["steps"]
    for step in range(4):
        updates, pure_state = opt.update(grads_at(step), pure_state, pure)
        pure = fe.optim.apply_updates(pure, updates)
        state = opt.update_(grads_at(step), state, mutated)
    torch.testing.assert_close(mutated, pure, **CLOSE)
    torch.testing.assert_close(state, pure_state, **CLOSE)
    assert mutated["steps"] is ints and adam_state(state).mu["steps"] is None
    assert adam_state(state).count["b"].item() == 3  # no gradient at step 1


def test_non_contiguous_gradients_take_the_multi_tensor_path(fused_calls):
    # torch's CPU fused kernel reads memory linearly: a transposed gradient would give
    # wrong numbers, so such leaves are stepped with multi-tensor ops instead, pure or
    # in place.
    opt = fe.optim.adam(1e-2, amsgrad=True)
    pure, mutated = int_tree(), int_tree()
    pure_state, state = opt.init(pure), opt.init(mutated)
    for step in range(3):
        updates, pure_state = opt.update(grads_at(step, transposed=True), pure_state, pure)
        pure = fe.optim.apply_updates(pure, updates)
        state = opt.update_(grads_at(step, transposed=True), state, mutated)
    torch.testing.assert_close(mutated, pure, **CLOSE)
    torch.testing.assert_close(state, pure_state, **CLOSE)
    # Only "b", at the steps it has a gradient (0 and 2): update, then update_.
    assert fused_calls == [1, 1, 1, 1]


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_pure_update_over_two_dtypes_a_padded_leaf_and_a_strided_one(kind, fused_calls):
    # One fused kernel call per dtype on fresh copies (the leaf of 15 elements padded to
    # 64), the transposed leaf by multi-tensor ops; all put back in the tree's order,
    # and nothing of the inputs is written or shared with the results.
    g = torch.Generator().manual_seed(3)
    params = {
        "a": torch.randn(N, 8, 8, generator=g),
        "b": torch.randn(N, 64, generator=g, dtype=torch.float64),
        "c": torch.randn(N, 4, 16, generator=g),
        "d": torch.randn(N, 8, 8, generator=g, dtype=torch.float64),
        "e": torch.randn(N, 5, generator=g, dtype=torch.float64),
    }
    opt = getattr(fe.optim, kind)(1e-2, amsgrad=True, weight_decay=0.0)
    pure, mutated = dict(params), {k: v.clone() for k, v in params.items()}
    pure_state, state = opt.init(pure), opt.init(mutated)
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}
        grads["d"] = grads["d"].transpose(1, 2).contiguous().transpose(1, 2)  # strided
        before = optree.tree_map(torch.clone, (pure, pure_state, grads))
        updates, new_state = opt.update(grads, pure_state, pure)
        torch.testing.assert_close((pure, pure_state, grads), before, rtol=0, atol=0)
        inputs = {t.untyped_storage().data_ptr() for t in optree.tree_leaves((pure, pure_state))}
        outputs = optree.tree_leaves((updates, new_state))
        assert not inputs & {t.untyped_storage().data_ptr() for t in outputs}
        pure, pure_state = fe.optim.apply_updates(pure, updates), new_state
        state = opt.update_(grads, state, mutated)
    # Without weight decay the leaves of whole vectors match update_ bit for bit; the
    # padded one runs its last elements in the kernel's vector code, where update_ runs
    # them in its scalar tail, and the strided one runs multi-tensor ops: both agree
    # up to rounding.
    fused = ["a", "b", "c"]
    exact = {"rtol": 0, "atol": 0}
    torch.testing.assert_close({k: pure[k] for k in fused}, {k: mutated[k] for k in fused}, **exact)
    torch.testing.assert_close(pure, mutated, **CLOSE)
    torch.testing.assert_close(state, pure_state, **CLOSE)
    # Each of update and update_: float32 (a, c), then float64 (b, e).
    assert fused_calls == [2, 2, 2, 2] * 3


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pure_update_of_a_member_does_not_depend_on_the_other_members(kind, dtype):
    # The fused kernel rounds a tensor's last (numel mod vector width) elements in
    # scalar code: update pads every leaf to whole vectors, so each member's numbers
    # are the same bit for bit in any split of the ensemble (as ShardedEnsemble and
    # member selection rely on).
    g = torch.Generator().manual_seed(4)
    n = 7
    params = {
        "w": torch.randn(n, 8, 8, generator=g, dtype=dtype),
        "b": torch.randn(n, 5, generator=g, dtype=dtype),  # padded to 64, 64 or 128
    }
    grads = [
        {k: torch.randn(v.shape, generator=g, dtype=dtype) for k, v in params.items()}
        for _ in range(4)
    ]
    opt = getattr(fe.optim, kind)(1e-2, weight_decay=0.1, amsgrad=True)

    def train(members: list[int]) -> dict[str, torch.Tensor]:
        p = {k: v[members] for k, v in params.items()}
        state = opt.init(p)
        for step in grads:
            updates, state = opt.update({k: v[members] for k, v in step.items()}, state, p)
            p = fe.optim.apply_updates(p, updates)
        return p

    whole = train(list(range(n)))
    for split in ([[0, 1, 2, 3], [4, 5, 6]], [[0, 1, 2, 3, 4, 5], [6]], [[i] for i in range(n)]):
        parts = [train(members) for members in split]
        joined = {k: torch.cat([part[k] for part in parts]) for k in params}
        torch.testing.assert_close(joined, whole, rtol=0, atol=0)


def test_state_tensors_are_updated_in_place():
    opt = fe.optim.adam(1e-2, amsgrad=True)
    params = small_tree()
    state = opt.init(params)
    before = optree.tree_leaves(state)
    new = opt.update_(small_tree(), state, params)
    after = optree.tree_leaves(new)
    assert len(before) == len(after) and all(a is b for a, b in zip(before, after, strict=True))
    assert adam_state(new).count["w"].item() == 1


# --- the in-place forms of other transforms, carried through chain -----------------------


def counting_sgd() -> fe.optim.GradientTransformation:
    """A transform of the user's own, without an in-place form: one is derived."""

    def init(params):
        return {"seen": torch.zeros(())}

    def update(updates, state, params=None):
        new = optree.tree_map(lambda u: None if u is None else -0.1 * u, updates, none_is_leaf=True)
        return new, {"seen": state["seen"] + 1}

    return fe.optim.GradientTransformation(init, update)


# (transform, whether update_ equals update + apply_updates bit for bit): scale_by_adam
# followed by a learning rate folds into adam's step, whose in-place form runs torch's
# fused kernel or ends in torch's order for tensor hyperparameters (agreeing with update
# up to rounding, like adam's own).
IN_PLACE_CASES = [
    pytest.param(
        lambda: fe.optim.chain(
            fe.optim.add_decayed_weights(0.1), fe.optim.scale_by_adam(amsgrad=True),
            fe.optim.scale_by_learning_rate(lambda c: 0.1 * 0.5**c),
        ),
        False, id="chain-folded",
    ),
    pytest.param(
        lambda: fe.optim.chain(fe.optim.scale_by_adam(), fe.optim.scale_by_learning_rate(LR)),
        False, id="chain-adam-per-member-lr",  # adam's order for tensor hyperparameters in place
    ),
    pytest.param(
        lambda: fe.optim.chain(
            fe.optim.scale_by_adam(amsgrad=True), fe.optim.add_decayed_weights(0.1),
            fe.optim.scale_by_learning_rate(lambda c: 0.1 * 0.5**c),
        ),
        True, id="chain-unfolded",
    ),
    pytest.param(
        lambda: fe.optim.chain(counting_sgd(), fe.optim.scale_by_learning_rate(LR)),
        True, id="chain-derived",
    ),
    pytest.param(fe.optim.scale_by_adam, True, id="scale_by_adam"),
    pytest.param(lambda: fe.optim.scale_by_learning_rate(LR), True, id="scale_by_learning_rate"),
    pytest.param(counting_sgd, True, id="derived"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "exact"), IN_PLACE_CASES)
def test_in_place_step_equals_update_then_apply_updates(make, exact):
    opt = make()
    pure, mutated = int_tree(), int_tree()
    pure_state, state = opt.init(pure), opt.init(mutated)
    tensors = optree.tree_leaves(state)
    for step in range(3):
        grads = grads_at(step)
        before = optree.tree_map(torch.clone, grads)
        updates, pure_state = opt.update(grads, pure_state, pure)
        pure = fe.optim.apply_updates(pure, updates)
        state = opt.update_(grads, state, mutated)
        torch.testing.assert_close(grads, before, rtol=0, atol=0)  # grads are never written
    # One arithmetic: the in-place forms compute exactly what update computes.
    tol = {"rtol": 0, "atol": 0} if exact else CLOSE
    torch.testing.assert_close(mutated, pure, **tol)
    torch.testing.assert_close(state, pure_state, **tol)
    # The state's tensors were written into, not replaced.
    assert all(a is b for a, b in zip(tensors, optree.tree_leaves(state), strict=True))


def test_chain_in_place_runs_the_last_in_place_form_after_the_others_out_of_place():
    """The transforms before the last run out of place, their states are written in
    once the last one (in place) has run: one that raises leaves every state alone."""
    calls = []

    def spy(t, name):
        def update(updates, state, params=None):
            calls.append(f"{name}.update")
            return t.update(updates, state, params)

        def update_inplace(updates, state, params=None):
            calls.append(f"{name}.update_")
            return t.update_inplace(updates, state, params)

        return t._replace(update=update, update_inplace=update_inplace)

    opt = fe.optim.chain(
        spy(fe.optim.scale_by_adam(), "adam"),
        spy(fe.optim.add_decayed_weights(0.1), "decay"),
        spy(fe.optim.scale_by_learning_rate(LR), "lr"),
    )
    params = int_tree()
    state = opt.init(params)
    tensors = optree.tree_leaves(state)
    before = [t.clone() for t in tensors]
    opt.update_(grads_at(0), state, params)
    assert calls == ["adam.update", "decay.update", "lr.update_"]
    after = optree.tree_leaves(state)
    assert all(a is b for a, b in zip(tensors, after, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize(
    "lr", [1e-2, LR, lambda c: 1e-2 * 0.5**c], ids=["float", "per-member", "schedule"]
)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_scale_by_adam_then_learning_rate_is_adam(lr, amsgrad):
    # The composition folds the learning rate into Adam's step: adam's result, bit for bit.
    chained = fe.optim.chain(
        fe.optim.scale_by_adam(amsgrad=amsgrad), fe.optim.scale_by_learning_rate(lr)
    )
    adam = fe.optim.adam(lr, amsgrad=amsgrad)
    for method in ("update", "update_"):
        a, b = int_tree(), int_tree()
        sa, sb = chained.init(a), adam.init(b)
        for step in range(3):
            if method == "update":
                ua, sa = chained.update(grads_at(step), sa, a)
                ub, sb = adam.update(grads_at(step), sb, b)
                a, b = fe.optim.apply_updates(a, ua), fe.optim.apply_updates(b, ub)
            else:
                sa = chained.update_(grads_at(step), sa, a)
                sb = adam.update_(grads_at(step), sb, b)
        torch.testing.assert_close((a, sa), (b, sb), rtol=0, atol=0)


def test_a_transform_that_applies_its_step_runs_it_only_last():
    # adam's in-place form adds its step to the parameters itself (the fused kernel):
    # last in a chain it does; before another transform, the chain derives one that
    # returns the updates for the next transform to change.
    for make in (
        lambda: fe.optim.chain(fe.optim.add_decayed_weights(0.1), fe.optim.adam(LR)),
        lambda: fe.optim.chain(fe.optim.adam(LR), fe.optim.scale_by_learning_rate(0.5)),
    ):
        opt = make()
        pure, mutated = int_tree(), int_tree()
        pure_state, state = opt.init(pure), opt.init(mutated)
        for step in range(3):
            updates, pure_state = opt.update(grads_at(step), pure_state, pure)
            pure = fe.optim.apply_updates(pure, updates)
            state = opt.update_(grads_at(step), state, mutated)
        torch.testing.assert_close(mutated, pure, **CLOSE)
        torch.testing.assert_close(state, pure_state, **CLOSE)


def test_generic_step_checks_updates_before_writing():
    def update(grads, state, params=None):
        return {"w": torch.ones(3)}, state  # wrong shape

    opt = fe.optim.GradientTransformation(lambda p: fe.optim.EmptyState(), update)
    params = {"w": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=r"update_: the update for params\['w'\] has shape"):
        opt.update_({"w": torch.ones(2, 3)}, fe.optim.EmptyState(), params)
    assert not params["w"].any()


# --- errors: checked before anything is written ------------------------------------------


def snapshot(tree: Any) -> Any:
    return optree.tree_map(torch.clone, tree, none_is_leaf=False)


GOOD = {"w": torch.ones(N, 4, 2, dtype=torch.float64), "b": torch.ones(N, 2, dtype=torch.float64)}
OTHER = {
    "w": torch.zeros(N, 5, 2, dtype=torch.float64),
    "b": torch.zeros(N, 2, dtype=torch.float64),
}


def same(opt: Any, state: Any) -> Any:
    return state


BAD_CALLS = [
    pytest.param(
        lambda opt, s: (s[0],),
        GOOD,
        ValueError,
        r"chain: the state is not this chain's \(expected .*, got a tuple of 1;",
        id="length",
    ),
    pytest.param(
        lambda opt, s: (fe.optim.EmptyState(), s[1]),
        GOOD,
        TypeError,
        r"adam: the state is not this transform's \(expected an AdamState from its init, got "
        r"EmptyState\)\. Pass the state",
        id="state-type",
    ),
    pytest.param(
        same,
        {"w": None},
        ValueError,
        r"adam: grads do not match the structure of the parameters",
        id="grads-structure",
    ),
    pytest.param(
        same,
        {**GOOD, "b": torch.ones(N, 3, dtype=torch.float64)},
        ValueError,
        r"adam: the gradient for params\['b'\] has shape \(3, 3\)",
        id="grad-shape",
    ),
    pytest.param(
        same,
        {**GOOD, "b": 1.0},
        TypeError,
        r"adam: the gradient for params\['b'\] is not a tensor \(expected .*, got float\)",
        id="grad-type",
    ),
    pytest.param(
        lambda opt, s: (s[0]._replace(nu=opt.init(OTHER)[0].nu), s[1]),
        GOOD,
        ValueError,
        r"adam: state.nu for params\['w'\] has shape \(3, 5, 2\)",
        id="state-shape",
    ),
]


@pytest.mark.parametrize(("corrupt", "grads", "error", "match"), BAD_CALLS)
def test_bad_call_changes_nothing(corrupt, grads, error, match):
    opt = fe.optim.adam(1e-2)
    params = small_tree()
    state = opt.update_(GOOD, opt.init(params), params)  # non-zero moments
    bad = corrupt(opt, state)
    before = snapshot((params, state))
    with pytest.raises(error, match=match):
        opt.update_(grads, bad, params)
    torch.testing.assert_close((params, state), before, rtol=0, atol=0)


def test_per_member_size_mismatch_changes_nothing():
    opt = fe.optim.adam(lambda c: torch.full((N + 1,), 1e-2))  # one value too many
    params = small_tree()
    state = opt.init(params)
    before = snapshot((params, state))
    with pytest.raises(ValueError, match=r"adam: lr has 4 per-member values but params\['b'\]"):
        opt.update_(small_tree(), state, params)
    torch.testing.assert_close((params, state), before, rtol=0, atol=0)


def test_wrong_schedule_state_is_rejected():
    opt = fe.optim.adam(lambda c: 1e-2)
    params = small_tree()
    state = opt.init(params)
    with pytest.raises(
        TypeError,
        match=r"adam: the state is not this transform.s \(expected a ScheduleState .* got "
        r"EmptyState\)",
    ):
        opt.update_(small_tree(), (state[0], fe.optim.EmptyState()), params)
    assert state[1].count.item() == 0


# --- EnsembleOptimizer --------------------------------------------------------------------


def test_ensemble_optimizer_state_dict_is_live_and_round_trips():
    torch.manual_seed(0)
    ens = fe.Ensemble([torch.nn.Linear(3, 2) for _ in range(N)])
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adamw(1e-2, amsgrad=True))
    x = torch.randn(5, 3)

    def train(e: fe.Ensemble, o: fe.optim.EnsembleOptimizer) -> None:
        o.zero_grad()
        e(x).pow(2).sum().backward()
        o.step()

    train(ens, opt)
    live = opt.state_dict()
    saved = copy.deepcopy(live)
    resumed = copy.deepcopy(ens)
    resumed_opt = fe.optim.EnsembleOptimizer(resumed, fe.optim.adamw(1e-2, amsgrad=True))
    resumed_opt.load_state_dict(saved)
    train(ens, opt)
    train(resumed, resumed_opt)
    key = next(k for k in live["state"] if "mu" in k)
    assert not torch.equal(live["state"][key], saved["state"][key])  # stepped in place
    torch.testing.assert_close(dict(resumed.named_parameters()), dict(ens.named_parameters()))
    torch.testing.assert_close(resumed_opt.state_dict()["state"], opt.state_dict()["state"])


def test_a_chain_that_raises_leaves_params_and_every_state_as_they_were():
    # Each transform checks before it writes; the ones before the last run out of
    # place, their states written in only once the last one has run.
    opt = fe.optim.chain(
        fe.optim.scale_by_adam(),
        fe.optim.add_decayed_weights(0.1),
        fe.optim.scale_by_learning_rate(lambda c: torch.full((N + 1,), 1e-2)),
    )
    params = small_tree()
    state = opt.init(params)
    before = snapshot((params, state))
    with pytest.raises(ValueError, match=r"lr has 4 per-member values"):
        opt.update_(small_tree(), state, params)
    torch.testing.assert_close((params, state), before, rtol=0, atol=0)
    assert state[0].count["w"].item() == 0  # scale_by_adam's state untouched too


def test_a_folded_learning_rate_keeps_its_own_name_in_errors():
    opt = fe.optim.chain(
        fe.optim.scale_by_adam(), fe.optim.scale_by_learning_rate(lambda c: "fast")
    )
    params = small_tree()
    state = opt.init(params)
    before = snapshot((params, state))
    for call in (opt.update, opt.update_):
        with pytest.raises(TypeError, match=r"scale_by_learning_rate: the lr schedule must"):
            call(small_tree(), state, params)
    torch.testing.assert_close((params, state), before, rtol=0, atol=0)


@pytest.mark.parametrize("face", ["EnsembleOptimizer", "update_"])
@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_a_graph_saved_before_the_step_refuses_backward_as_torch_optim_does(face, kind):
    """An actor's loss through the critics, built before the critics' step and
    backpropagated after it: torch.optim's default Adam raises ("modified by an inplace
    operation"); the fused kernel bumped no version counter, so the backward ran on a
    mix of old and new weights without a word."""
    torch.manual_seed(0)
    linear = torch.nn.Linear
    ens = fe.Ensemble(
        [torch.nn.Sequential(linear(7, 16), torch.nn.ReLU(), linear(16, 1)) for _ in range(4)]
    )
    make = getattr(fe.optim, kind)(0.1)
    if face == "EnsembleOptimizer":
        opt = fe.optim.EnsembleOptimizer(ens, make)
        step = opt.step
    else:
        params = ens.stacked_params()
        state = [make.init(params)]

        def step() -> None:
            grads = {k: p.grad for k, p in params.items()}
            state[0] = make.update_(grads, state[0], params)

    actor = torch.nn.Linear(5, 2)
    s = torch.randn(32, 5)
    q = ens(torch.cat([s, actor(s)], -1))  # the actor's loss graph, before the step
    ens(torch.randn(3, 7)).sum().backward()
    with torch.no_grad():
        step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        q.mean().backward()
