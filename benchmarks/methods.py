"""The competing implementations of one ensemble forward or training step.

Each method builds a [`Runner`][] from the same N initial member modules, the shared
input ``x: [batch, ...]`` and per-member targets ``y: [N, batch, out]``. ``step()`` is the
timed call: an inference forward under ``no_grad`` (returning ``[N, batch, out]``), or
one training step (per-member MSE summed over members, backward, Adam with ``LR``).
``state()`` returns the members' parameters and buffers stacked ``[N, ...]`` under the
member's own state-dict names, so every method can be checked against the loop.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import funcensemble as fe

from .workloads import Workload

LR = 1e-3


class Unsupported(Exception):
    """The method cannot run this workload (a limitation of the library it uses)."""


@dataclass
class Runner:
    step: Callable[[], Any]
    state: Callable[[], dict[str, Tensor]]


Build = Callable[[Workload, list[nn.Module], Tensor, Tensor, bool], Runner]


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    build: Build
    modes: tuple[str, ...] = ("infer", "train")
    mlp_only: bool = False
    compiled: bool = False
    # Why it cannot run here in this mode ("infer"/"train"), or None.
    requires: Callable[[str], str | None] = lambda mode: None

    def applies(self, workload: Workload, mode: str) -> bool:
        return mode in self.modes and (workload.is_mlp or not self.mlp_only)

    def unavailable(self, mode: str) -> str | None:
        return self.requires(mode)


def _stacked_state(modules: list[nn.Module]) -> dict[str, Tensor]:
    dicts = [m.state_dict() for m in modules]
    return {k: torch.stack([d[k] for d in dicts]) for k in dicts[0]}


def _detached(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def _per_member_mse(out: Tensor, y: Tensor) -> Tensor:
    """Each member's own MSE, summed: every member gets its own loss's gradient.

    The sum over members of each member's mean is the total sum of squares over one
    member's element count: two kernels, not four.
    """
    return F.mse_loss(out, y, reduction="sum") / (out.numel() // out.shape[0])


def _adam(params: Any, *, fused: bool = False) -> torch.optim.Adam:
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.Adam(params, lr=LR, **kind)


def _train_runner(
    forward: Callable[[], Tensor], y: Tensor, opt: torch.optim.Optimizer, state: Callable
) -> Runner:
    def step() -> None:
        loss = _per_member_mse(forward(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Runner(step, state)


def _infer_runner(forward: Callable[[], Tensor], state: Callable) -> Runner:
    def step() -> Tensor:
        with torch.no_grad():
            return forward()

    return Runner(step, state)


# -- nn.ModuleList loop ----------------------------------------------------------------


def build_loop(
    w: Workload, members: list[nn.Module], x: Tensor, y: Tensor, train: bool, *, fused: bool = False
) -> Runner:
    mods = nn.ModuleList(members).train(train)
    ys = y.unbind(0)
    state = lambda: _stacked_state(list(mods))  # noqa: E731
    if not train:
        return _infer_runner(lambda: torch.stack([m(x) for m in mods]), state)
    opt = _adam(mods.parameters(), fused=fused)

    def step() -> None:
        loss = torch.stack([F.mse_loss(m(x), ys[i]) for i, m in enumerate(mods)]).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Runner(step, state)


def build_loop_fused(w, members, x, y, train) -> Runner:
    return build_loop(w, members, x, y, train, fused=True)


# -- hand-written MLP baselines --------------------------------------------------------


def _mlp_layers(w: Workload, members: list[nn.Module]) -> list[tuple[str, Tensor, Tensor]]:
    """``(prefix, W [N, out, in], b [N, out])`` of each Linear, by the member's names."""
    state = _stacked_state(members)
    linears = [name for name, m in members[0].named_modules() if isinstance(m, nn.Linear)]
    return [(name, state[f"{name}.weight"], state[f"{name}.bias"]) for name in linears]


