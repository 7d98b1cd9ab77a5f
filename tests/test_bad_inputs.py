"""Bad inputs at every public entry point: the loop's result, or a clear error and no change.

Each row of ``CASES`` builds fresh objects, then calls one public entry point with one
bad (or borderline) input. It expects either

- a clear error: the right exception type and a message naming the argument, member or
  parameter (``match``), with NOTHING changed: every tensor reachable from the watched
  objects (parameters and their ``.grad``, buffers, optimizer state, the user's own
  tensors), modules' train/eval flags and the bytes of the watched files and folders
  are compared before and after; or
- the result of the plain loop over ordinary modules / plain torch (``check``).
"""

import copy
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import funcensemble as fe
from tests.helpers import assert_trees_close, runtime_typecheck_off

# --- snapshots of everything reachable ---------------------------------------------------


def snapshot(obj: Any) -> dict[str, Any]:
    """Every tensor, flag and file reachable from ``obj``, copied, keyed by its path."""
    out: dict[str, Any] = {}
    _walk(obj, "", out, set())
    return out


def _walk(obj: Any, path: str, out: dict[str, Any], seen: set[int]) -> None:
    if isinstance(obj, Tensor):
        obj = obj.to_dense() if obj.is_sparse else obj
        grad = obj.grad if obj.is_leaf else None
        out[path] = (
            obj.detach().clone(),
            obj.requires_grad,
            None if grad is None else grad.detach().to_dense().clone(),
        )
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Path):
        if obj.is_dir():
            for child in sorted(obj.iterdir()):
                _walk(child, f"{path}/{child.name}", out, seen)
            out[path] = ("dir", sorted(p.name for p in obj.iterdir()))
        else:
            out[path] = ("file", obj.read_bytes() if obj.exists() else None)
    elif isinstance(obj, nn.Module):
        for name, t in obj.named_parameters(remove_duplicate=False):
            _walk(t, f"{path}.{name}", out, seen)
        for name, t in obj.named_buffers(remove_duplicate=False):
            _walk(t, f"{path}.{name}", out, seen)
        for name, sub in obj.named_modules():
            out[f"{path}.{name}:training"] = sub.training
    elif isinstance(obj, fe.optim.EnsembleOptimizer):
        _walk(obj.params, f"{path}.params", out, seen)
        _walk(obj.state, f"{path}.state", out, seen)
    elif isinstance(obj, Mapping):
        out[f"{path}:keys"] = list(obj.keys())
        for k, v in obj.items():
            _walk(v, f"{path}[{k!r}]", out, seen)
    elif isinstance(obj, (list, tuple)):
        out[f"{path}:len"] = (type(obj).__name__, len(obj))
        for k, v in enumerate(obj):
            _walk(v, f"{path}[{k}]", out, seen)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        out[path] = obj


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys(), f"changed: {sorted(before.keys() ^ after.keys())}"
    for key, a in before.items():
        b = after[key]
        if isinstance(a, tuple) and a and isinstance(a[0], Tensor):
            (ta, rg_a, ga), (tb, rg_b, gb) = a, b
            assert ta.dtype == tb.dtype and ta.shape == tb.shape, f"{key}: dtype/shape changed"
            assert torch.equal(ta, tb) or (ta.isnan().any() and ta.equal(tb)), f"{key} changed"
            assert rg_a == rg_b, f"{key}: requires_grad changed"
            assert (ga is None) == (gb is None), f"{key}: .grad changed"
            assert ga is None or torch.equal(ga, gb), f"{key}: .grad changed"
        else:
            assert a == b, f"{key} changed: {a!r} -> {b!r}"


# --- building blocks ---------------------------------------------------------------------


def mlp(seed: int = 0, *, d_in: int = 3, d_out: int = 2, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 4), nn.Tanh(), nn.Linear(4, d_out)).to(dtype)


def bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double()


def mlps(n: int = 3, **kwargs: Any) -> list[nn.Module]:
    return [mlp(i, **kwargs) for i in range(n)]


def ens(n: int = 3, make: Callable[[int], nn.Module] = mlp) -> fe.Ensemble:
    return fe.Ensemble([make(i) for i in range(n)])


def stacked(n: int = 3, make: Callable[[int], nn.Module] = mlp) -> tuple:
    return fe.stack([make(i) for i in range(n)])


def x(*shape: int, dtype=torch.float64) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7), dtype=dtype)


def loss_fn_of(fmodel: fe.FunctionalModule) -> Callable[..., Tensor]:
    return lambda p, b, inp: fmodel(p, b, inp).pow(2).mean()


def adam_setup(n: int = 3) -> tuple[dict, Any, fe.optim.GradientTransformation, dict]:
    """Params, an Adam state after one step, the transform and a gradient."""
    _, params, _ = stacked(n)
    params = {k: v.detach().clone() for k, v in params.items()}
    opt = fe.optim.adam(lr=0.1)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    state = opt.update_(grads, opt.init(params), params)
    return params, state, opt, grads


def checkpoint(tmp: Path, obj: Any, name: str = "ck.safetensors") -> Path:
    path = tmp / name
    fe.save(path, obj)
    return path


# --- the table ---------------------------------------------------------------------------


@dataclass
class Setup:
    """What a case calls, what it watches, and (for a loop case) how to check the result."""

    call: Callable[[], Any]
    watched: Any
    check: Callable[[Any], None] | None = None  # the loop's result; None: an error


@dataclass(frozen=True)
class Bad:
    id: str
    build: Callable[[Path], Setup]
    error: type[BaseException] | None = None
    match: str | None = None
    xfail: str | None = None


CASES: list[Bad] = []


def error(
    id: str, exc: type[BaseException], match: str, *, xfail: str | None = None
) -> Callable[[Callable[[Path], Setup]], Callable[[Path], Setup]]:
    def register(build: Callable[[Path], Setup]) -> Callable[[Path], Setup]:
        CASES.append(Bad(id, build, exc, match, xfail))
        return build

    return register


def loop(
    id: str, *, xfail: str | None = None
) -> Callable[[Callable[[Path], Setup]], Callable[[Path], Setup]]:
    def register(build: Callable[[Path], Setup]) -> Callable[[Path], Setup]:
        CASES.append(Bad(id, build, None, None, xfail))
        return build

    return register


def simple(call: Callable[[], Any], *watched: Any) -> Callable[[Path], Setup]:
    return lambda tmp: Setup(call, list(watched))


def register_simple(id: str, exc: type[BaseException], match: str, call: Callable[[], Any]):
    CASES.append(Bad(id, lambda tmp: Setup(call, []), exc, match))


