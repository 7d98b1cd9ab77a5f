"""The one seam to torch's internals: feature lookups, and flags shared by threads."""

import contextlib
import threading

import pytest
import torch
from helpers import assert_trees_equal, runtime_typecheck_off

import funcensemble as fe
from funcensemble import _torch_compat


def _flags() -> tuple[bool, bool]:
    return (
        torch._C._functorch._is_vmap_fallback_enabled(),
        torch.backends.mha.get_fastpath_enabled(),
    )


def test_two_threads_do_not_trip_each_other():
    # A enters, B enters, A leaves while B is still inside: B must still run with the
    # silent loop refused, and the user's flags must come back once both have left.
    before = _flags()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, tuple[bool, bool]] = {}

    def a() -> None:
        with _torch_compat.no_silent_vmap_loops():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        a_in.wait(10)
        with _torch_compat.no_silent_vmap_loops():
            b_in.set()
            a_out.wait(10)
            seen["b after a left"] = _flags()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["b after a left"] == (False, False)
    assert _flags() == before == (True, True)


def test_the_users_own_settings_are_restored():
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 2) for _ in range(2)])
        fe.vmap(lambda p, b, x: fmodel(p, b, x) * 1)(params, buffers, torch.ones(4, 3))
        assert _flags() == (True, False)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def test_concurrent_vmaps_leave_the_flags_as_they_were():
    fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 2) for _ in range(3)])
    f = fe.vmap(lambda p, b, x: fmodel(p, b, x).tanh())
    x = torch.randn(5, 3)
    expected = f(params, buffers, x)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                torch.testing.assert_close(f(params, buffers, x), expected)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert _flags() == (True, True)


def test_missing_batching_rule_reads_both_wordings():
    old = "Batching rule not implemented for aten::_weight_norm. We could not generate a fallback."
    new = "RuntimeError: aten::as_strided_ hit the vmap fallback which is currently disabled"
    assert _torch_compat.missing_batching_rule(old) == "aten::_weight_norm"
    assert _torch_compat.missing_batching_rule(new) == "aten::as_strided_"
    assert _torch_compat.missing_batching_rule("some other error") is None


def test_transform_helpers_see_vmap_levels():
    assert not _torch_compat.inside_transform()
    assert _torch_compat.vmap_level() is None
    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        level = _torch_compat.vmap_level()
        inner, bdim = _torch_compat.unwrap_at(x, level)
        seen.append((level, tuple(inner.shape), bdim))
        with _torch_compat.lower_transform():
            doubled = inner * 2
        return _torch_compat.add_batch_dim(doubled, bdim, level)

    x = torch.arange(6.0).view(2, 3)
    torch.testing.assert_close(torch.func.vmap(f, in_dims=1)(x), (x * 2).t())
    assert seen[0][1:] == ((2, 3), 1)


def test_a_missing_private_call_fails_at_import_with_the_version():
    with pytest.raises(ImportError, match=r"lacks torch\._C\.no_such_call.*torch >= 2\.9"):
        _torch_compat._require(torch._C, "no_such_call", "torch._C", "2.9")