def build_conv1d(
    w: Workload, members: list[nn.Module], x: Tensor, y: Tensor, train: bool
) -> Runner:
    """The classic answer for MLP heads: ``Conv1d(N*in, N*out, 1, groups=N)`` per layer.

    The batch is the convolution's length axis (``[1, N*in, batch]``), so one grouped
    convolution runs every member's layer over the whole batch.
    """
    n = len(members)
    layers, convs = _mlp_layers(w, members), []
    for _, weight, bias in layers:
        _, d_out, d_in = weight.shape
        conv = nn.Conv1d(n * d_in, n * d_out, 1, groups=n, device=x.device, dtype=x.dtype)
        with torch.no_grad():
            conv.weight.copy_(weight.reshape(n * d_out, d_in, 1))
            conv.bias.copy_(bias.reshape(n * d_out))
        convs.append(conv)
    act = w.activation()
    net = nn.Sequential(*[m for c in convs for m in (c, act)][:-1])
    d_out = layers[-1][1].shape[1]

    def forward() -> Tensor:
        h = x.t().repeat(n, 1).unsqueeze(0)  # [1, N*in, batch]
        return net(h).view(n, d_out, -1).transpose(1, 2)  # [N, batch, out]

    def state() -> dict[str, Tensor]:
        out = {}
        for (name, weight, _), conv in zip(layers, convs, strict=True):
            out[f"{name}.weight"] = conv.weight.detach().view(weight.shape).clone()
            out[f"{name}.bias"] = conv.bias.detach().view(n, -1).clone()
        return out

    if not train:
        return _infer_runner(forward, state)
    return _train_runner(forward, y, _adam(net.parameters()), state)


def build_bmm(w: Workload, members: list[nn.Module], x: Tensor, y: Tensor, train: bool) -> Runner:
    """Hand-batched linear layers, ``h = baddbmm(b, h, W)`` with ``W: [N, in, out]``."""
    layers = _mlp_layers(w, members)
    weights = [nn.Parameter(wt.transpose(1, 2).contiguous()) for _, wt, _ in layers]
    biases = [nn.Parameter(b.unsqueeze(1).clone()) for _, _, b in layers]
    act = w.activation()
    n = len(members)

    def forward() -> Tensor:
        h = x.expand(n, *x.shape)
        for i, (weight, bias) in enumerate(zip(weights, biases, strict=True)):
            h = torch.baddbmm(bias, h, weight)
            if i < len(weights) - 1:
                h = act(h)
        return h

    def state() -> dict[str, Tensor]:
        out = {}
        for (name, _, _), weight, bias in zip(layers, weights, biases, strict=True):
            out[f"{name}.weight"] = weight.detach().transpose(1, 2).contiguous()
            out[f"{name}.bias"] = bias.detach().squeeze(1).clone()
        return out

    if not train:
        return _infer_runner(forward, state)
    return _train_runner(forward, y, _adam(weights + biases), state)


# -- torch.func by hand ----------------------------------------------------------------