def _redefined() -> type[nn.Module]:
    """A class made anew on every call, as a notebook cell run twice makes it."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    return Head


# --- fe.stack / fe.Ensemble: the members ---------------------------------------------------

for _where, _make in (("stack", fe.stack), ("Ensemble", fe.Ensemble)):
    register_simple(
        f"{_where}-empty",
        ValueError,
        "modules is empty \\(expected at least one module, got 0\\)",
        lambda m=_make: m([]),
    )
    register_simple(
        f"{_where}-single-module",
        TypeError,
        "modules is a single module \\(expected a sequence of modules.*single Sequential\\)",
        lambda m=_make: m(mlp()),
    )
    register_simple(
        f"{_where}-not-a-module",
        TypeError,
        "member 1 is a str, not a module \\(expected an nn.Module, got str\\)",
        lambda m=_make: m([mlp(), "mlp"]),
    )
    register_simple(
        f"{_where}-shape",
        ValueError,
        r"member 2 has parameter `2.weight` with shape \(5, 4\); member 0 has \(2, 4\)",
        lambda m=_make: m([mlp(0), mlp(1), mlp(2, d_out=5)]),
    )
    register_simple(
        f"{_where}-dtype",
        ValueError,
        "member 1 has parameter `0.weight` with dtype torch.float32; member 0 has torch.float64",
        lambda m=_make: m([mlp(0), mlp(1, dtype=torch.float32)]),
    )
    register_simple(
        f"{_where}-class",
        TypeError,
        "member 1 is a Linear; member 0 is a Sequential",
        lambda m=_make: m([mlp(0), nn.Linear(3, 2)]),
    )
    if _where == "Ensemble":
        register_simple(
            "Ensemble-stateless-members",
            ValueError,
            "Ensemble: the members have no parameters or buffers \\(expected at least one",
            lambda m=_make: m([nn.Sequential(nn.Identity(), nn.Dropout()) for _ in range(2)]),
        )
    register_simple(
        f"{_where}-class-defined-twice",
        TypeError,
        "member 1 is a .*; member 0 is a .* They are two class objects of the same name",
        lambda m=_make: m([_redefined()(), _redefined()()]),
    )
    register_simple(
        f"{_where}-mode",
        ValueError,
        "member 1 has submodule `1` in eval mode; member 0 has it in train mode",
        lambda m=_make: m([bn_net(0), (lambda n: (n[1].eval(), n)[1])(bn_net(1))]),
    )
    register_simple(
        f"{_where}-requires-grad",
        ValueError,
        "member 1 has parameter `0.bias` with requires_grad=False",
        lambda m=_make: m([mlp(0), (lambda n: (n[0].bias.requires_grad_(False), n)[1])(mlp(1))]),
    )
    register_simple(
        f"{_where}-lstm",
        TypeError,
        "member 0 contains LSTM at the root module",
        lambda m=_make: m([nn.LSTM(3, 2)]),
    )
    register_simple(
        f"{_where}-extra-buffer",
        ValueError,
        "member 1 has extra buffers `extra`",
        lambda m=_make: m(
            [mlp(0), (lambda n: (n.register_buffer("extra", torch.ones(1)), n)[1])(mlp(1))]
        ),
    )
    register_simple(
        f"{_where}-buffer-requires-grad",
        ValueError,
        "member 1's buffer `scale` requires grad \\(expected buffers with requires_grad=False",
        lambda m=_make: m(
            [
                mlp(0),
                (lambda n: (n.register_buffer("scale", torch.ones(2).requires_grad_()), n)[1])(
                    mlp(1)
                ),
            ]
        ),
    )
    register_simple(
        f"{_where}-buffer-computed-from-a-parameter",
        ValueError,
        "member 0's buffer `start` requires grad \\(it was computed from a parameter",
        lambda m=_make: m(
            [
                (lambda n: (n.register_buffer("start", n[0].weight * 1), n)[1])(mlp(i))
                for i in range(2)
            ]
        ),
    )
    register_simple(
        f"{_where}-untied",
        ValueError,
        "member 1 has extra parameters `t2.weight`",
        lambda m=_make: m([_tied(True), _tied(False)]),
    )


def _tied(tied: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Module()
    net.t1 = nn.Linear(3, 3)
    net.t2 = nn.Linear(3, 3, bias=False)
    if tied:
        net.t2.weight = net.t1.weight
    return net


def _differing(make_layer: Callable[[int], nn.Module]) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(3, 4), make_layer(i), nn.Linear(4, 2)).double() for i in range(3)
    ]


for _where, _make in (("stack", fe.stack), ("Ensemble", fe.Ensemble)):
    CASES.append(
        Bad(
            f"{_where}-leaky-slope-differs",
            lambda tmp, m=_make: Setup(
                lambda: m(_differing(lambda i: nn.LeakyReLU(0.5 if i == 2 else 0.01))), []
            ),
            ValueError,
            r"(?s)member 2.*`1`.*negative_slope.*(0\.01.*0\.5|0\.5.*0\.01)",
        )
    )
    CASES.append(
        Bad(
            f"{_where}-dropout-p-differs",
            lambda tmp, m=_make: Setup(
                lambda: m(_differing(lambda i: nn.Dropout(0.5 if i == 1 else 0.1))), []
            ),
            ValueError,
            r"member 1.*`1`.*\bp\b",
        )
    )
    CASES.append(
        Bad(
            f"{_where}-hook-on-one-member",
            lambda tmp, m=_make: Setup(
                lambda: m(
                    [
                        mlp(0),
                        (lambda n: (n[0].register_forward_hook(lambda *a: None), n)[1])(mlp(1)),
                    ]
                ),
                [],
            ),
            ValueError,
            "member 1.*hook",
        )
    )


# --- fe.vmap ------------------------------------------------------------------------------

register_simple(
    "vmap-not-callable",
    TypeError,
    "fn is not callable \\(expected a callable, got int\\)",
    lambda: fe.vmap(3),
)
register_simple(
    "vmap-randomness",
    ValueError,
    "randomness must be .*\\(expected one of those, got 'bogus'\\)",
    lambda: fe.vmap(len, randomness="bogus"),
)
register_simple(
    "vmap-chunk-zero",
    ValueError,
    "chunk_size must be a positive int.*got 0",
    lambda: fe.vmap(len, chunk_size=0),
)
register_simple(
    "vmap-chunk-float",
    TypeError,
    "chunk_size must be a positive int.*got float",
    lambda: fe.vmap(len, chunk_size=1.5),
)
register_simple(
    "vmap-chunk-bool",
    TypeError,
    "chunk_size must be a positive int.*got bool",
    lambda: fe.vmap(len, chunk_size=True),
)


def _no_members(call: str, make: Callable[[int], nn.Module]) -> Callable[[], Any]:
    """Stacked tensors sliced to no member: the MLP fast path divided by zero."""

    def run() -> Any:
        fmodel, params, buffers = stacked(3, make)
        empty = {k: v[:0] for k, v in params.items()}, {k: v[:0] for k, v in buffers.items()}
        x = torch.randn(5, 3, dtype=torch.float64)
        if call == "vmap":
            return fe.vmap(fmodel)(*empty, x)
        return fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())(*empty, x)

    return run


for _call in ("vmap", "value_and_grad"):
    for _kind, _make in (("mlp", mlp), ("batchnorm", bn_net)):
        register_simple(
            f"{_call}-no-members-{_kind}",
            ValueError,
            f"{_call}: the stacked tensors have no members \\(expected a leading member "
            "axis of at least 1, got 0 in `0.weight`\\)",
            _no_members(_call, _make),
        )

register_simple(
    "vmap-in-dims-str",
    TypeError,
    "in_dims must be None, an int or a tuple \\(expected .*got str\\)",
    lambda: fe.vmap(len, in_dims="0"),
)


def _vmap_call(
    in_dims: Any, inp: Callable[[], Any], make=mlp, **kw: Any
) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        fmodel, params, buffers = stacked(3, make)
        value = inp()
        f = fe.vmap(fmodel, in_dims=in_dims, **kw)
        return Setup(lambda: f(params, buffers, *value), [params, buffers, value])

    return build


CASES += [
    Bad(
        "vmap-member-count",
        _vmap_call(0, lambda: (x(4, 5, 3),)),
        ValueError,
        "argument 0 has size 4 along its member dim 0, but the ensemble has 3 members",
    ),
    Bad(
        "vmap-member-count-bn",
        _vmap_call(0, lambda: (x(2, 5, 3),), bn_net),
        ValueError,
        "argument 0 has size 2 along its member dim 0",
    ),
    Bad(
        "vmap-in-dims-entries",
        _vmap_call((0, 0), lambda: (x(3, 5, 3),)),
        ValueError,
        "in_dims has 2 entries but the call passed 1 positional",
    ),
    Bad(
        "vmap-in-dims-out-of-range",
        _vmap_call(5, lambda: (x(3, 3),)),
        ValueError,
        "argument 0 has 2 dimension.*along dim 5",
    ),
    Bad(
        "vmap-in-dims-structure",
        _vmap_call(({"a": 0, "b": 0},), lambda: ({"a": x(3, 3)},)),
        ValueError,
        r"in_dims entry 0 .* does not match the structure of argument 0",
    ),
    Bad(
        "vmap-mapped-non-tensor",
        _vmap_call(0, lambda: ([1.0, 2.0, 3.0],)),
        TypeError,
        "argument 0 is mapped.*holds a float",
    ),
    Bad(
        "vmap-wrong-width-shared",
        _vmap_call(None, lambda: (x(5, 7),)),
        ValueError,
        r"(?s)layer `0`.*expects 3 input features.*got \(\.\.\., 7\)",
    ),
    Bad(
        "vmap-wrong-width-bn-buffers-kept",
        _vmap_call(None, lambda: (x(5, 7),), bn_net),
        ValueError,
        r"(?s)layer `0`.*expects 3 input features.*got \(\.\.\., 7\)",
    ),
    Bad(
        "vmap-wrong-dtype",
        _vmap_call(None, lambda: (x(5, 3, dtype=torch.float32),)),
        RuntimeError,
        "dtype",
    ),
]


def _in_both(face: str) -> Callable[[Path], Setup]:
    """A name in both params and buffers: the fast path would read one, the general
    path the other (their outputs differed, with no error)."""

    def build(tmp: Path) -> Setup:
        fmodel, params, buffers = stacked(3)
        buffers = {**buffers, "0.weight": params["0.weight"].detach() + 1}
        if face == "vmap":
            call = lambda: fe.vmap(fmodel)(params, buffers, x(5, 3))  # noqa: E731
        else:
            loss = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).sum())
            call = lambda: loss(params, buffers, x(5, 3))  # noqa: E731
        return Setup(call, [params, buffers])

    return build


for _face in ("vmap", "value_and_grad"):
    CASES.append(
        Bad(
            f"{_face}-name-in-params-and-buffers",
            _in_both(_face),
            ValueError,
            "'0.weight' is in both params and buffers \\(expected each name in one of them",
        )
    )


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y if (y > 0).any() else -y  # a branch on the members' values


for _id, _dims in (("bool", ({"x": True},)), ("float", ((0.5,),))):
    register_simple(
        f"Ensemble-nested-in-dims-{_id}",
        TypeError,
        "Ensemble: in_dims holds .*expected None or an int for every entry, nested ones included",
        lambda d=_dims: fe.Ensemble([nn.Linear(3, 2) for _ in range(2)])(
            {"x": torch.randn(2, 4, 3)} if isinstance(d[0], dict) else (torch.randn(2, 4, 3),),
            in_dims=d,
        ),
    )


def _item_in_loss() -> None:
    fmodel, params, buffers = fe.stack([nn.Linear(3, 1) for _ in range(2)])
    loss = fe.value_and_grad(lambda p, b, x: fmodel(p, b, x).mean() * fmodel(p, b, x).max().item())
    loss(params, buffers, torch.randn(4, 3))


register_simple(
    "value_and_grad-item-in-loss",
    RuntimeError,
    r"value_and_grad: the function calls \.item\(\) .* Keep the value a tensor",
    _item_in_loss,
)


def _stacked_params_to_one_member() -> None:
    fmodel, params, buffers = fe.stack([mlp(i) for i in range(3)])
    fmodel(params, buffers, x(5, 3))  # one member's function, all members' tensors


register_simple(
    "FunctionalModule-stacked-params-outside-vmap",
    ValueError,
    r"params\['0.weight'\] has shape \(3, 4, 3\), all members stacked \(expected one "
    r"member's \(4, 3\)\): fmodel computes ONE member",
    _stacked_params_to_one_member,
)


register_simple(
    "Ensemble-data-dependent-branch",
    RuntimeError,
    "Ensemble: the function branches on a tensor's value .* pick with torch.where",
    lambda: fe.Ensemble([_Branches(), _Branches()])(torch.randn(4, 3)),
)


def _inconsistent(tmp: Path) -> Setup:
    fmodel, params, buffers = stacked(3)
    params["2.bias"] = params["2.bias"][:2]
    return Setup(lambda: fe.vmap(fmodel)(params, buffers, x(5, 3)), [params, buffers])


CASES.append(
    Bad(
        "vmap-inconsistent-member-axis",
        _inconsistent,
        ValueError,
        "`2.bias` has leading size 2, but `0.weight` has 3",
    )
)


def _unfit_arguments(face: str) -> Callable[[Path], Setup]:
    """A function or forward that cannot take the arguments given failed inside the
    vectorized call with Python's bare "<lambda>() takes 3 positional arguments but 4
    were given"; an Ensemble passed as the loss, with Sequential's forward's."""

    def build(tmp: Path) -> Setup:
        fmodel, params, buffers = stacked(3)
        inp, target = x(5, 3), x(5, 2)
        e = ens(3)
        calls = {
            "loss-without-buffers": lambda: fe.value_and_grad(
                lambda p, inp, y: (fmodel(p, {}, inp) - y).pow(2).mean()
            )(params, buffers, inp, target),
            "aux-loss-without-buffers": lambda: fe.value_and_grad(
                lambda p, inp, y: ((fmodel(p, {}, inp) - y).pow(2).mean(), y), has_aux=True
            )(params, buffers, inp, target),
            "vmap-forward-given-a-target": lambda: fe.vmap(fmodel)(params, buffers, inp, target),
            "Ensemble-given-a-target": lambda: e(inp, target),
            "Ensemble-as-loss": lambda: fe.value_and_grad(e)(params, buffers, inp, target),
        }
        return Setup(calls[face], [params, buffers, e.state_dict()])

    return build