class _PassThrough(torch.overrides.TorchFunctionMode):
    """Any torch function mode: vmap_flat then takes torch's own _flat_vmap."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _member(w: torch.Tensor, x: torch.Tensor, scale: float, y: torch.Tensor) -> object:
    out = torch.tanh(w @ x) * scale
    return {"out": out, "pair": (out.sum(), y * 2)}


@pytest.mark.parametrize("mode", [None, "function mode"])
def test_vmap_flat_is_torch_func_vmap_on_flat_arguments(mode: str | None) -> None:
    w, x, y = torch.randn(4, 3, 5), torch.randn(5, 2), torch.randn(2, 4)
    context = _PassThrough() if mode else contextlib.nullcontext()
    with context:
        expected = torch.func.vmap(_member, in_dims=(0, None, None, 1))(w, x, 0.5, y)
        got = _torch_compat.vmap_flat(_member, 4, [0, None, None, 1], [w, x, 0.5, y], "error")
        one = _torch_compat.vmap_flat(lambda w: w.sum(), 4, [0], [w], "error")
    assert_trees_equal(got, expected)
    assert torch.equal(one, w.sum((1, 2)))
    assert not _torch_compat.inside_transform()


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_vmap_flat_draws_what_torch_func_vmap_draws(randomness: str) -> None:
    x = torch.ones(6, 100)

    def drop(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, 0.5)

    torch.manual_seed(3)
    expected = torch.func.vmap(drop, randomness=randomness)(x)
    torch.manual_seed(3)
    got = _torch_compat.vmap_flat(drop, 6, [0], [x], randomness)
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="randomness"):
        _torch_compat.vmap_flat(drop, 6, [0], [x], "error")
    assert not _torch_compat.inside_transform()


def test_vmap_flat_refuses_what_torch_func_vmap_refuses() -> None:
    w = torch.randn(3, 2)
    with pytest.raises(ValueError) as expected:
        torch.func.vmap(lambda w: (w, "text"))(w)
    with pytest.raises(ValueError) as got:
        _torch_compat.vmap_flat(lambda w: (w, "text"), 3, [0], [w], "error")
    assert str(got.value) == str(expected.value)
    with pytest.raises(ZeroDivisionError):  # the level is left whatever func raises
        _torch_compat.vmap_flat(lambda w: 1 / 0, 3, [0], [w], "error")
    assert not _torch_compat.inside_transform()


def _sdp_flags() -> list[bool]:
    return [get() for get, _, _ in _torch_compat._sdp_switches]


def test_the_math_sdpa_switch_sets_and_restores_what_sdpa_kernel_does() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.enable_flash_sdp(False)  # a user's own setting, kept
    # torch 2.6's sdpa_kernel leaves the "overrideable" backend (other devices') as it
    # is; ours turns it off with every backend but math. The others must agree.
    shared = [
        k
        for k, (get, _, _) in enumerate(_torch_compat._sdp_switches)
        if "overrideable" not in get.__name__
    ]
    try:
        before = _sdp_flags()
        with sdpa_kernel(SDPBackend.MATH):
            expected = _sdp_flags()
        with _torch_compat.no_silent_vmap_loops(math_sdpa=True):
            inside = _sdp_flags()
        assert [inside[k] for k in shared] == [expected[k] for k in shared]
        assert [v for k, v in enumerate(inside) if k not in shared] == [False] * (
            len(inside) - len(shared)
        )
        assert _sdp_flags() == before
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


def test_lower_vmap_steps_out_of_the_innermost_vmap_and_back() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        level = _torch_compat.vmap_level()
        with _torch_compat.lower_vmap():
            lowered = _torch_compat.vmap_level()
        assert _torch_compat.vmap_level() == level
        return x * 0 + (-1 if lowered is None else lowered)

    outer = torch.func.vmap(torch.func.vmap(f))(torch.zeros(2, 3))
    assert torch.equal(outer, torch.ones(2, 3))  # the inner vmap lowered to the outer one
    assert torch.equal(torch.func.vmap(f)(torch.zeros(2)), -torch.ones(2))


@pytest.mark.parametrize("case", ["unchanged", "changed", "marked_elsewhere"])
def test_a_traced_change_is_refused_while_tracing(case):
    """The fake tensor's version counter, read at trace time: a change between the mark
    and the check is refused before the compiled call runs; a check without its mark
    in the same trace (a call split by a graph break) is refused, never passed."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        if case != "marked_elsewhere":
            _torch_compat.mark_traced_version(x)
        if case == "changed":
            x.mul_(2)
        _torch_compat.refuse_traced_change(x, "changed in place", "split by a graph break")
        return x + 1

    x = torch.ones(3)
    torch._dynamo.reset()
    with runtime_typecheck_off():
        if case == "unchanged":
            assert torch.equal(torch.compile(fn, backend="eager", fullgraph=True)(x), x + 1)
            fn(x)  # eagerly nothing is read
            return
        kind, says = (ValueError, "changed") if case == "changed" else (RuntimeError, "split")
        with pytest.raises(Exception, match=says) as raised:  # Dynamo's, wrapping ours
            torch.compile(fn, backend="eager", fullgraph=True)(x)
    assert str(raised.value).startswith(f"{kind.__name__}: {says}"), raised.value
    assert torch.equal(x, torch.ones(3))  # refused while tracing: nothing ran