def build_torch_func(
    w: Workload, members: list[nn.Module], x: Tensor, y: Tensor, train: bool
) -> Runner:
    """``stack_module_state`` + ``vmap(grad_and_value(functional_call))`` + Adam(foreach)."""
    from torch.func import functional_call, grad_and_value, stack_module_state, vmap

    for m in members:
        m.train(train)
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    state = lambda: _detached({**params, **buffers})  # noqa: E731
    if not train:
        fwd = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))
        return _infer_runner(lambda: fwd(params, buffers, x), state)

    def loss_one(p: dict, b: dict, x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(functional_call(base, (p, b), (x,)), y)

    grads_of = vmap(grad_and_value(loss_one), in_dims=(0, 0, None, 0))
    opt = _adam(params.values())

    def step() -> None:
        with torch.no_grad():  # grad_and_value differentiates anyway; record nothing outside
            grads, _ = grads_of(params, buffers, x, y)
            for k, p in params.items():
                p.grad = grads[k]
            opt.step()

    return Runner(step, state)


# -- tensordict ------------------------------------------------------------------------


def _tensordict_missing(mode: str) -> str | None:
    try:
        import tensordict.nn  # noqa: F401
    except ImportError:
        return "tensordict is not installed (pip install -e '.[bench]')"
    return None


def build_tensordict(
    w: Workload, members: list[nn.Module], x: Tensor, y: Tensor, train: bool
) -> Runner:
    """tensordict's ``EnsembleModule``, its stacked parameters set to the members'."""
    from tensordict import TensorDict
    from tensordict.nn import EnsembleModule, TensorDictModule

    if any(not b.is_floating_point() for b in members[0].buffers()):
        raise Unsupported(
            "EnsembleModule cannot hold integer buffers (BatchNorm's num_batches_tracked)"
        )
    for m in members:
        m.train(train)
    module = TensorDictModule(copy.deepcopy(members[0]), in_keys=["x"], out_keys=["out"])
    ens = EnsembleModule(module, num_copies=len(members)).train(train)
    with torch.no_grad():  # same initial weights as every other method
        ens.params_td.data["module"].copy_(TensorDict.from_modules(*members).data)
    td = TensorDict({"x": x}, batch_size=[x.shape[0]])

    def forward() -> Tensor:
        return ens(td)["out"]

    def state() -> dict[str, Tensor]:
        flat = ens.params_td.data["module"].flatten_keys(".")
        return {k: v.detach().clone() for k, v in flat.items()}

    if not train:
        return _infer_runner(forward, state)
    return _train_runner(forward, y, _adam(list(ens.params_td.parameters())), state)


# -- funcensemble ----------------------------------------------------------------------


def _fe_ensemble_optimizer_missing(mode: str) -> str | None:
    if not hasattr(getattr(fe, "optim", None), "EnsembleOptimizer"):
        return "this funcensemble has no fe.optim.EnsembleOptimizer"
    return _fe_optim_missing(mode)


def _fe_optim_missing(mode: str) -> str | None:
    if mode == "infer":
        return None
    optim = getattr(fe, "optim", None)
    if optim is None or not hasattr(optim, "adam") or not hasattr(optim, "apply_updates"):
        return "this funcensemble has no fe.optim.adam / fe.optim.apply_updates"
    return None


def _ensemble_runner(
    members: list[nn.Module],
    x: Tensor,
    y: Tensor,
    train: bool,
    *,
    compiled: bool = False,
    fe_optimizer: bool = False,
) -> Runner:
    ens = fe.Ensemble(members).train(train)
    state = lambda: _detached(ens.stacked.state_dict())  # noqa: E731
    if not train:
        model = torch.compile(ens, dynamic=False) if compiled else ens
        return _infer_runner(lambda: model(x), state)
    if fe_optimizer:
        opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(LR))
    else:
        opt = _adam(ens.parameters())
    runner = _train_runner(lambda: ens(x), y, opt, state)
    if compiled:
        runner.step = torch.compile(runner.step, dynamic=False)
    return runner


def build_fe_ensemble(w, members, x, y, train) -> Runner:
    """The module face: ``fe.Ensemble`` + ``torch.optim.Adam(foreach=True)``."""
    return _ensemble_runner(members, x, y, train, compiled=False)


def build_fe_ensemble_optimizer(w, members, x, y, train) -> Runner:
    """The module face stepped by ``fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr))``."""
    return _ensemble_runner(members, x, y, train, fe_optimizer=True)


def build_fe_ensemble_compiled(w, members, x, y, train) -> Runner:
    """The module face with the whole step under ``torch.compile``."""
    return _ensemble_runner(members, x, y, train, compiled=True)