CASES += [
    Bad(f"value_and_grad-{face}", _unfit_arguments(face), TypeError, match)
    for face, match in (
        (
            "loss-without-buffers",
            r"value_and_grad: the function is called for each member as <lambda>\(params, "
            r"buffers, \*inputs, \*\*kwargs\), here with params, buffers and 2 inputs, which "
            r"its signature \(p, inp, y\) cannot take .* def loss_fn\(params, buffers, x, y\)",
        ),
        ("aux-loss-without-buffers", r"its signature \(p, inp, y\) cannot take"),
        (
            "vmap-forward-given-a-target",
            r"vmap: the members' forward\(.*\) cannot take the 2 inputs given .* a target "
            "for a loss goes to the loss",
        ),
        ("Ensemble-given-a-target", r"Ensemble: the members' forward\(.*\) cannot take the 2"),
        (
            "Ensemble-as-loss",
            r"value_and_grad: loss_fn is an fe.Ensemble, which runs every member itself .* "
            r"Pass ens.fmodel",
        ),
    )
]


def _decorated_loss_error() -> None:
    """A functools.wraps decorator supplying the first argument: a TypeError inside the
    loss kept torch's message (the check read the decorated function's signature and
    blamed a missing argument)."""
    import functools

    fmodel, params, buffers = stacked(3)

    def with_model(f):
        @functools.wraps(f)
        def g(p, b, *rest):
            return f(fmodel, p, b, *rest)

        return g

    @with_model
    def loss(fm, p, b, inp):
        return (fm(p, b, inp) + "bad").sum()

    fe.value_and_grad(loss)(params, buffers, x(5, 3))


def _compiled_loss_arity() -> None:
    """A torch.compile'd loss without the buffers argument: the compiled function's
    signature is the one checked (the wrapper's ``*args, **kwargs`` took anything, and
    Python's bare arity error came back). (The call fails before anything compiles.)"""
    fmodel, params, buffers = stacked(3)

    def loss(p, inp):
        return fmodel(p, {}, inp).sum()

    fe.value_and_grad(torch.compile(loss, backend="eager"))(params, buffers, x(5, 3))


register_simple(
    "value_and_grad-compiled-loss-arity",
    TypeError,
    r"value_and_grad: the function is called for each member as .*, here with params, "
    r"buffers and 1 input, which its signature \(p, inp\) cannot take",
    _compiled_loss_arity,
)


class _MyEnsemble(fe.Ensemble):
    pass


register_simple(
    "value_and_grad-decorated-loss-keeps-torchs-message",
    TypeError,
    r"unsupported operand type\(s\) for \+",
    _decorated_loss_error,
)
register_simple(
    "vmap-ensemble-subclass-as-fn",
    TypeError,
    r"vmap: fn is an fe.Ensemble, which runs every member itself",
    lambda: fe.vmap(_MyEnsemble(mlps()))({}, {}, x(5, 3)),
)
# An ordinary module whose forward takes only inputs: the mapped function's bare
# "missing 1 required positional argument: 'buffers'" said nothing (found by an audit).
register_simple(
    "vmap-module-of-inputs-as-fn",
    TypeError,
    r"vmap: fn is an nn.Module \(Linear\) whose forward takes \(input: torch.Tensor\) "
    r"\(expected a function of ONE member's parameters, called as fn\(params, buffers, "
    r"\*inputs\)\). To run N such modules as one, build fe.Ensemble",
    lambda: fe.vmap(torch.nn.Linear(3, 2)),
)
register_simple(
    "value_and_grad-module-of-inputs-as-loss",
    TypeError,
    r"value_and_grad: loss_fn is an nn.Module \(Sequential\) whose forward takes \(input\)",
    lambda: fe.value_and_grad(mlp(0)),
)
register_simple(
    "HeteroEnsemble.value_and_grad-ensemble-as-loss",
    TypeError,
    r"HeteroEnsemble.value_and_grad: loss_fn is an fe.Ensemble, .* called as "
    r"loss_fn\(fmodel, params, buffers, \*inputs\)",
    lambda: fe.HeteroEnsemble([mlp(0), mlp(1, d_out=3)]).value_and_grad(ens(3)),
)


@loop("vmap-empty-shared-batch")
def _empty_batch(tmp: Path) -> Setup:
    members = mlps()
    fmodel, params, buffers = fe.stack(members)
    inp = x(0, 3)
    want = torch.stack([m(inp) for m in members])
    return Setup(
        lambda: fe.vmap(fmodel)(params, buffers, inp),
        [params],
        lambda out: assert_trees_close(out, want, rtol=0, atol=0),
    )


@loop("vmap-empty-per-member-batch")
def _empty_per_member(tmp: Path) -> Setup:
    members = mlps()
    fmodel, params, buffers = fe.stack(members)
    inp = x(3, 0, 3)
    want = torch.stack([m(inp[i]) for i, m in enumerate(members)])
    return Setup(
        lambda: fe.vmap(fmodel, in_dims=0)(params, buffers, inp),
        [params],
        lambda out: assert_trees_close(out, want, rtol=0, atol=0),
    )


@loop("vmap-one-member")
def _one_member(tmp: Path) -> Setup:
    members = mlps(1)
    fmodel, params, buffers = fe.stack(members)
    inp = x(4, 3)
    want = members[0](inp)[None]
    return Setup(
        lambda: fe.vmap(fmodel)(params, buffers, inp),
        [params],
        lambda out: assert_trees_close(out, want, rtol=1e-12, atol=1e-14),
    )


# --- fe.value_and_grad / fe.grad ----------------------------------------------------------


def _vg(
    loss: Callable[..., Any], args: Callable[[], tuple], *, make=mlp, **kw: Any
) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        fmodel, params, buffers = stacked(3, make)
        value = args()
        f = fe.value_and_grad(loss(fmodel), **kw)
        return Setup(lambda: f(params, buffers, *value), [params, buffers, value])

    return build


def _vector_loss(fmodel):
    return lambda p, b, inp: fmodel(p, b, inp).pow(2).mean(0)


def _no_aux(fmodel):
    return lambda p, b, inp: fmodel(p, b, inp).pow(2).mean()


def _keyword_inputs(face: str) -> Callable[[Path], Setup]:
    """in_dims=0 with the per-member input passed as a keyword: it was shared, every
    member saw all N batches, and the loss broadcast (member 0's loss 1.92, the loop's
    3.19), without a word."""

    def build(tmp: Path) -> Setup:
        fmodel, params, buffers = stacked(3)
        xs = x(3, 5, 3)
        if face == "Ensemble":
            e = ens(3)
            return Setup(lambda: e(x=xs, in_dims=0), [e.state_dict(), xs])
        if face == "vmap":
            f = fe.vmap(fmodel, in_dims=0)
            return Setup(lambda: f(params, buffers, x=xs), [params, buffers, xs])
        g = fe.value_and_grad(lambda p, b, *, x: fmodel(p, b, x).pow(2).mean(), in_dims=0)
        return Setup(lambda: g(params, buffers, x=xs), [params, buffers, xs])

    return build


CASES += [
    Bad(
        f"{face}-in-dims-keyword-inputs",
        _keyword_inputs(face),
        ValueError,
        r"in_dims=0 splits positional arguments over members, but the call passed none",
    )
    for face in ("Ensemble", "vmap", "value_and_grad")
]


CASES += [
    Bad(
        "value_and_grad-vector-loss",
        _vg(_vector_loss, lambda: (x(5, 3),)),
        ValueError,
        r"one scalar per member \(expected shape \(\) per member, got \(2,\) per member\)",
    ),
    Bad(
        "value_and_grad-vector-loss-bn",
        _vg(_vector_loss, lambda: (x(5, 3),), make=bn_net),
        ValueError,
        "one scalar per member",
    ),
    Bad(
        "value_and_grad-vector-loss-chunked",
        _vg(_vector_loss, lambda: (x(5, 3),), chunk_size=2),
        ValueError,
        "one scalar per member",
    ),
    Bad(
        "value_and_grad-has-aux-one-value",
        _vg(_no_aux, lambda: (x(5, 3),), has_aux=True),
        TypeError,
        "has_aux=True.*(loss, aux)",
    ),
    Bad(
        "value_and_grad-member-count",
        _vg(_no_aux, lambda: (x(4, 5, 3),), in_dims=0),
        ValueError,
        "argument 0 has size 4 along its member dim 0",
    ),
    Bad(
        "value_and_grad-member-count-chunked",
        _vg(_no_aux, lambda: (x(4, 5, 3),), in_dims=0, chunk_size=2),
        ValueError,
        "argument 0 has size 4",
    ),
    Bad(
        "value_and_grad-member-count-bn",
        _vg(_no_aux, lambda: (x(4, 5, 3),), make=bn_net, in_dims=0),
        ValueError,
        "argument 0 has size 4",
    ),
]
register_simple(
    "value_and_grad-chunk-zero",
    ValueError,
    "chunk_size must be a positive int",
    lambda: fe.value_and_grad(len, chunk_size=0),
)
register_simple(
    "grad-not-callable",
    TypeError,
    "loss_fn is not callable \\(expected a callable, got str\\)",
    lambda: fe.grad("loss"),
)
register_simple(
    "grad-randomness", ValueError, "randomness must be", lambda: fe.grad(len, randomness="none")
)


def _list_params(tmp: Path) -> Setup:
    _, params, buffers = stacked(3)
    plist = list(params.values())
    f = fe.value_and_grad(lambda p, b, inp: inp.sum() * p[0].sum())
    return Setup(lambda: f(plist, buffers, x(5, 3)), [plist, buffers])


CASES.append(
    Bad(
        "value_and_grad-list-params",
        _list_params,
        TypeError,
        "params.*dict",
    )
)


@loop("grad-integer-leaf")
def _int_leaf(tmp: Path) -> Setup:
    """An integer leaf in params is not differentiated (None), as torch.autograd would."""
    w = x(3, 4)
    params = {"w": w, "steps": torch.arange(3)}
    f = fe.grad(lambda p, b, inp: (p["w"] * inp).sum() * p["steps"])
    inp = x(4)
    return Setup(
        lambda: f(params, {}, inp),
        [],
        lambda out: (
            assert_trees_close(
                out[0],
                {
                    "w": inp.expand(3, 4) * torch.arange(3.0, dtype=torch.float64)[:, None],
                    "steps": None,
                },
                rtol=1e-12,
                atol=0,
            ),
        ),
    )


@loop("grad-unused-parameter-none")
def _unused(tmp: Path) -> Setup:
    members = [
        nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2)}).double() for _ in range(2)
    ]
    fmodel, params, buffers = fe.stack(members)
    f = fe.grad(
        lambda p, b, inp: torch.func.functional_call(
            fmodel.skeleton.a, {"weight": p["a.weight"], "bias": p["a.bias"]}, (inp,)
        ).sum()
    )
    inp = x(4, 3)

    def check(out: Any) -> None:
        grads = out[0]
        assert grads["b.weight"] is None and grads["b.bias"] is None
        for i, m in enumerate(members):
            m.zero_grad()
            m["a"](inp).sum().backward()
            assert m["b"].weight.grad is None
            torch.testing.assert_close(grads["a.weight"][i], m["a"].weight.grad, rtol=1e-12, atol=0)

    return Setup(lambda: f(params, buffers, inp), [], check)


# --- fe.Ensemble ---------------------------------------------------------------------------

register_simple(
    "Ensemble-randomness",
    ValueError,
    "randomness must be",
    lambda: fe.Ensemble(mlps(), randomness="x"),
)
register_simple(
    "Ensemble-chunk-negative",
    ValueError,
    "chunk_size must be a positive int.*-1",
    lambda: fe.Ensemble(mlps(), chunk_size=-1),
)
register_simple(
    "from_factory-not-callable",
    TypeError,
    "factory must be callable \\(expected a function building one member, got str\\)",
    lambda: fe.Ensemble.from_factory("mlp", 3),
)
register_simple(
    "from_factory-zero",
    ValueError,
    r"num_members must be a positive int \(expected an int >= 1, got 0",
    lambda: fe.Ensemble.from_factory(mlp, 0),
)
register_simple(
    "from_factory-float",
    TypeError,
    r"num_members must be a positive int \(expected an int >= 1, got float",
    lambda: fe.Ensemble.from_factory(mlp, 3.0),
)
register_simple(
    "from_factory-bool",
    TypeError,
    r"num_members must be a positive int \(expected an int >= 1, got bool",
    lambda: fe.Ensemble.from_factory(mlp, True),
)
register_simple(
    "from_factory-not-module",
    TypeError,
    "member 0 is an int, not a module \\(expected an nn.Module, got int\\)",
    lambda: fe.Ensemble.from_factory(lambda: 3, 2),
)
CASES.append(
    Bad(
        "from_factory-negative-seed",
        lambda tmp: Setup(lambda: fe.Ensemble.from_factory(mlp, 2, seed=-1), []),
        ValueError,
        "seed",
    )
)
register_simple(
    "from_factory-changing-architecture",
    ValueError,
    r"member 1 has parameter `weight` with shape \(3, 3\); member 0 has \(2, 3\)",
    lambda: (lambda w: fe.Ensemble.from_factory(lambda: nn.Linear(3, next(w)), 2))(
        iter(range(2, 9))
    ),
)


def _ens_call(call: Callable[[fe.Ensemble], Any], make=mlp, n: int = 3) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        e = ens(n, make)
        return Setup(lambda: call(e), [e])

    return build


def _state_without(e: fe.Ensemble, key: str) -> dict:
    sd = {k: v.clone() for k, v in e.state_dict().items()}
    del sd[key]
    return sd


def _state_with(e: fe.Ensemble, key: str, value: Any) -> dict:
    sd = {k: v.clone() + 1 for k, v in e.state_dict().items()}  # all different values
    sd[key] = value
    return sd


CASES += [
    Bad(
        "Ensemble-forward-member-count",
        _ens_call(lambda e: e(x(4, 5, 3), in_dims=0)),
        ValueError,
        "argument 0 has size 4 along its member dim 0, but the ensemble has 3",
    ),
    Bad(
        "Ensemble-forward-member-count-bn",
        _ens_call(lambda e: e(x(4, 5, 3), in_dims=0), bn_net),
        ValueError,
        "argument 0 has size 4",
    ),
    Bad(
        "Ensemble-forward-fails-after-batchnorm",
        _ens_call(
            lambda e: e(x(5, 3)),
            lambda i: nn.Sequential(nn.BatchNorm1d(3), nn.Linear(4, 2)).double(),
        ),
        ValueError,
        r"layer `1`.*expects 4 input features, but is given 3",
    ),
    Bad(
        # The layer-naming run read momentum=None's step count as a number on the meta
        # device and gave up: vmap's bmm message showed the member count, no layer.
        "Ensemble-forward-fails-after-batchnorm-momentum-none",
        _ens_call(
            lambda e: e(x(5, 3)),
            lambda i: nn.Sequential(nn.BatchNorm1d(3, momentum=None), nn.Linear(4, 2)).double(),
        ),
        ValueError,
        r"layer `1`.*expects 4 input features, but is given 3",
    ),
    Bad(
        "Ensemble-member-out-of-range",
        _ens_call(lambda e: e.member(3)),
        IndexError,
        r"index 3 is out of range for an ensemble of 3 members \(valid: -3 to 2\)",
    ),
    Bad(
        "Ensemble-member-negative",
        _ens_call(lambda e: e.member(-4)),
        IndexError,
        "index -4 is out of range",
    ),
    Bad(
        "Ensemble-member-str",
        _ens_call(lambda e: e.member("0")),
        TypeError,
        "index must be an int \\(expected a member index, got str\\)",
    ),
    Bad(
        "load_state_dict-missing-key",
        _ens_call(lambda e: e.load_state_dict(_state_without(e, "stacked.2.bias"))),
        ValueError,
        r"it is missing `stacked\.2\.bias`\.",
    ),
    Bad(
        "load_state_dict-extra-key",
        _ens_call(lambda e: e.load_state_dict(_state_with(e, "stacked.9.bias", torch.zeros(3)))),
        ValueError,
        r"it has extra `stacked\.9\.bias`\.",
    ),
    Bad(
        "load_state_dict-member-count",
        _ens_call(
            lambda e: e.load_state_dict(
                _state_with(e, "stacked.2.bias", torch.zeros(4, 2, dtype=torch.float64))
            )
        ),
        ValueError,
        "`stacked.2.bias` has 4 members in the state_dict; this ensemble has 3",
    ),
    Bad(
        "load_state_dict-shape",
        _ens_call(
            lambda e: e.load_state_dict(
                _state_with(e, "stacked.2.bias", torch.zeros(3, 5, dtype=torch.float64))
            )
        ),
        ValueError,
        r"`stacked.2.bias` has shape \(3, 5\)",
    ),
    Bad(
        "load_state_dict-int-dtype",
        _ens_call(
            lambda e: e.load_state_dict(
                _state_with(e, "stacked.2.bias", torch.zeros(3, 2, dtype=torch.int64))
            )
        ),
        ValueError,
        "`stacked.2.bias` has dtype torch.int64",
    ),
    Bad(
        # Sparse values passed the checks, and copy_ failed after earlier keys' writes.
        "load_state_dict-sparse",
        _ens_call(
            lambda e: e.load_state_dict(
                _state_with(e, "stacked.2.bias", torch.zeros(3, 2, dtype=torch.float64).to_sparse())
            )
        ),
        ValueError,
        r"`stacked.2.bias` is a torch.sparse_coo tensor in the state_dict \(expected a dense",
    ),
    Bad(
        "load_state_dict-non-tensor",
        _ens_call(lambda e: e.load_state_dict(_state_with(e, "stacked.2.bias", [[0.0, 0.0]] * 3))),
        TypeError,
        "stacked.2.bias",
    ),
]

# --- unstack, export_state_dicts, import_state_dicts ---------------------------------------

register_simple(
    "unstack-not-fmodel",
    TypeError,
    "fmodel is not a FunctionalModule \\(expected the one returned by stack, got Sequential\\)",
    lambda: fe.unstack(mlp(), {}, {}),
)


def _unstack_missing(tmp: Path) -> Setup:
    fmodel, params, buffers = stacked()
    params.pop("2.bias")
    return Setup(lambda: fe.unstack(fmodel, params, buffers), [params, buffers])


def _unstack_counts(tmp: Path) -> Setup:
    fmodel, params, buffers = stacked()
    params["2.bias"] = params["2.bias"][:1]
    return Setup(lambda: fe.unstack(fmodel, params, buffers), [params, buffers])


CASES += [
    Bad(
        "unstack-missing-parameter",
        _unstack_missing,
        ValueError,
        r"unstack: the parameters do not match the architecture: the dict is missing `2\.bias`\.",
    ),
    Bad(
        "unstack-member-counts",
        _unstack_counts,
        ValueError,
        "`2.bias` has leading size 1, but `0.weight` has 3",
    ),
]
register_simple(
    "export-ensemble-with-params",
    TypeError,
    "pass an Ensemble alone",
    lambda: fe.export_state_dicts(ens(), {}, {}),
)
register_simple(
    "export-fmodel-without-params",
    TypeError,
    "needs its stacked params and buffers",
    lambda: fe.export_state_dicts(stacked()[0]),
)


def _import(state_dicts: Callable[[list[dict]], Any], make=mlp) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        e = ens(3, make)
        sds = state_dicts([make(10 + i).state_dict() for i in range(3)])
        return Setup(lambda: fe.import_state_dicts(e, sds), [e, sds])

    return build