def _functional_runner(
    members: list[nn.Module],
    x: Tensor,
    y: Tensor,
    train: bool,
    *,
    compiled: bool,
    pure: bool = False,
) -> Runner:
    for m in members:
        m.train(train)
    fmodel, params, buffers = fe.stack(members)
    params = {k: v.detach() for k, v in params.items()}
    held = {"params": params, "buffers": buffers}
    state = lambda: _detached({**held["params"], **held["buffers"]})  # noqa: E731
    if not train:
        fwd = fe.vmap(fmodel)
        return _infer_runner(lambda: fwd(held["params"], held["buffers"], x), state)

    def loss_fn(p: dict, b: dict, x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(fmodel(p, b, x), y)

    value_and_grad = fe.value_and_grad(loss_fn, in_dims=(None, 0))
    opt = fe.optim.adam(LR)
    held["opt"] = opt.init(params)

    def update(params: dict, buffers: dict, opt_state: Any) -> tuple[dict, dict, Any]:
        _, grads, buffers = value_and_grad(params, buffers, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return fe.optim.apply_updates(params, updates), buffers, opt_state

    if pure:
        # Eager, the design's pure road: new params and state every step.
        def step_pure() -> None:
            held["params"], held["buffers"], held["opt"] = update(
                held["params"], held["buffers"], held["opt"]
            )

        return Runner(step_pure, state)
    if not compiled:
        # Eager: the in-place step (torch.optim's fused Adam kernel), as a
        # speed-minded user writes it.
        def step_() -> None:
            _, grads, held["buffers"] = value_and_grad(held["params"], held["buffers"], x, y)
            held["opt"] = opt.update_(grads, held["opt"], held["params"])

        return Runner(step_, state)
    # Compiled: the pure step, which inductor fuses into the backward's kernels.
    update = torch.compile(update, dynamic=False)

    def step() -> None:
        held["params"], held["buffers"], held["opt"] = update(
            held["params"], held["buffers"], held["opt"]
        )

    return Runner(step, state)


def build_fe_functional_compiled_in_place(w, members, x, y, train) -> Runner:
    """docs/how-to/compile.md's recipe: ``fe.stack``'s own parameters, the whole step
    (``fe.value_and_grad`` + ``update_``) under ``torch.compile(fullgraph=True)``."""
    fmodel, params, buffers = fe.stack(members)
    held = {"buffers": buffers}
    state = lambda: _detached({**params, **held["buffers"]})  # noqa: E731

    def loss_fn(p: dict, b: dict, x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(fmodel(p, b, x), y)

    value_and_grad = fe.value_and_grad(loss_fn, in_dims=(None, 0))
    opt = fe.optim.adam(LR)
    held["opt"] = opt.init(params)

    def train_step(params: dict, buffers: dict, opt_state: Any) -> tuple[dict, Any]:
        _, grads, buffers = value_and_grad(params, buffers, x, y)
        return buffers, opt.update_(grads, opt_state, params)

    compiled = torch.compile(train_step, fullgraph=True, dynamic=False)

    def step() -> None:
        held["buffers"], held["opt"] = compiled(params, held["buffers"], held["opt"])

    return Runner(step, state)


def build_fe_functional(w, members, x, y, train) -> Runner:
    """The functional face: ``fe.value_and_grad`` + ``fe.optim.adam(...).update_``."""
    return _functional_runner(members, x, y, train, compiled=False)


def build_fe_functional_pure(w, members, x, y, train) -> Runner:
    """The functional face, pure: ``fe.value_and_grad`` + ``fe.optim.adam(...).update``
    + ``fe.optim.apply_updates`` (nothing updated in place)."""
    return _functional_runner(members, x, y, train, compiled=False, pure=True)


def build_fe_functional_compiled(w, members, x, y, train) -> Runner:
    """The functional face, the whole pure step under ``torch.compile``."""
    return _functional_runner(members, x, y, train, compiled=True)


METHODS: dict[str, Method] = {
    m.key: m
    for m in (
        Method("loop", "nn.ModuleList loop + Adam(foreach)", build_loop),
        Method(
            "loop-fused", "nn.ModuleList loop + Adam(fused)", build_loop_fused, modes=("train",)
        ),
        Method("conv1d", "grouped Conv1d + Adam(foreach)", build_conv1d, mlp_only=True),
        Method("bmm", "baddbmm by hand + Adam(foreach)", build_bmm, mlp_only=True),
        Method("torch.func", "torch.func vmap(grad_and_value) + Adam(foreach)", build_torch_func),
        Method(
            "tensordict",
            "tensordict EnsembleModule + Adam(foreach)",
            build_tensordict,
            requires=_tensordict_missing,
        ),
        Method("fe.Ensemble", "fe.Ensemble + Adam(foreach)", build_fe_ensemble),
        Method(
            "fe.EnsembleOptimizer",
            "fe.Ensemble + fe.optim.EnsembleOptimizer(adam)",
            build_fe_ensemble_optimizer,
            modes=("train",),
            requires=_fe_ensemble_optimizer_missing,
        ),
        Method(
            "fe.functional",
            "fe.value_and_grad + fe.optim.adam update_",
            build_fe_functional,
            requires=_fe_optim_missing,
        ),
        Method(
            "fe.functional-pure",
            "fe.value_and_grad + fe.optim.adam update + apply_updates",
            build_fe_functional_pure,
            modes=("train",),
            requires=_fe_optim_missing,
        ),
        Method(
            "fe.Ensemble+compile",
            "torch.compile(fe.Ensemble step)",
            build_fe_ensemble_compiled,
            compiled=True,
        ),
        Method(
            "fe.functional+compile",
            "torch.compile(fe.value_and_grad + fe.optim.adam step)",
            build_fe_functional_compiled,
            modes=("train",),
            compiled=True,
            requires=_fe_optim_missing,
        ),
        Method(
            "fe.functional+compile_",
            "torch.compile(fe.value_and_grad + fe.optim.adam update_), fullgraph",
            build_fe_functional_compiled_in_place,
            modes=("train",),
            compiled=True,
            requires=_fe_optim_missing,
        ),
    )
}