def _edit(k: int, key: str, value: Any) -> Callable[[list[dict]], list[dict]]:
    def edit(sds: list[dict]) -> list[dict]:
        if value is KeyError:
            del sds[k][key]
        else:
            sds[k][key] = value
        return sds

    return edit


CASES += [
    Bad(
        "import-too-few", _import(lambda s: s[:2]), ValueError, "3 members.*got 2|got 2.*3 members"
    ),
    Bad(
        "import-too-many",
        _import(lambda s: s + s[:1]),
        ValueError,
        "3 members.*got 4|got 4.*3 members",
    ),
    Bad("import-not-a-sequence", _import(lambda s: s[0]), TypeError, "state_dicts"),
    Bad(
        "import-wrong-shape-member-2",
        _import(_edit(2, "2.bias", torch.zeros(5, dtype=torch.float64))),
        ValueError,
        r"member 2.*`2.bias`.*\(5,\)",
    ),
    Bad(
        # Sparse values passed the checks, and copy_ failed after earlier members' writes.
        "import-sparse-member-2",
        _import(_edit(2, "2.bias", torch.zeros(2, dtype=torch.float64).to_sparse())),
        ValueError,
        r"member 2 has `2.bias` as a torch.sparse_coo tensor \(expected a dense",
    ),
    Bad(
        "import-missing-key-member-1",
        _import(_edit(1, "0.weight", KeyError)),
        ValueError,
        "member 1.*`0.weight`",
    ),
    Bad(
        "import-extra-key-member-0",
        _import(_edit(0, "3.weight", torch.zeros(2))),
        ValueError,
        "member 0.*`3.weight`",
    ),
    Bad(
        "import-int-dtype-member-1",
        _import(_edit(1, "2.bias", torch.zeros(2, dtype=torch.int64))),
        ValueError,
        "member 1.*`2.bias`.*int64",
    ),
    Bad(
        "import-non-tensor-member-2",
        _import(_edit(2, "2.bias", [0.0, 0.0])),
        TypeError,
        "member 2.*`2.bias`",
    ),
]


@loop("export-import-roundtrip")
def _roundtrip(tmp: Path) -> Setup:
    members = [bn_net(i) for i in range(3)]
    e = fe.Ensemble([bn_net(10 + i) for i in range(3)])
    sds = [m.state_dict() for m in members]

    def check(out: Any) -> None:
        assert out is e
        for i, m in enumerate(members):
            assert_trees_close(e.member(i).state_dict(), m.state_dict(), rtol=0, atol=0)

    return Setup(lambda: fe.import_state_dicts(e, sds), [], check)


# --- fe.save / fe.load ---------------------------------------------------------------------


def _save(
    obj: Callable[[], Any], name: str = "ck.safetensors", *, existing: bool = True
) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        path = tmp / name
        if existing:
            fe.save(tmp / "ck.safetensors", {"kept": x(3)})
        value = obj()
        return Setup(lambda: fe.save(path, value), [tmp, value])

    return build


CASES += [
    Bad("save-plain-module", _save(lambda: mlp()), TypeError, r"state_dict\(\)"),
    Bad(
        "save-complex-leaf",
        _save(lambda: {"z": torch.zeros(2, dtype=torch.complex64)}),
        TypeError,
        "complex",
    ),
    Bad("save-object-leaf", _save(lambda: {"f": object()}), TypeError, "object"),
    Bad("save-sparse-leaf", _save(lambda: {"s": torch.eye(2).to_sparse()}), TypeError, "sparse"),
    Bad(
        "save-missing-directory",
        _save(lambda: {"a": x(2)}, "missing/ck.safetensors"),
        FileNotFoundError,
        "missing",
    ),
    Bad(
        "save-onto-directory",
        lambda tmp: (
            tmp.joinpath("dir").mkdir(),
            Setup(lambda: fe.save(tmp / "dir", {"a": x(2)}), [tmp]),
        )[1],
        IsADirectoryError,
        "dir",
    ),
]


def _load(
    saved: Callable[[], Any],
    target: Callable[[], Any],
    corrupt: Callable[[Path], None] | None = None,
) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        path = checkpoint(tmp, saved())
        if corrupt is not None:
            corrupt(path)
        obj = target()
        return Setup(lambda: fe.load(path, obj), [tmp, obj])

    return build


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])


def _flip_header_lr(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(b"0.001")
    data[at] = ord("2")
    path.write_bytes(bytes(data))


_PARAMS = lambda: {"w": x(3, 2), "lr": 0.001, "step": 5}  # noqa: E731

CASES += [
    Bad(
        "load-missing-file",
        lambda tmp: Setup(lambda: fe.load(tmp / "nope.safetensors", {"w": x(2)}), [tmp]),
        FileNotFoundError,
        "nope.safetensors",
    ),
    Bad(
        "load-empty-file",
        _load(_PARAMS, _PARAMS, lambda p: p.write_bytes(b"")),
        ValueError,
        "ck.safetensors",
    ),
    Bad(
        "load-garbage-file",
        _load(_PARAMS, _PARAMS, lambda p: p.write_bytes(b"not a checkpoint" * 10)),
        ValueError,
        "ck.safetensors",
    ),
    Bad("load-truncated-file", _load(_PARAMS, _PARAMS, _truncate), ValueError, "ck.safetensors"),
    Bad(
        "load-flipped-header-byte",
        _load(_PARAMS, _PARAMS, _flip_header_lr),
        ValueError,
        "corrupt",
    ),
    Bad("load-plain-module", _load(_PARAMS, lambda: mlp()), TypeError, r"state_dict\(\)"),
    Bad(
        "load-ensemble-member-count",
        _load(lambda: ens(3), lambda: ens(4)),
        ValueError,
        "3 members.*4|4 members.*3",
    ),
    Bad(
        "load-ensemble-architecture",
        _load(lambda: ens(3), lambda: ens(3, bn_net)),
        ValueError,
        "ck.safetensors",
    ),
    Bad("load-ensemble-into-template", _load(lambda: ens(3), _PARAMS), ValueError, "ensemble"),
    Bad(
        "load-template-into-ensemble",
        _load(_PARAMS, lambda: ens(3)),
        ValueError,
        "holds a pytree checkpoint; got an fe.Ensemble",
    ),
    Bad(
        "load-template-dtype",
        _load(_PARAMS, lambda: {"w": x(3, 2, dtype=torch.float32), "lr": 0.0, "step": 0}),
        ValueError,
        r"leaf `\['w'\]` is a float64 tensor .* the template has a float32",
    ),
    Bad(
        "load-template-shape",
        _load(_PARAMS, lambda: {"w": x(3, 3), "lr": 0.0, "step": 0}),
        ValueError,
        "shape",
    ),
    Bad(
        "load-template-structure",
        _load(_PARAMS, lambda: {"w": x(3, 2), "lr": 0.0}),
        ValueError,
        "ck.safetensors",
    ),
    Bad(
        "load-template-leaf-type",
        _load(_PARAMS, lambda: {"w": x(3, 2), "lr": 0.0, "step": x(1)}),
        ValueError,
        "step",
    ),
]


@loop("load-ensemble-roundtrip")
def _load_roundtrip(tmp: Path) -> Setup:
    saved = ens(3, bn_net)
    path = checkpoint(tmp, saved)
    target = fe.Ensemble([bn_net(10 + i) for i in range(3)])

    def check(out: Any) -> None:
        assert out is target
        assert_trees_close(target.state_dict(), saved.state_dict(), rtol=0, atol=0)

    return Setup(lambda: fe.load(path, target), [], check)


register_simple(
    "save-generator",
    TypeError,
    r"leaf `\['g'\]` is a Generator .* Save its state instead \(gen.get_state\(\)",
    lambda: fe.save("unused.safetensors", {"g": torch.Generator()}),
)
register_simple(
    "save-ensemble-inside-a-tree",
    TypeError,
    r"leaf `\['ens'\]` is an Ensemble .* Put its .state_dict\(\) in the tree instead \(an "
    r"ensemble or an EnsembleOptimizer can also be saved on its own: fe.save\(path, obj\)\)",
    lambda: fe.save("unused.safetensors", {"ens": ens(3), "step": 3}),
)
register_simple(
    "save-torch-optimizer-inside-a-tree",
    TypeError,
    r"leaf `\['opt'\]` is an Adam .* Put its .state_dict\(\) in the tree instead",
    lambda: fe.save(
        "unused.safetensors", {"opt": torch.optim.Adam([torch.zeros(2, requires_grad=True)])}
    ),
)


# --- fe.optim ------------------------------------------------------------------------------

for _name, _make in (("adam", fe.optim.adam), ("adamw", fe.optim.adamw)):
    register_simple(
        f"{_name}-negative-lr",
        ValueError,
        "Invalid learning rate: -1.0",
        lambda m=_make: m(lr=-1.0),
    )
    register_simple(f"{_name}-lr-str", TypeError, "lr", lambda m=_make: m(lr="0.1"))
    register_simple(f"{_name}-nan-lr", ValueError, "learning rate", lambda m=_make: m(lr=math.nan))
    register_simple(
        f"{_name}-betas-one-value",
        ValueError,
        r"betas must be a pair \(beta1, beta2\) \(expected 2 values, got 1 values\)",
        lambda m=_make: m(betas=(0.9,)),
    )
    register_simple(
        f"{_name}-beta1-one",
        ValueError,
        "beta parameter at index 0",
        lambda m=_make: m(betas=(1.0, 0.999)),
    )
    register_simple(
        f"{_name}-beta2-negative",
        ValueError,
        "beta parameter at index 1",
        lambda m=_make: m(betas=(0.9, -0.1)),
    )
    register_simple(
        f"{_name}-betas-str", TypeError, "betas must be a pair", lambda m=_make: m(betas="ab")
    )
    register_simple(
        f"{_name}-negative-eps", ValueError, "epsilon value", lambda m=_make: m(eps=-1e-8)
    )
    register_simple(
        f"{_name}-negative-weight-decay",
        ValueError,
        "weight_decay value",
        lambda m=_make: m(weight_decay=-0.1),
    )
    register_simple(
        f"{_name}-amsgrad-int",
        TypeError,
        r"amsgrad must be a bool \(expected True or False, got int\)",
        lambda m=_make: m(amsgrad=1),
    )
    register_simple(
        f"{_name}-maximize-str",
        TypeError,
        r"maximize must be a bool \(expected True or False, got str\)",
        lambda m=_make: m(maximize="yes"),
    )
    register_simple(f"{_name}-lr-matrix", ValueError, "lr", lambda m=_make: m(lr=torch.ones(2, 2)))
    register_simple(
        f"{_name}-lr-negative-member",
        ValueError,
        "learning rate",
        lambda m=_make: m(lr=torch.tensor([0.1, -0.1, 0.1])),
    )

register_simple(
    "scale_by_adam-betas-str",
    TypeError,
    "betas must be a pair",
    lambda: fe.optim.scale_by_adam(betas="ab"),
)
register_simple(
    "add_decayed_weights-negative",
    ValueError,
    "weight_decay",
    lambda: fe.optim.add_decayed_weights(-1.0),
)
register_simple(
    "scale_by_learning_rate-str", TypeError, "lr", lambda: fe.optim.scale_by_learning_rate("fast")
)
register_simple(
    "chain-not-transform",
    TypeError,
    "chain",
    lambda: fe.optim.chain(fe.optim.scale_by_adam(), "sgd"),
)


def _per_member_init(tmp: Path) -> Setup:
    _, params, _ = stacked(4)
    opt = fe.optim.adam(lr=torch.full((3,), 0.1))
    return Setup(lambda: opt.init(params), [params])


CASES.append(
    Bad(
        "adam-per-member-lr-count",
        _per_member_init,
        ValueError,
        r"lr has 3 per-member values but params\['0.bias'\]|lr has 3 per-member values",
    )
)


def _adam_call(
    edit: Callable[[dict, Any, dict], tuple], *, in_place: bool
) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        params, state, opt, grads = adam_setup()
        grads, state2 = edit(grads, state, params)
        if in_place:
            return Setup(lambda: opt.update_(grads, state2, params), [params, state, grads])
        return Setup(lambda: opt.update(grads, state2, params), [params, state, grads])

    return build


def _wrong_grad_shape(grads, state, params):
    grads["2.bias"] = torch.ones(3, 5, dtype=torch.float64)
    return grads, state


def _missing_grad(grads, state, params):
    del grads["2.bias"]
    return grads, state


def _grad_dtype(grads, state, params):
    grads["2.bias"] = grads["2.bias"].float()
    return grads, state


def _grad_list(grads, state, params):
    grads["2.bias"] = [1.0, 2.0]
    return grads, state


def _state_type(grads, state, params):
    return grads, (state[0]._replace(mu="x"), *state[1:])


def _state_tuple(grads, state, params):
    return grads, state[:1]


for _in_place in (False, True):
    _face = "update_" if _in_place else "update"
    CASES += [
        Bad(
            f"adam-{_face}-grad-shape",
            _adam_call(_wrong_grad_shape, in_place=_in_place),
            ValueError,
            r"2.bias.*\(3, 5\)",
        ),
        Bad(
            f"adam-{_face}-missing-grad",
            _adam_call(_missing_grad, in_place=_in_place),
            ValueError,
            "grads|updates",
        ),
        Bad(
            f"adam-{_face}-grad-dtype",
            _adam_call(_grad_dtype, in_place=_in_place),
            ValueError,
            "2.bias.*float32",
        ),
        Bad(
            f"adam-{_face}-grad-list",
            _adam_call(_grad_list, in_place=_in_place),
            TypeError,
            "2.bias",
        ),
        Bad(
            f"adam-{_face}-state-field",
            _adam_call(_state_type, in_place=_in_place),
            ValueError,
            "state.mu",
        ),
    ]
CASES.append(
    Bad(
        "adam-update_-state-truncated",
        _adam_call(_state_tuple, in_place=True),
        ValueError,
        "a tuple of 2 states",
    )
)


@loop("adam-update_-none-grads")
def _none_grads(tmp: Path) -> Setup:
    """torch.optim skips a parameter whose .grad is None: nothing moves, state included."""
    params, state, opt, grads = adam_setup()
    before = snapshot([params, state])
    none = dict.fromkeys(grads)
    return Setup(
        lambda: opt.update_(none, state, params),
        [],
        lambda new: assert_unchanged(before, snapshot([params, new])),
    )


def _apply(updates: Callable[[dict], Any]) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        _, params, _ = stacked()
        ups = updates(params)
        return Setup(lambda: fe.optim.apply_updates(params, ups), [params, ups])

    return build


CASES += [
    Bad(
        "apply_updates-missing-key",
        _apply(lambda p: {k: v for k, v in p.items() if k != "0.bias"}),
        ValueError,
        "0.bias|updates",
    ),
    Bad(
        "apply_updates-shape",
        _apply(
            lambda p: {**{k: torch.zeros_like(v) for k, v in p.items()}, "0.bias": torch.zeros(2)}
        ),
        ValueError,
        r"0.bias.*\(2,\)",
    ),
]


@loop("apply_updates-none-update")
def _apply_none(tmp: Path) -> Setup:
    _, params, _ = stacked()
    ups = {k: None if k == "0.bias" else torch.ones_like(v) for k, v in params.items()}
    want = {k: v.detach() + (0 if k == "0.bias" else 1) for k, v in params.items()}
    return Setup(
        lambda: fe.optim.apply_updates(params, ups),
        [],
        lambda out: assert_trees_close(out, want, rtol=0, atol=0),
    )


# EnsembleOptimizer
register_simple(
    "EnsembleOptimizer-params-str",
    TypeError,
    "params is neither an Ensemble nor a mapping.*got str\\)",
    lambda: fe.optim.EnsembleOptimizer("ens", fe.optim.adam()),
)
register_simple(
    "EnsembleOptimizer-transform-str",
    TypeError,
    "transform is not a GradientTransformation \\(expected.*got str\\)",
    lambda: fe.optim.EnsembleOptimizer(ens(), "adam"),
)
register_simple(
    "EnsembleOptimizer-non-leaf",
    TypeError,
    "parameter `w` must be a leaf tensor",
    lambda: fe.optim.EnsembleOptimizer({"w": x(3, 2).requires_grad_() * 2}, fe.optim.adam()),
)


def _eopt(
    call: Callable[[fe.optim.EnsembleOptimizer, fe.Ensemble], Any],
) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        e = ens(3, bn_net)
        opt = fe.optim.EnsembleOptimizer(e, fe.optim.adam(lr=torch.tensor([0.1, 0.01, 0.001])))
        e(x(5, 3)).sum().backward()
        opt.step()
        e(x(5, 3)).pow(2).sum().backward()  # fresh .grad for the case
        return Setup(lambda: call(opt, e), [e, opt])

    return build


def _sparse_grad(tmp: Path) -> Setup:
    setup = _eopt(lambda o, e: o.step())(tmp)
    e = setup.watched[0]
    e.stacked[3].bias.grad = torch.zeros(3, 2, dtype=torch.float64).to_sparse()
    return setup


CASES.append(
    Bad(
        "EnsembleOptimizer-step-sparse-grad",
        _sparse_grad,
        RuntimeError,
        "`stacked.3.bias|`3.bias` has a sparse gradient",
    )
)


def _sd_edit(opt: fe.optim.EnsembleOptimizer, edit: Callable[[dict], None]) -> dict:
    sd = {
        "state": {
            k: (None if v is None else v.clone() + 1) for k, v in opt.state_dict()["state"].items()
        }
    }
    edit(sd["state"])
    return sd


def _first_key(state: dict, pred: Callable[[Any], bool] = lambda v: v is not None) -> str:
    return next(k for k, v in state.items() if pred(v))


CASES += [
    Bad(
        "EnsembleOptimizer-load-str",
        _eopt(lambda o, e: o.load_state_dict("state")),
        TypeError,
        r"this is not an optimizer state \(expected the dict returned by state_dict\(\)",
    ),
    Bad(
        "EnsembleOptimizer-load-missing-key",
        _eopt(lambda o, e: o.load_state_dict(_sd_edit(o, lambda s: s.pop(_first_key(s))))),
        ValueError,
        "the state does not match this optimizer: it is missing `state",
    ),
    Bad(
        "EnsembleOptimizer-load-shape",
        _eopt(
            lambda o, e: o.load_state_dict(
                _sd_edit(
                    o,
                    lambda s: s.__setitem__(
                        _first_key(s, lambda v: v is not None and v.dim() > 1), torch.zeros(4, 1)
                    ),
                )
            )
        ),
        ValueError,
        r"does not match this optimizer's state \(expected a tensor of shape .*, got a tensor "
        r"of shape \(4, 1\)\)",
    ),
    Bad(
        "EnsembleOptimizer-load-none",
        _eopt(
            lambda o, e: o.load_state_dict(
                _sd_edit(o, lambda s: s.__setitem__(_first_key(s), None))
            )
        ),
        ValueError,
        r"does not match this optimizer's state \(expected a tensor of shape .*, got None\)",
    ),
    Bad(
        "EnsembleOptimizer-load-list",
        _eopt(
            lambda o, e: o.load_state_dict(
                _sd_edit(o, lambda s: s.__setitem__(_first_key(s), [1.0]))
            )
        ),
        ValueError,
        r"does not match this optimizer's state \(expected a tensor of shape .*, got a list\)",
    ),
]


# polyak
def _polyak(
    target: Callable[[], Any], online: Callable[[], Any], tau: Any, *, in_place: bool
) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        t, o = target(), online()
        f = fe.optim.polyak_update_ if in_place else fe.optim.polyak_update
        return Setup(lambda: f(t, o, tau), [t, o])

    return build


for _in_place in (False, True):
    _f = "polyak_update_" if _in_place else "polyak_update"
    CASES += [
        Bad(
            f"{_f}-tau-above-one",
            _polyak(lambda: {"w": x(3, 2)}, lambda: {"w": x(3, 2)}, 1.5, in_place=_in_place),
            ValueError,
            "tau",
        ),
        Bad(
            f"{_f}-tau-per-member-count",
            _polyak(
                lambda: {"w": x(3, 2)},
                lambda: {"w": x(3, 2)},
                torch.tensor([0.1, 0.2]),
                in_place=_in_place,
            ),
            ValueError,
            "tau",
        ),
        Bad(
            f"{_f}-structure",
            _polyak(lambda: {"w": x(3, 2)}, lambda: {"v": x(3, 2)}, 0.1, in_place=_in_place),
            ValueError,
            "online|target",
        ),
        Bad(
            f"{_f}-shape",
            _polyak(lambda: {"w": x(3, 2)}, lambda: {"w": x(3, 3)}, 0.1, in_place=_in_place),
            ValueError,
            r"\(3, 3\)|\(3, 2\)",
        ),
    ]
CASES.append(
    Bad(
        "polyak_update_-ensemble-member-count",
        _polyak(lambda: ens(3), lambda: ens(4), 0.1, in_place=True),
        ValueError,
        "3|4",
    )
)


@loop("polyak_update_-ensemble")
def _polyak_loop(tmp: Path) -> Setup:
    target, online = ens(3, bn_net), fe.Ensemble([bn_net(10 + i) for i in range(3)])
    tau = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    want_p = {
        k: (1 - tau.view(-1, *[1] * (v.dim() - 1))) * v.detach()
        + tau.view(-1, *[1] * (v.dim() - 1)) * online.stacked_params()[k].detach()
        for k, v in target.stacked_params().items()
    }

    def check(out: Any) -> None:
        assert_trees_close(target.stacked_params(), want_p, rtol=1e-14, atol=1e-15)

    return Setup(lambda: fe.optim.polyak_update_(target, online, tau), [], check)


# --- fe.reduce -----------------------------------------------------------------------------

_STACKED = lambda: x(3, 5, 2)  # noqa: E731
for _name in (
    "mean",
    "var",
    "std",
    "min",
    "max",
    "mean_log_probs",
    "mean_probs",
    "predictive_entropy",
    "expected_entropy",
    "mutual_information",
    "disagreement",
):
    _fn = getattr(fe.reduce, _name)
    register_simple(
        f"reduce.{_name}-not-tensor", TypeError, f"{_name}.*got list", lambda f=_fn: f([1.0, 2.0])
    )
    register_simple(f"reduce.{_name}-0-dim", ValueError, _name, lambda f=_fn: f(torch.tensor(1.0)))
register_simple(
    "reduce.mean-int", TypeError, "mean.*int64", lambda: fe.reduce.mean(torch.arange(3))
)
register_simple(
    "reduce.var-negative-correction",
    ValueError,
    "correction",
    lambda: fe.reduce.var(_STACKED(), correction=-1),
)
register_simple(
    "reduce.var-correction-too-large",
    ValueError,
    "correction",
    lambda: fe.reduce.var(_STACKED(), correction=3),
)
register_simple(
    "reduce.subset_min-k-zero", ValueError, "k", lambda: fe.reduce.subset_min(_STACKED(), 0)
)
register_simple(
    "reduce.subset_min-k-too-large", ValueError, "k", lambda: fe.reduce.subset_min(_STACKED(), 4)
)
register_simple(
    "reduce.subset_min-k-float", TypeError, "k", lambda: fe.reduce.subset_min(_STACKED(), 1.5)
)
register_simple(
    "reduce.mean_probs-int-logits",
    TypeError,
    "mean_probs",
    lambda: fe.reduce.mean_probs(torch.ones(3, 2, dtype=torch.int64)),
)


@loop("reduce-all-against-torch")
def _reduce_loop(tmp: Path) -> Setup:
    values = _STACKED()
    logp = torch.log_softmax(values, -1)

    def check(out: Any) -> None:
        r = fe.reduce
        close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)  # noqa: E731
        close(r.mean(values), sum(values.unbind(0)) / 3)
        close(r.var(values), values.var(0))
        close(r.std(values, correction=0), values.std(0, correction=0))
        close(r.min(values), values.min(0).values)
        close(r.max(values), values.max(0).values)
        close(r.mean_probs(values), logp.exp().mean(0))
        close(
            r.predictive_entropy(values), -(logp.exp().mean(0) * logp.exp().mean(0).log()).sum(-1)
        )

    return Setup(lambda: None, [values], check)


# --- fe.select, fe.concat -------------------------------------------------------------------

# A module is one opaque leaf of a pytree: it once came back as it was, unselected.
register_simple(
    "select-a-module",
    TypeError,
    r"select: tree is a HeteroEnsemble module, not a pytree of stacked tensors",
    lambda: fe.select(fe.HeteroEnsemble([nn.Linear(3, 2), nn.Linear(3, 1)]), [0]),
)
register_simple(
    "concat-modules",
    TypeError,
    r"concat: trees\[0\] is an Ensemble module, not a pytree of stacked tensors",
    lambda: fe.concat([ens(2), ens(2)]),
)

# --- bootstrap_indices, BaggingSampler ------------------------------------------------------

register_simple(
    "bootstrap_indices-zero-members", ValueError, "num_members", lambda: fe.bootstrap_indices(0, 10)
)
register_simple(
    "bootstrap_indices-negative-samples",
    ValueError,
    "num_samples",
    lambda: fe.bootstrap_indices(3, -1),
)
register_simple(
    "bootstrap_indices-float-members",
    TypeError,
    "num_members",
    lambda: fe.bootstrap_indices(3.0, 10),
)
register_simple(
    "bootstrap_indices-sample-size-without-replacement",
    ValueError,
    "sample_size",
    lambda: fe.bootstrap_indices(3, 10, sample_size=11, replace=False),
)
register_simple(
    "BaggingSampler-zero-batch", ValueError, "batch_size", lambda: fe.BaggingSampler(3, 10, 0)
)
# Flags given as strings once went by their truth value: "no" drew with replacement.
register_simple(
    "bootstrap_indices-replace-str",
    TypeError,
    "bootstrap_indices: replace must be a bool",
    lambda: fe.bootstrap_indices(3, 10, replace="no"),
)
for _flag in ("drop_last", "replace"):
    register_simple(
        f"BaggingSampler-{_flag}-str",
        TypeError,
        f"BaggingSampler: {_flag} must be a bool",
        lambda f=_flag: fe.BaggingSampler(3, 10, 2, **{f: "no"}),
    )

# --- fe.distributed (one process, no process group) -----------------------------------------


def _dist() -> Any:
    return fe.distributed


register_simple(
    "member_slices-more-parts", ValueError, "parts", lambda: _dist().member_slices(3, 5)
)
register_simple(
    "member_slices-negative", ValueError, "num_members", lambda: _dist().member_slices(-1, 2)
)
register_simple("member_slices-float", TypeError, "parts", lambda: _dist().member_slices(3, 2.0))
register_simple("MemberShard-zero", ValueError, "num_members", lambda: _dist().MemberShard(0))
register_simple("MemberShard-str", TypeError, "num_members", lambda: _dist().MemberShard("3"))
register_simple(
    "ShardedEnsemble-no-devices",
    ValueError,
    "devices is empty \\(expected at least one device, got 0\\)",
    lambda: _dist().ShardedEnsemble(mlps(), []),
)
register_simple(
    "ShardedEnsemble-too-many-devices",
    ValueError,
    "devices|members",
    lambda: _dist().ShardedEnsemble(mlps(), ["cpu"] * 4),
)
register_simple(
    "ShardedEnsemble-unknown-device",
    ValueError,
    "nodevice",
    lambda: _dist().ShardedEnsemble(mlps(), ["nodevice"]),
)
register_simple(
    "ShardedEnsemble-devices-str",
    TypeError,
    "devices",
    lambda: _dist().ShardedEnsemble(mlps(), "cpu"),
)


def _collective(call: Callable[[Any, Tensor], Any]) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        local = x(3, 4)
        shard = _dist().MemberShard(3)
        return Setup(lambda: call(shard, local), [local])

    return build


CASES += [
    Bad(
        "distributed.mean-shard-str",
        _collective(lambda s, v: _dist().mean(v, "shard")),
        TypeError,
        "shard is not a MemberShard \\(expected a fe.distributed.MemberShard.*got str\\)",
    ),
    Bad(
        "distributed.mean-member-count",
        _collective(lambda s, v: _dist().mean(v[:2], s)),
        ValueError,
        "3|2",
    ),
    Bad(
        "distributed.all_gather-member-count",
        _collective(lambda s, v: _dist().all_gather(v[:2], s)),
        ValueError,
        "3|2",
    ),
    Bad(
        "distributed.var-correction",
        _collective(lambda s, v: _dist().var(v, s, correction=-1)),
        ValueError,
        "correction",
    ),
    Bad(
        "distributed.subset_min-k",
        _collective(lambda s, v: _dist().subset_min(v, s, 4)),
        ValueError,
        "k",
    ),
    Bad(
        "distributed.mutual_information-member-count",
        _collective(lambda s, v: _dist().mutual_information(v[:2], s)),
        ValueError,
        "3|2",
    ),
    Bad(
        "distributed.predict-unknown-reduction",
        _collective(lambda s, v: _dist().predict(lambda: v, s, reductions=["median"])),
        ValueError,
        "unknown reduction 'median'",
    ),
    Bad(
        "distributed.predict-output-member-count",
        _collective(lambda s, v: _dist().predict(lambda: v[:2], s)),
        ValueError,
        "3|2",
    ),
    Bad(
        "distributed.save-shard-str",
        lambda tmp: Setup(lambda: _dist().save(tmp / "d", {"w": x(3, 2)}, "shard"), [tmp]),
        TypeError,
        "shard",
    ),
    Bad(
        "distributed.load-missing",
        lambda tmp: Setup(lambda: _dist().load(tmp / "nope", {"w": x(3, 2)}), [tmp]),
        FileNotFoundError,
        "nope",
    ),
]


def _dist_load_mismatch(tmp: Path) -> Setup:
    _dist().save(tmp / "d", {"w": x(3, 2)})
    template = {"w": torch.zeros(3, 5, dtype=torch.float64)}
    return Setup(lambda: _dist().load(tmp / "d", template), [tmp, template])


CASES.append(Bad("distributed.load-shape", _dist_load_mismatch, ValueError, r"w"))


@loop("distributed-one-process-collectives")
def _dist_loop(tmp: Path) -> Setup:
    local = x(3, 4)

    def check(out: Any) -> None:
        shard = _dist().MemberShard(3)
        torch.testing.assert_close(_dist().all_gather(local, shard), local, rtol=0, atol=0)
        torch.testing.assert_close(_dist().mean(local, shard), local.mean(0), rtol=1e-14, atol=0)
        torch.testing.assert_close(_dist().max(local, shard), local.max(0).values, rtol=0, atol=0)

    return Setup(lambda: None, [local], check)


# --- borderline inputs that must give the loop's result ------------------------------------


def _loop_case(
    id: str, run: Callable[[], tuple[Any, Any]], *, rtol: float = 1e-12, atol: float = 1e-14
) -> None:
    """``run()`` returns ``(ours, the loop's)``; they must match."""

    def build(tmp: Path) -> Setup:
        return Setup(run, [], lambda out: assert_trees_close(out[0], out[1], rtol=rtol, atol=atol))

    CASES.append(Bad(id, build))


def _member_dim_1() -> tuple[Any, Any]:
    members = mlps()
    fmodel, params, buffers = fe.stack(members)
    inp = x(5, 3, 3)  # the member axis is dim 1
    return fe.vmap(fmodel, in_dims=1)(params, buffers, inp), torch.stack(
        [m(inp[:, i]) for i, m in enumerate(members)]
    )


def _chunked_grads(chunk: int) -> Callable[[], tuple[Any, Any]]:
    def run() -> tuple[Any, Any]:
        members = [bn_net(i) for i in range(3)]
        fmodel, params, buffers = fe.stack(members)
        inp = x(3, 5, 3)
        losses, grads, new_buffers = fe.value_and_grad(
            lambda p, b, v: fmodel(p, b, v).pow(2).mean(), in_dims=0, chunk_size=chunk
        )(params, buffers, inp)
        want_losses = []
        for i, m in enumerate(members):
            loss = m(inp[i]).pow(2).mean()
            loss.backward()
            want_losses.append(loss.detach())
        want_grads = {
            k: torch.stack([dict(m.named_parameters())[k].grad for m in members]) for k in params
        }
        want_buffers = {
            k: torch.stack([dict(m.named_buffers())[k] for m in members]) for k in buffers
        }
        return (losses, grads, new_buffers), (torch.stack(want_losses), want_grads, want_buffers)

    return run


def _one_member_ensemble() -> tuple[Any, Any]:
    member = bn_net(0)
    e = fe.Ensemble([member])
    inp = x(5, 3)
    return (e(inp), e.stacked_buffers()), (
        member(inp)[None],
        {k: v[None] for k, v in member.named_buffers()},
    )


def _module_list() -> tuple[Any, Any]:
    members = nn.ModuleList(mlps())
    inp = x(4, 3)
    return fe.Ensemble(members)(inp), torch.stack([m(inp) for m in members])


def _adam_lr(lr: Any, torch_lr: float) -> Callable[[], tuple[Any, Any]]:
    def run() -> tuple[Any, Any]:
        members = mlps()
        _, params, _ = fe.stack(members)
        params = {k: v.detach().clone() for k, v in params.items()}
        grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
        opt = fe.optim.adam(lr=lr)
        state = opt.init(params)
        for _ in range(2):
            state = opt.update_(grads, state, params)
        for m in members:
            o = torch.optim.Adam(m.parameters(), lr=torch_lr)
            for _ in range(2):
                for p in m.parameters():
                    p.grad = torch.full_like(p, 0.5)
                o.step()
        return params, {
            k: torch.stack([dict(m.named_parameters())[k].detach() for m in members])
            for k in params
        }

    return run


def _reduce_edges() -> tuple[Any, Any]:
    one = x(1, 4)
    values = x(3, 4)
    ours = (fe.reduce.var(one, correction=0), fe.reduce.subset_min(values, 3), fe.reduce.mean(one))
    return ours, (torch.zeros(4, dtype=torch.float64), values.min(0).values, one[0])


def _slices_edges() -> tuple[Any, Any]:
    ours = (
        fe.distributed.member_slices(3, 3),
        fe.distributed.member_slices(1, 1),
        fe.distributed.MemberShard(1).sizes,
    )
    return ours, ([slice(0, 1), slice(1, 2), slice(2, 3)], [slice(0, 1)], (1,))


def _save_load_edge(tmp_dir: Callable[[], Path]) -> Callable[[], tuple[Any, Any]]:
    def run() -> tuple[Any, Any]:
        tree = {
            "empty": {},
            "none": None,
            "flag": True,
            "name": "run-1",
            "w": x(2, 0),
            "i": torch.arange(3),
        }
        path = tmp_dir() / "edge.safetensors"
        fe.save(path, tree)
        template = {
            "empty": {},
            "none": None,
            "flag": False,
            "name": "",
            "w": torch.zeros(2, 0, dtype=torch.float64),
            "i": torch.zeros(3, dtype=torch.int64),
        }
        return fe.load(path, template), tree

    return run


def _polyak_edges() -> tuple[Any, Any]:
    target, online = (
        {"w": x(3, 2), "n": torch.arange(3)},
        {"w": x(3, 2) + 1, "n": torch.arange(3) + 5},
    )
    copy_ = fe.optim.polyak_update(target, online, 1.0)
    keep = fe.optim.polyak_update(target, online, 0.0)
    return (copy_, keep), (online, {"w": target["w"], "n": online["n"]})


def _load_state_dict_non_strict() -> tuple[Any, Any]:
    e, other = ens(3), ens(3, lambda i: mlp(10 + i))
    sd = {k: v for k, v in other.state_dict().items() if k != "stacked.2.bias"}
    before_bias = e.stacked[2].bias.detach().clone()
    result = e.load_state_dict(sd, strict=False)
    ours = (result.missing_keys, e.stacked[0].weight, e.stacked[2].bias)
    return ours, (["stacked.2.bias"], other.stacked[0].weight, before_bias)


_loop_case("vmap-member-dim-1", _member_dim_1)
_loop_case("value_and_grad-chunk-1-bn", _chunked_grads(1), rtol=1e-10, atol=1e-12)
_loop_case("value_and_grad-chunk-larger-than-N-bn", _chunked_grads(7), rtol=1e-10, atol=1e-12)
_loop_case("Ensemble-one-member-bn", _one_member_ensemble)
_loop_case("Ensemble-from-ModuleList", _module_list)
_loop_case("adam-lr-zero", _adam_lr(0.0, 0.0), rtol=0, atol=0)
_loop_case("adam-lr-0-dim-tensor", _adam_lr(torch.tensor(0.01, dtype=torch.float64), 0.01))
_loop_case("reduce-one-member-and-k-equals-N", _reduce_edges, rtol=0, atol=0)
_loop_case("member_slices-one-per-part", _slices_edges)
_loop_case("polyak-tau-0-and-1", _polyak_edges, rtol=0, atol=0)
_loop_case("Ensemble.load_state_dict-non-strict", _load_state_dict_non_strict, rtol=0, atol=0)


@loop("save-load-edge-leaves")
def _save_load_edges(tmp: Path) -> Setup:
    run = _save_load_edge(lambda: tmp)
    return Setup(run, [], lambda out: assert_trees_close(out[0], out[1], rtol=0, atol=0))


# --- the test -------------------------------------------------------------------------------


def _param(case: Bad) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.id, marks=marks)


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case: Bad, tmp_path: Path) -> None:
    with runtime_typecheck_off():
        setup = case.build(tmp_path)
        before = snapshot(setup.watched)
        if case.error is None:
            assert setup.check is not None, "a loop case needs a check"
            setup.check(setup.call())
            return
        with pytest.raises(case.error, match=case.match):
            setup.call()
    assert_unchanged(before, snapshot(setup.watched))


def test_module_face_in_dims_messages_name_its_own_call_and_the_keys():
    """The module face's in_dims errors spoke of "params and buffers", which its user
    never passes, and a dict entry missing a key did not name the key."""

    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, batch):
            return self.lin(batch["x"]) * batch["w"]

    ens = fe.Ensemble([Keyed() for _ in range(3)])
    batch = {"x": torch.randn(3, 4, 3), "w": torch.randn(3, 4, 1)}
    with pytest.raises(
        ValueError,
        match=r"^Ensemble: in_dims has 2 entries but the call passed 1 positional argument\(s\)\.",
    ):
        ens(batch, in_dims=(0, None))
    with pytest.raises(ValueError, match=r"e\.g\. ens\(x, y, in_dims=0\) rather than"):
        ens(batch=batch, in_dims=0)
    with pytest.raises(ValueError, match=r"argument 0 \(dict: in_dims lacks \['w'\]\)"):
        ens(batch, in_dims=({"x": 0},))
    with pytest.raises(ValueError, match=r"in_dims has \['z'\], which the argument does not"):
        ens(batch, in_dims=({"x": 0, "w": 0, "z": 0},))


@pytest.mark.parametrize("layers", ["mlp", "batchnorm"])
@pytest.mark.parametrize("face", ["Ensemble", "vmap"])
def test_an_input_on_the_meta_device_is_refused_before_anything_changes(layers, face):
    """vmap ran a meta input with the members' CPU weights: uninitialized memory out,
    BatchNorm's statistics updated from it; the loop raises."""
    torch.manual_seed(0)
    members = [
        nn.Sequential(
            nn.Linear(4, 4),
            nn.BatchNorm1d(4) if layers == "batchnorm" else nn.ReLU(),
            nn.Linear(4, 3),
        )
        for _ in range(3)
    ]
    with pytest.raises(RuntimeError):
        members[0](torch.randn(5, 4, device="meta"))  # the loop's own refusal
    ens = fe.Ensemble(copy.deepcopy(members))
    fmodel, params, buffers = fe.stack(copy.deepcopy(members))
    before = {k: v.clone() for k, v in {**ens.stacked_buffers(), **buffers}.items()}
    x = torch.randn(5, 4, device="meta")
    call = (lambda: ens(x)) if face == "Ensemble" else (lambda: fe.vmap(fmodel)(params, buffers, x))
    with pytest.raises(
        RuntimeError, match=rf"^{face}: .* is on the meta device, which holds no values"
    ):
        call()
    for k, v in {**ens.stacked_buffers(), **buffers}.items():
        assert torch.equal(v, before[k]), k
